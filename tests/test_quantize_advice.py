"""A job whose 16-bit routed experts do not fit says, before loading, whether --quantize int8 or int4 would, as
the planner would then plan it; it says nothing of --quantize where the user already gave it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hrm import hardware_presets
from moelight.cli import app
from tests.cli_text import says

# qwen3-30b-a3b's weights: ~57 GiB with bf16 experts, ~31-33 with int8, ~18-20 with int4 (the CPU engine's float32
# copies of the attention and LM head, on hosts that pack no bf16, add ~2 GiB to each)
CASES = [(48, "with --quantize int8 it fits"), (30, "with --quantize int4 it fits"),
         (8, "it would not fit with --quantize int4 either")]


def _host(tmp_path, gib: int) -> str:
    hw = hardware_presets.get_hardware("cpu-server").to_dict()
    hw["cpu"]["memory_bytes"], hw["name"] = gib << 30, f"host-{gib}g"
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(hw))
    return str(path)


class Loaded(Exception):
    """Raised where the job would load its weights: it was planned and checked."""


def _load(*args, **kwargs):
    raise Loaded


def _run(tmp_path, monkeypatch, gib: int, *extra: str, free_gib: int | None = None):
    """`run` on a host of `gib` GiB: the hardware file the planner reads and the memory the check before loading
    sees (this process's own memory aside), so both count one machine; or `free_gib` free of them now."""
    from moelight.engine import session
    from moelight.planning import memory_check

    monkeypatch.setattr(session, "load_model", _load)
    free = (gib if free_gib is None else free_gib) << 30
    monkeypatch.setattr(session, "available_bytes", lambda: free)
    monkeypatch.setattr(memory_check, "available_bytes", lambda: free)  # the check at load
    monkeypatch.setattr(memory_check, "process_bytes", lambda: 0)
    monkeypatch.setattr(memory_check, "RUNTIME_GROWTH", 0)
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"id": str(i), "prompt": "hello " * (i + 1)}) + "\n" for i in range(4)))
    return CliRunner().invoke(app, ["run", "--dataset", str(ds), "--model", "qwen3-30b-a3b", "--load-format", "dummy",
                                    "--output", str(tmp_path / "o.jsonl"), "--device", "cpu", "--gpus", "0",
                                    "--hardware", _host(tmp_path, gib), *extra])


@pytest.mark.parametrize("gib,advice", CASES)
def test_a_job_too_big_in_16_bits_says_which_quantization_fits(tmp_path, monkeypatch, gib, advice):
    r = _run(tmp_path, monkeypatch, gib)
    assert r.exit_code == 2, r.output
    assert says(r.output, "does not fit") and says(r.output, advice), r.output
    assert not (tmp_path / "o.jsonl").exists()


def test_the_advice_is_what_the_quantized_job_then_plans(tmp_path, monkeypatch):
    """The int4 advice's batch and rate are the plan `--quantize int4` then makes on the same host."""
    r = _run(tmp_path, monkeypatch, 30)
    advised = r.output.split("with --quantize int4 it fits: ")[1].split()
    r = _run(tmp_path, monkeypatch, 30, "--quantize", "int4")
    assert isinstance(r.exception, Loaded), r.output  # planned, checked and then loading (stopped here)
    assert says(r.output, f"batch {advised[1].rstrip(',')}") and says(r.output, f"predicted {advised[3]} tok/s")


def test_no_advice_where_quantize_is_already_given(tmp_path, monkeypatch):
    r = _run(tmp_path, monkeypatch, 8, "--quantize", "int4")
    assert r.exit_code == 2 and says(r.output, "does not fit"), r.output
    assert not says(r.output, "it fits:") and not says(r.output, "would not fit with"), r.output


def test_the_check_before_loading_gives_the_same_advice(tmp_path, monkeypatch):
    """A hardware file that declares more memory than is free now: the planner's 16-bit plan passes, the check
    before loading refuses it, and says what the quantized job would need of the memory free now."""
    r = _run(tmp_path, monkeypatch, 96, free_gib=30)
    assert r.exit_code == 2, r.output
    assert says(r.output, "does not fit in CPU memory") and says(r.output, "with --quantize int4 it fits"), r.output


def test_plan_gives_the_advice_too(tmp_path):
    """`moelight plan` on a host too small for 16-bit experts: the refusal and what fits instead; with
    --quantize int8 the plan then succeeds."""
    hw = _host(tmp_path, 48)
    r = CliRunner().invoke(app, ["plan", "--model", "qwen3-30b-a3b", "--hardware", hw, "--gpus", "0"])
    assert r.exit_code == 2 and says(r.output, "no policy fits") and says(r.output, "with --quantize int8 it fits")
    r = CliRunner().invoke(app, ["plan", "--model", "qwen3-30b-a3b", "--hardware", hw, "--gpus", "0",
                                 "--quantize", "int8"])
    assert r.exit_code == 0, r.output
