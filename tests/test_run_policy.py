"""`moelight run` plans its policy (HRM + optimizer) before loading anything."""

import json

import pytest
import torch
from typer.testing import CliRunner

from hrm import HardwareSpec, Level
from hrm.hardware import Link
from moelight.cli import app
from moelight.planning.job_plan import workload_of
from moelight.runtime.cpu_linear import keeps_plain_weights
from moelight.sampling.params import SamplingParams
from optimizer import Policy, fit_policy
from tests.cli_text import says

runner = CliRunner()
GiB = 2**30


@pytest.fixture
def model_only_host(monkeypatch):
    """A tiny host file's memory for the model alone: this process's own is aside (tests/test_process_memory.py)."""
    from moelight.planning import memory_check

    monkeypatch.setattr(memory_check, "process_bytes", lambda: 0)
    monkeypatch.setattr(memory_check, "RUNTIME_GROWTH", 0)


def _hardware(tmp_path, memory=16 * GiB, name="hw.json"):
    """A fixed CPU-only profile, so the plan does not depend on this machine's timings."""
    cpu = Level("test-cpu", memory, 20e9, {"float32": 100e9, "bfloat16": 200e9},
                gemm_flops={"bfloat16": [[1, 2e9], [64, 100e9], [1024, 200e9]]},
                attention_bandwidth=10e9, layer_overhead_s=2e-4, step_overhead_s=5e-4)
    return str(HardwareSpec("test-host", cpu).save(tmp_path / name))


def _dataset(tmp_path, n=5):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "hello world " * (i + 1)}) + "\n"
                            for i in range(n)))
    return str(path)


def _run(tmp_path, *extra, n=5, model=("--model", "tiny", "--load-format", "dummy")):
    out = tmp_path / "out.jsonl"
    args = ["run", "--dataset", _dataset(tmp_path, n), *model,
            "--output", str(out), "--gen-len", "3", "--no-progress", *extra]
    r = runner.invoke(app, args)
    report = out.with_name(out.name + ".report.json")
    return r, (json.loads(report.read_text()) if report.exists() else None), out


def test_auto_plans_cpu_policy_capped_to_requests(tmp_path):
    r, rep, out = _run(tmp_path, "--hardware", _hardware(tmp_path))
    assert r.exit_code == 0, r.output
    pol = rep["policy"]
    assert pol["source"] == "auto" and pol["hardware"] == "test-host"
    assert (pol["attn_on_gpu"], pol["ffn_on_gpu"]) == (False, False)
    assert rep["batch_size"] == pol["batch_size"] == 5  # the plan's N is capped at the 5 requests
    assert rep["micro_batch_size"] == pol["micro_batch_size"]
    pred = rep["prediction"]
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "end_to_end_tokens_per_s", "binding"):
        assert key in pred
    assert pred["end_to_end_tokens_per_s"] > 0 and pred["binding"] == "cpu"
    assert says(r.output, "tok/s end-to-end (HRM)") and says(r.output, "predicted     prefill")
    assert len(out.read_text().splitlines()) == 5


def test_saved_policy_is_honoured(tmp_path):
    pol = Policy(2, 1, 2, False, False, 0.0, 0.0, "float32").save(tmp_path / "policy.json")
    r, rep, _ = _run(tmp_path, "--hardware", _hardware(tmp_path), "--policy", str(pol))
    assert r.exit_code == 0, r.output
    assert (rep["batch_size"], rep["micro_batch_size"]) == (2, 1)
    assert rep["policy"]["source"] == str(pol) and rep["policy"]["num_micro_batches"] == 2
    assert rep["prediction"]["end_to_end_tokens_per_s"] > 0


def test_explicit_batch_size_wins(tmp_path):
    r, rep, _ = _run(tmp_path, "--hardware", _hardware(tmp_path), "--batch-size", "3",
                     "--micro-batch-size", "2")
    assert r.exit_code == 0, r.output
    assert (rep["batch_size"], rep["micro_batch_size"]) == (3, 2)
    assert rep["policy"]["batch_size"] == 3 and rep["policy"]["planned"]["batch_size"] >= 5
    assert rep["prediction"]["batches"] == 2  # 5 requests in batches of 3: what actually runs


