"""The CGOPipe runtime with quantized experts on the emulated device, the fused dequant-GEMM forced
(MOELIGHT_DEQUANT_GEMM=fused: Triton's interpreter on the CPU tensors) against the expand path: the
same greedy tokens, the logits within the dtype's rounding, and neither the dense layer buffer nor
its share of the memory plan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moelight.models import fused_dequant  # noqa: E402
from tests.runtime_check import assert_same_run  # noqa: E402
from tests.test_quantized_paging import _quantized_pair, _run, job  # noqa: E402, F401


@pytest.mark.parametrize("method,dtype", [("int4", torch.float32), ("int8", torch.float32),
                                          ("int4", torch.bfloat16)], ids=str)
def test_fused_runtime_takes_the_expand_path_s_tokens(job, monkeypatch, method, dtype):  # noqa: F811
    prompts, params = job
    held, _ = _quantized_pair(method, dtype)
    runs = {}
    for mode in ("expand", "fused"):
        monkeypatch.setenv(fused_dequant.MODE_ENV, mode)
        runs[mode] = _run(held, prompts, params, r_w=0.5)
    (fused, _, _, peak, planned), (expand, _, _, expand_peak, expand_planned) = runs["fused"], runs["expand"]
    if dtype == torch.float32:
        assert_same_run(fused, expand, rtol=1e-4, atol=1e-4, what=f"{method} fused")
    assert fused.tokens == expand.tokens
    # the dense layer (E x 3hf values of the run's dtype) and the expansion's scratch are gone from both
    assert peak <= planned < expand_planned and peak < expand_peak
