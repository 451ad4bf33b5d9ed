"""MXFP4 experts (GPT-OSS's, kept packed) have an expert-kernel curve of their own: on AVX2 they multiply on
int8 activations, several times bf16's rate at few rows, so a profile that measured the kernel's formats
without MXFP4 (it priced GPT-OSS's experts at bf16's rate) is retaken, and a model holding MXFP4 experts
is priced by that curve."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hrm import costs, get_model
from hrm import operators as ops
from moelight.planning.hardware_choice import _profile_is_stale
from tests.current_profile import measured_cpu, save_current_profile

BF16 = [[1.0, 1e9], [256.0, 4e11]]
MXFP4 = [[1.0, 3e9], [256.0, 6e11]]


@pytest.mark.parametrize("curves, stale", [
    (None, False),                                             # no expert kernel measured (torch fallback)
    ({"bfloat16": BF16, "int8": BF16, "uint4": BF16}, True),  # measured before MXFP4 had its products
    ({"bfloat16": BF16, "int8": BF16, "uint4": BF16, "mxfp4": MXFP4}, False),
])
def test_a_profile_without_the_mxfp4_curve_is_retaken(tmp_path, curves, stale):
    cpu = measured_cpu() if curves is None else measured_cpu(expert_gemm_flops=curves)
    path = save_current_profile(tmp_path / "hardware.json", cpu)
    assert ("mxfp4" in json.loads(path.read_text())["cpu"].get("expert_gemm_flops", {})) == (curves is not None
                                                                                               and not stale)
    assert _profile_is_stale(path) is stale


def test_mxfp4_experts_are_priced_by_their_curve():
    lvl = measured_cpu(expert_gemm_flops={"bfloat16": BF16, "mxfp4": MXFP4})
    m = get_model("bench-1b")
    held = replace(m, expert_bits=4.25, expert_format="mxfp4")
    assert lvl.expert_peak("bfloat16", 256, "mxfp4") == pytest.approx(6e11)
    assert float(costs.expert_time(held, 256, lvl, "bfloat16")) == pytest.approx(
        float(ops.expert_ffn(held, 256, 2.0).flops) / 6e11)