def test_explicit_batch_size_gets_the_fit_check_of_a_policy_file(tmp_path, model_only_host):
    """--batch-size is checked against the HRM's memory model before loading, as a --policy file's sizes are
    (it was not: the job loaded and ran out of memory mid-job), naming the option and the largest that fits."""
    from moelight.loading.presets import PRESETS
    from moelight.planning.memory_check import cpu_engine_extra_bytes

    # the tiny model's weights and a small batch (its longest prompt), and its float32 copies where this CPU makes them
    copies = cpu_engine_extra_bytes(PRESETS["tiny"], torch.bfloat16, True)
    hw = _hardware(tmp_path, memory=int(3.0 * 2**20) + copies)
    r, rep, out = _run(tmp_path, "--hardware", hw, "--batch-size", "48", n=48)
    assert r.exit_code == 2, r.output
    assert says(r.output, "--batch-size 48 does not fit test-host") and says(r.output, "kv_cache")
    assert says(r.output, "at most --batch-size") and "Traceback" not in r.output
    assert rep is None and not out.exists()
    r, rep, _ = _run(tmp_path, "--hardware", hw, n=48)  # the planner's own batch fits the same machine
    assert r.exit_code == 0 and rep["batch_size"] < 48, r.output


def test_explicit_micro_batch_size_is_checked_against_device_memory():
    """A micro-batch whose activations overflow the GPU is refused before loading, with one that fits."""
    from moelight.engine.options import EngineOptions
    from moelight.loading.presets import PRESETS
    from moelight.planning.hardware_choice import PlanError
    from moelight.planning.job_plan import plan_job

    prompts, params = [[1] * 64] * 4096, [SamplingParams(max_tokens=8)] * 4096
    opts = EngineOptions(model="mixtral-8x7b", hardware="t4", mode="throughput", enable_prefix_caching=False,
                         micro_batch_size=4096, max_prefill_tokens=1 << 20)
    with pytest.raises(PlanError, match=r"--micro-batch-size 4096 does not fit t4(.|\n)*GPU memory(.|\n)*"
                                        r"at most --micro-batch-size \d+ fits"):
        plan_job(opts, PRESETS["mixtral-8x7b"], "float16", prompts, params, "emulated")


def test_explicit_batch_size_in_latency_mode_is_checked_with_its_decode_attention(tmp_path):
    """Latency mode's fit check counts a decode step's attention temporaries (K and V gathered in float32,
    the scores), which outgrow a prefill's activations on a short model: --batch-size 256 loaded and ran out
    of device memory at its first decode step. It is refused before loading, naming the option and the
    largest batch that fits, and that batch plans."""
    from moelight.engine.options import EngineOptions
    from moelight.loading.presets import PRESETS
    from moelight.planning.hardware_choice import PlanError
    from moelight.planning.job_plan import plan_job

    hw = HardwareSpec.load(_hardware(tmp_path))
    gpu = Level("small-gpu", 40 * 2**20, 200e9, {"float32": 8e12, "bfloat16": 20e12})
    small = str(HardwareSpec("small", hw.cpu, gpu, 1, Link(12e9, 12e9)).save(tmp_path / "small.json"))
    prompts, params = [[1] * 256] * 256, [SamplingParams(max_tokens=4)] * 256

    def planned(batch):
        opts = EngineOptions(model="tiny", hardware=small, mode="latency", enable_prefix_caching=False,
                             batch_size=batch)
        return plan_job(opts, PRESETS["tiny"], "bfloat16", prompts, params, "emulated")

    with pytest.raises(PlanError, match=r"--batch-size 256 does not fit small in latency mode(.|\n)*"
                                        r"at most --batch-size \d+ fits") as e:
        planned(256)
    best = int(str(e.value).split("at most --batch-size ")[1].split()[0])
    assert 128 < best < 256 and planned(best).batch_size == best


