"""Expert-cache and throughput-only options are either used or said to be unused: `--mode auto`
may choose throughput mode (no expert cache), and latency mode runs no CGOPipe schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from tests.cli_text import says
from tests.test_cli_run import report_of, write_jsonl

pytestmark = pytest.mark.no_race_check  # options used; ordering: test_expert_cache_runtime

CKPT = Path(__file__).parent / "data" / "stdlib-moe"
PROMPTS = ["def __init__(self, name, value=None):\n    ", "import os\nimport sys\n\n\ndef main(",
           "class Config:\n    def __init__(self", "    return sorted("]


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def run(tmp_path: Path, *extra) -> object:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "prompt": p, "max_tokens": 8} for i, p in enumerate(PROMPTS)])
    return invoke("run", "--dataset", data, "--model", CKPT, "--dtype", "float32", "--device", "emulated",
                  "--hardware", "t4", "--no-progress", "--output", tmp_path / "o.jsonl", *extra)


def test_auto_mode_choosing_throughput_says_the_cache_options_went_unused(tmp_path):
    """The HRM's choice depends on the workload, so the job runs in the faster mode, but the options
    the user gave are named as unused on the console and in the report, with the way to use them."""
    res = run(tmp_path, "--cache-policy", "lru", "--cache-size", "8")
    assert res.exit_code == 0, res.output
    rep = report_of(tmp_path / "o.jsonl")
    assert rep["policy"]["mode"] == "throughput"
    warning = "--cache-policy, --cache-size unused: --mode auto chose throughput mode"
    assert says(res.output, "warning: " + warning) and says(res.output, "add --mode latency")
    assert any(warning in note for note in rep["notes"]), rep["notes"]


@pytest.mark.parametrize("extra, named", [
    (["--schedule", "flexgen"], "--schedule"),
    (["--batch-size", "4", "--micro-batch-size", "1"], "--micro-batch-size"),
])
def test_latency_mode_refuses_throughput_only_options(tmp_path, extra, named):
    """Latency mode runs one batch through the expert cache: a schedule or micro-batch size would be
    recorded as used and do nothing."""
    res = run(tmp_path, "--mode", "latency", *extra)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"{named}: throughput mode's (CGOPipe's) options, and --mode is latency")
    assert not (tmp_path / "o.jsonl").exists()


def test_auto_mode_choosing_latency_says_the_throughput_options_went_unused(tmp_path):
    res = run(tmp_path, "--num-requests", "1", "--schedule", "flexgen")
    assert res.exit_code == 0, res.output
    rep = report_of(tmp_path / "o.jsonl")
    assert rep["policy"]["mode"] == "latency" and "schedule" not in rep["policy"]
    assert says(res.output, "warning: --schedule unused: --mode auto chose latency mode")
    assert any("add --mode throughput" in note for note in rep["notes"]), rep["notes"]


@pytest.mark.parametrize("policy", ["on-demand", "lru", "lfu"])
def test_prefetch_per_layer_is_refused_for_a_policy_that_never_prefetches(tmp_path, policy):
    res = run(tmp_path, "--mode", "latency", "--cache-policy", policy, "--prefetch-per-layer", "3")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"--prefetch-per-layer 3: --cache-policy {policy} never prefetches")


def test_simulate_cache_refuses_prefetch_per_layer_for_policies_that_never_prefetch(tmp_path):
    res = invoke("simulate-cache", "--trace", tmp_path / "missing.parquet", "--policy", "lru,lfu",
                 "--prefetch-per-layer", "2")
    assert res.exit_code == 2 and says(res.output, "--prefetch-per-layer 2: --policy lru,lfu never prefetches")


def test_prefetching_names_the_policies_that_propose_prefetches():
    from moelight.expert_cache import policy_registry as r

    classes = {"on-demand": r.OnDemand, "lru": r.LRU, "lfu": r.LFU, "moe-infinity": r.MoEInfinity,
               "promoe": r.ProMoE, "duoserve": r.DuoServe, "coserve": r.CoServe, "combined": r.Combined}
    assert set(classes) == set(r.POLICIES)
    assert {name for name, cls in classes.items() if cls.predicts} == set(r.PREFETCHING)


def test_a_cache_below_one_layers_experts_is_refused_when_the_llm_is_built():
    """The model's config says how many experts a layer has: LLM() refuses, not its first generate()."""
    from moelight import LLM
    from moelight.engine.options import OptionError

    with pytest.raises(OptionError, match=r"--cache-size 1: 1 expert slot\(s\), fewer than one layer's 8 experts"):
        LLM(str(CKPT), device="emulated", hardware="t4", mode="latency", cache_size=1)


def test_an_eamc_file_of_another_model_is_refused_before_the_plan(tmp_path):
    """The collection's shape is checked against the model's config before the plan (and its profile)."""
    import numpy as np

    from moelight.expert_cache.eam import EAMCollection

    eamc = EAMCollection(np.ones((2, 3, 8)), "other").save(tmp_path / "other.npz")  # 3 MoE layers, not 4
    res = run(tmp_path, "--mode", "latency", "--eamc", eamc)
    assert res.exit_code == 2 and says(res.output, "--eamc") and says(res.output, "this model routes 4 x 8"), res.output
    assert "policy (" not in res.output  # refused before the plan


def test_latency_mode_prices_its_cpu_crossover_on_the_experts_as_held(monkeypatch):
    """With --quantize int8, the combined policy's CPU crossover and prefetch budget are priced on
    8-bit experts (the plan's slots are), not on the checkpoint's 16-bit ones."""
    from moelight import LLM, SamplingParams
    from moelight.expert_cache import cache_simulator

    seen = []

    class SpyTimer(cache_simulator.PassTimer):
        def __init__(self, hw, spec, dtype):
            seen.append(spec.expert_bits)
            super().__init__(hw, spec, dtype)

    monkeypatch.setattr(cache_simulator, "PassTimer", SpyTimer)
    llm = LLM(str(CKPT), device="emulated", hardware="t4", mode="latency", cache_policy="combined",
              quantize="int8", dtype="float32")
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert seen and all(8.0 <= bits < 8.5 for bits in seen), seen


def test_a_bad_dequant_gemm_setting_is_refused_when_the_llm_is_built(monkeypatch):
    """MOELIGHT_DEQUANT_GEMM is named before anything loads, with what to do, not when the device runtime is
    built after the load."""
    from moelight import LLM
    from moelight.engine.options import OptionError

    monkeypatch.setenv("MOELIGHT_DEQUANT_GEMM", "fast")
    with pytest.raises(OptionError, match=r"MOELIGHT_DEQUANT_GEMM='fast': auto, fused or expand; set it"):
        LLM(str(CKPT), device="emulated", hardware="t4", quantize="int4")