def test_infeasible_plan_exits_2_before_loading(tmp_path, model_only_host):
    r, rep, out = _run(tmp_path, "--hardware", _hardware(tmp_path, memory=2**14))
    assert r.exit_code == 2, r.output
    assert says(r.output, "does not fit") and says(r.output, "CPU memory short by")
    assert rep is None and not out.exists()


def test_gpu_policy_on_cpu_host_is_a_clear_error(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    pol = Policy(4, 4, 1, False, True, 0.5, 0.0, "float32").save(tmp_path / "gpu.json")
    r, _, out = _run(tmp_path, "--hardware", _hardware(tmp_path), "--policy", str(pol))
    assert r.exit_code == 2, r.output
    assert says(r.output, "MoE FFN on the GPU") and says(r.output, "--device emulated")
    assert not out.exists()
    r, _, _ = _run(tmp_path, "--hardware", "t4")  # a GPU preset plans a GPU policy
    assert r.exit_code == 2 and says(r.output, "on the GPU"), r.output
    r, rep, _ = _run(tmp_path, "--hardware", "t4", "--gpus", "0")
    assert r.exit_code == 0, r.output
    assert rep["policy"]["ffn_on_gpu"] is False


@pytest.mark.parametrize("schedule", ["cgopipe", "flexgen-cpu"])
def test_gpu_policy_runs_on_the_emulated_device_with_the_cpu_tokens(tmp_path, schedule):
    """`--device emulated` runs a GPU policy through the CGOPipe runtime: the CPU engine's tokens.

    A checkpoint with well-separated logits (tests/checkpoints.py), not the dummy preset,
    whose near-tied logits would let float rounding pick between equals."""
    from tests.checkpoints import make_hf_model, save_checkpoint

    model = ("--model", str(save_checkpoint(make_hf_model(), tmp_path / "ckpt")))
    pol = Policy(4, 2, 2, False, True, 0.5, 0.0, "float32").save(tmp_path / "gpu.json")
    r, rep, out = _run(tmp_path, "--hardware", "t4", "--policy", str(pol), "--device", "emulated",
                       "--schedule", schedule, "--dtype", "float32", model=model)
    assert r.exit_code == 0, r.output
    assert rep["policy"]["ffn_on_gpu"] is True and rep["policy"]["device"] == "emulated"
    assert rep["policy"]["schedule"] == schedule
    piped = {r["id"]: r["output_token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    out.unlink()
    r, rep, out = _run(tmp_path, "--hardware", _hardware(tmp_path), "--device", "cpu", "--dtype", "float32",
                       model=model)
    assert r.exit_code == 0, r.output
    assert rep["policy"]["device"] == "cpu"
    plain = {r["id"]: r["output_token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert piped == plain and len(plain) == 5


def test_device_plans_only_the_placement_its_runtime_runs(tmp_path):
    """On a device the plan searches the schedule's placement alone (CGOPipe: attention on the CPU, the
    FFN on the device), so its memory check is for what runs: a GPU too small for the runtime is refused
    before loading, not planned "all on CPU" and then run out of device memory."""
    hw = HardwareSpec.load(_hardware(tmp_path))
    gpu = Level("tiny-gpu", 1_600_000, 200e9, {"float32": 8e12, "float16": 20e12})
    tiny = str(HardwareSpec("tiny", hw.cpu, gpu, 1, Link(12e9, 12e9)).save(tmp_path / "tiny.json"))
    r, rep, out = _run(tmp_path, "--hardware", tiny, "--device", "emulated", "--dtype", "float32",
                       "--mode", "throughput")
    assert r.exit_code == 2, r.output
    assert says(r.output, "does not fit") and says(r.output, "attention on CPU, FFN on GPU")
    assert rep is None and not out.exists()
    r, rep, out = _run(tmp_path, "--hardware", tiny, "--device", "emulated", "--dtype", "float32")
    assert r.exit_code == 0, r.output  # auto: latency mode's expert cache fits where CGOPipe does not
    assert rep["policy"]["mode"] == "latency" and says(r.output, "throughput mode does not fit")
    (tmp_path / "again").mkdir()
    r, rep, out = _run(tmp_path / "again", "--hardware", tiny, "--device", "emulated", "--dtype", "float32",
                       "--mode", "latency", "--cache-size", "1000")  # every routed expert: more than fit
    assert r.exit_code == 2 and says(r.output, "expert slots do not fit on one tiny-gpu"), r.output
    assert says(r.output, "at most") and "Traceback" not in r.output  # refused before loading
    assert rep is None and not out.exists()
    pol = Policy(4, 2, 2, True, False, 0.0, 0.0, "float32").save(tmp_path / "attn_gpu.json")
    r, _, out = _run(tmp_path / "again", "--hardware", "t4", "--policy", str(pol), "--device", "emulated")
    assert r.exit_code == 2, r.output
    assert says(r.output, "--schedule cgopipe runs attention on CPU") and not out.exists()


def test_unknown_device(tmp_path):
    r, _, out = _run(tmp_path, "--hardware", _hardware(tmp_path), "--device", "tpu")
    assert r.exit_code == 2 and says(r.output, "--device 'tpu'"), r.output
    assert not out.exists()


def test_bad_policy_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"batch_size": 3, "micro_batch_size": 2, "num_micro_batches": 1}')
    r, _, _ = _run(tmp_path, "--hardware", _hardware(tmp_path), "--policy", str(bad))
    assert r.exit_code == 2 and says(r.output, "not a policy JSON"), r.output


def test_fit_policy_and_workload():
    p = Policy(64, 16, 4, False, False, 0.0, 0.0)
    assert fit_policy(p, 100) == p
    small = fit_policy(p, 10)
    assert (small.batch_size, small.micro_batch_size, small.num_micro_batches) == (10, 10, 1)
    mid = fit_policy(p, 40)
    assert mid.num_micro_batches == 3 and mid.micro_batch_size == 14 and mid.batch_size == 42
    wl = workload_of([[1] * 10, [1] * 30], [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8)])
    assert (wl.prompt_len, wl.max_prompt_len, wl.gen_len) == (20, 30, 8)


def test_cached_profile_from_an_older_version_is_retaken(tmp_path, monkeypatch):
    from hrm import HardwareSpec, Level, hardware_presets
    from moelight.planning import hardware_choice
    from moelight.profiling import machine_profile as hardware_profile
    from tests.current_profile import current_profile

    cached = tmp_path / "hardware.json"
    old = Level("c", 1e10, 1e10, {"bfloat16": 1e11}, gemm_flops={"bfloat16": [[1, 1e9], [64, 5e10]]})
    HardwareSpec("profiled", old).save(cached)
    fresh = current_profile()
    monkeypatch.setattr(hardware_presets, "DEFAULT_PROFILE_PATH", cached)
    monkeypatch.setattr(hardware_profile, "profile_machine", lambda quick: fresh)
    notes = []
    assert hardware_choice.resolve_hardware(None, notes.append) == fresh
    assert "older moelight" in notes[0] and HardwareSpec.load(cached) == fresh
    notes.clear()
    assert hardware_choice.resolve_hardware(None, notes.append) == fresh and notes == []  # up to date: used as is



def _session_plan(monkeypatch, available: int, n: int, model: str = "tiny", session_out: list | None = None):
    """The session's plan of n `model` requests (nothing loads) with `available` bytes of host memory
    free, as the session reads it before planning and checking; and what it logged."""
    from moelight.engine import session
    from moelight.engine.options import EngineOptions

    monkeypatch.setattr(session, "available_bytes", lambda: available)
    said: list[str] = []
    s = session.EngineSession(EngineOptions(model=model, load_format="dummy", device="cpu"), log=said.append)
    if session_out is not None:
        session_out.append(s)
    prompts = [[1 + i % 50] * (10 + i % 20) for i in range(n)]
    return s.plan(prompts, [SamplingParams(max_tokens=3)] * n), said


def test_plan_for_this_machine_is_one_the_memory_check_accepts(monkeypatch):
    """`--hardware profile` (the default) plans against the memory available now, not the RAM installed:
    the planner's own batch was refused by the check before loading, which reads MemAvailable, with advice
    about a --batch-size the user never set."""
    plan, said = _session_plan(monkeypatch, int(1.6 * 2**20), 48)  # the tiny model's weights, a few sequences
    assert 1 <= plan.batch_size < 48 and "batch_capped" not in plan.info, said


def test_an_automatic_batch_the_check_refuses_is_capped_and_said(monkeypatch):
    """Where the HRM's memory model and the check before loading still differ (here: the check keeps more
    headroom), the automatic batch is capped to what the check accepts, in the log and the plan's report."""
    from moelight.planning import memory_check

    monkeypatch.setattr(memory_check, "HEADROOM", 0.3)  # 1.2 MiB: some batch beside the weights and activations
    plan, said = _session_plan(monkeypatch, 4 * 2**20, 96)
    capped = plan.info["batch_capped"]
    assert capped["ran"] == plan.batch_size < capped["planned"], said
    assert any("capped at" in line for line in said) and not any("--batch-size" in line for line in said)


def test_a_hardware_file_without_the_dtypes_rate_is_refused_before_loading(tmp_path, monkeypatch):
    """`run --dtype float32` on a file whose CPU level has only a bfloat16 FLOP/s: one error naming the file and
    the keys, exit 2, nothing loaded (the HRM raised a KeyError traceback mid-plan)."""
    monkeypatch.setattr("moelight.engine.session.EngineSession.load", lambda self, *a: pytest.fail("loaded"))
    hw = HardwareSpec("bf16-only", Level("cpu", 16 * GiB, 20e9, {"bfloat16": 200e9})).save(tmp_path / "hw.json")
    r, _, out = _run(tmp_path, "--hardware", str(hw), "--dtype", "float32", "--device", "cpu")
    assert r.exit_code == 2 and "Traceback" not in r.output and not out.exists(), r.output
    assert says(r.output, f"--hardware {hw}") and says(r.output, "cpu.flops holds bfloat16"), r.output


def test_a_small_job_leaves_out_the_plain_copies_where_only_they_do_not_fit(monkeypatch, model_only_host):
    """A job of a few sequences keeps plain bf16 copies of the 16-bit matmuls for its few-row steps (a
    speed-up, cpu_linear.keeps_plain_weights); where the host has room for the job but not for them, the job
    runs without them, not refused (Qwen3-30B-A3B int4 and DeepSeek-V2-Lite int8 on a 24 GiB host)."""
    from moelight.planning.memory_check import HEADROOM, check_fits, run_sizes

    sessions: list = []
    plan, _ = _session_plan(monkeypatch, 1 << 40, 3, "bench-1b", sessions)
    s = sessions[0]
    assert s._plain_for(plan.batch_size) == keeps_plain_weights(plan.batch_size) and plan.batch_size == 3
    sizes = run_sizes(plan.workload, 3, plan.batch_size, plan.micro_batch_size)
    peak = {p: check_fits(s.config, s.source.dtype, available=1 << 40, on_cpu=True, plain_weights=p, **sizes)
            ["peak_bytes"] for p in (True, False)}
    if peak[True] == peak[False]:
        pytest.skip("this CPU keeps no plain bf16 copies beside its packed matmuls")
    between = int((peak[True] + peak[False]) / 2 / HEADROOM)
    sessions.clear()
    plan, said = _session_plan(monkeypatch, between, 3, "bench-1b", sessions)
    assert plan.batch_size == 3 and not sessions[0]._plain_for(3)
    assert any("loading without them" in line for line in said), said
