"""`moelight plan` and `moelight profile` through typer's CliRunner."""

import json

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from tests.cli_text import says

pytestmark = pytest.mark.no_race_check  # plans and profiles; ordering: the runtimes' own tests

runner = CliRunner()


def _plan(*args):
    return runner.invoke(app, ["plan", *args])


def test_plan_prints_policy_and_reason():
    r = _plan("--model", "mixtral-8x7b", "--hardware", "s1", "--dtype", "float16", "--max-prompt-len", "418")
    assert r.exit_code == 0, r.output
    assert says(r.output, "attention on CPU (A_g=0), MoE FFN on GPU (F_g=1)")
    assert says(r.output, "bound by") and says(r.output, "GPU memory") and says(r.output, "why:")


def test_plan_says_which_runtime_runs_its_placement():
    """The default family searches placements no device runtime has (8x22B on a T4: attention on the GPU,
    the FFN on the CPU); the plan says so, and `--family cgopipe` plans what `run --device` executes."""
    r = _plan("--model", "mixtral-8x22b", "--hardware", "t4")
    assert r.exit_code == 0, r.output
    assert says(r.output, "attention on GPU (A_g=1), MoE FFN on CPU") and says(r.output, "runs as: none")
    r = _plan("--model", "mixtral-8x7b", "--hardware", "s1", "--family", "flexgen")
    assert r.exit_code == 0 and says(r.output, "runs as: moelight run --device cuda|emulated --schedule flexgen")


def test_plan_refuses_a_cache_size_the_gpu_cannot_hold():
    """--cache-size is checked against the device: 256 slots of 8x7B (84 GiB) on a 16 GiB T4 are refused
    with the most that fit, as `run` refuses them before loading."""
    r = _plan("--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "latency", "--requests", "4",
              "--cache-size", "256")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert says(r.output, "--cache-size 256: 256 expert slots do not fit on one T4") and says(r.output, "at most ")
    r = _plan("--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "latency", "--requests", "4",
              "--cache-size", "34")
    assert r.exit_code == 0 and says(r.output, "34 expert slots"), r.output


def test_plan_json_and_save_policy(tmp_path):
    pol = tmp_path / "p.json"
    r = _plan("--model", "bench-1b", "--hardware", "t4", "--gen-len", "32", "--json",
              "--save-policy", str(pol))
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["policy"]["batch_size"] == d["policy"]["micro_batch_size"] * d["policy"]["num_micro_batches"]
    assert d["e2e_tok_s"] > 0 and d["binding"] in ("link", "gpu", "cpu")
    assert json.loads(pol.read_text()) == d["policy"]


def test_plan_json_has_every_memory_part_and_the_runtime_for_any_placement():
    """--json's memory maps hold the same keys whatever the placement (0 where it holds none: kv_cache on the
    GPU, dequantized_layer without quantized experts came and went), and "runs_as" names what runs the plan."""
    from optimizer.policy import CPU_MEMORY_PARTS, GPU_MEMORY_PARTS

    cases = [(("--model", "mixtral-8x7b", "--hardware", "s1", "--family", "cgopipe"),
              {"devices": ["cuda", "emulated"], "schedules": ["cgopipe", "overlap-unpaged", "flexgen-cpu"]}),
             (("--model", "mixtral-8x7b", "--hardware", "s1", "--family", "flexgen", "--quantize", "int4"),
              {"devices": ["cuda", "emulated"], "schedules": ["flexgen"]}),
             (("--model", "mixtral-8x22b", "--hardware", "t4"), {"devices": [], "schedules": []}),
             (("--model", "mixtral-8x7b", "--hardware", "s1", "--gpus", "0"), {"devices": ["cpu"], "schedules": []})]
    for args, runs_as in cases:
        r = _plan(*args, "--json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        assert list(d["gpu_memory"]) == list(GPU_MEMORY_PARTS) and list(d["cpu_memory"]) == list(CPU_MEMORY_PARTS)
        assert d["runs_as"] == runs_as, (args, d["runs_as"])
        if "--gpus" in args:
            assert set(d["gpu_memory"].values()) == {0.0} and d["gpu_capacity"] == 0.0
        if "--quantize" in args:
            assert d["gpu_memory"]["dequantized_layer"] > 0 and d["gpu_memory"]["kv_prefetch_buffers"] > 0


def test_plan_json_keeps_the_mode_and_quantize_lines():
    """--json carries what the text says: the mode picked, both modes' figures, the batch that runs in it
    (the "policy" entry stays the throughput plan) and the quantized experts' bits per weight."""
    r = _plan("--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "auto", "--requests", "4", "--json",
              "--quantize", "int4")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    mode = d["mode"]
    assert mode["mode"] == "latency" and mode["batch_size"] == mode["latency"]["batch_size"] == 4
    assert mode["cache"]["slots"] == mode["latency"]["slots"] and mode["throughput_e2e_tok_s"] > 0
    assert d["quantize"]["format"] == "int4" and d["quantize"]["expert_bits_per_weight"] > 4
    assert "mode" not in json.loads(_plan("--model", "bench-1b", "--hardware", "t4", "--json").output)


def test_plan_gpus_zero_is_all_cpu():
    r = _plan("--model", "mixtral-8x7b", "--hardware", "s1", "--gpus", "0", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)["policy"]
    assert (p["attn_on_gpu"], p["ffn_on_gpu"], p["r_w"], p["r_c"]) == (False, False, 0.0, 0.0)


def test_plan_model_dir(tmp_path):
    cfg = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = _plan("--model", str(tmp_path), "--hardware", "cpu-server", "--json")
    assert r.exit_code == 0, r.output


def test_plan_plots(tmp_path):
    pytest.importorskip("matplotlib")
    r = _plan("--model", "mixtral-8x7b", "--hardware", "s2", "--plot", str(tmp_path))
    assert r.exit_code == 0, r.output
    for name in ("hrm_attention.png", "hrm_moe_ffn.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "mixtral-8x7b", "--hardware", "v100"], "s1"),  # lists valid presets
        (["--model", "llama", "--hardware", "s1"], "mixtral-8x7b"),
        (["--model", "/nonexistent/dir", "--hardware", "s1"], "valid presets"),
        (["--model", "tiny", "--hardware", "/no/such/profile.json"], "/no/such/profile.json"),
        (["--model", "tiny", "--hardware", "s1", "--dtype", "float8"], "float8"),
        (["--model", "tiny", "--hardware", "s1", "--family", "deepspeed"], "flexgen"),
        (["--model", "mixtral-8x7b", "--hardware", "t4", "--prompt-len", "100000", "--gen-len", "8"],
         "--prompt-len: 100000 prompt tokens + --gen-len 8 = 100008 exceed mixtral-8x7b's context of 32768"),
        (["--model", "mixtral-8x7b", "--hardware", "t4", "--max-prompt-len", "32760", "--gen-len", "64"],
         "--max-prompt-len: 32760 prompt tokens"),
        (["--model", "tiny", "--hardware", "t4", "--prompt-len", "0"], "--prompt-len: 0: a mean prompt length"),
        (["--model", "tiny", "--hardware", "t4", "--gen-len", "0"], "--gen-len: 0: generate at least 1 token"),
        (["--model", "tiny", "--hardware", "t4", "--prompt-len", "80", "--max-prompt-len", "10"],
         "--max-prompt-len: 10: the longest prompt cannot be shorter than the mean"),
        (["--model", "tiny", "--hardware", "t4", "--prompt-len", "80", "--shared-prefix", "100"],
         "--shared-prefix: 100: the tokens a shared prefix serves are part of the mean prompt"),
        (["--model", "tiny", "--hardware", "t4", "--padded"],  # padding to the mean would change nothing
         "--padded: pads every prompt to the longest: give --max-prompt-len N with it"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_bad_input_exit_2_without_traceback(args, needle, command):
    r = runner.invoke(app, [command, *args])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    assert says(r.output, needle)


def test_missing_profile_mentions_path(tmp_path):
    missing = tmp_path / "hw.json"
    r = _plan("--model", "tiny", "--hardware", "profile", "--profile-path", str(missing))
    assert r.exit_code == 2
    assert says(r.output, "hw.json") and says(r.output, "moelight profile")


def test_infeasible_is_a_message(tmp_path):
    from hrm.hardware import HardwareSpec, Level

    small = HardwareSpec("small", Level("cpu", 8 * 2**30, 1e11, {"bfloat16": 1e12}))
    r = _plan("--model", "mixtral-8x7b", "--hardware", str(small.save(tmp_path / "small.json")))
    assert r.exit_code == 2  # a user error, as `simulate` says it
    assert says(r.output, "CPU memory short by") and "Traceback" not in r.output
    from dataclasses import replace

    from hrm import get_hardware

    t4 = get_hardware("t4")
    gpu = replace(t4, cpu=replace(t4.cpu, memory_bytes=8 * 2**30), name="small-t4")  # simulate needs a GPU
    hw = str(gpu.save(tmp_path / "small_t4.json"))
    plan, sim = _plan("--model", "mixtral-8x7b", "--hardware", hw), runner.invoke(
        app, ["simulate", "--model", "mixtral-8x7b", "--hardware", hw])
    assert plan.exit_code == sim.exit_code == 2 and says(sim.output, "no policy fits"), (plan.output, sim.output)


def test_a_level_without_the_plans_dtype_rate_is_named(tmp_path):
    """A hardware file whose level has no FLOP/s for the plan's dtype nor float32 (the fallback) is refused
    before planning, naming the file, the level, the dtype and the keys it has (it was a KeyError traceback)."""
    from dataclasses import replace

    from hrm import get_hardware
    from hrm.hardware import HardwareSpec, Level

    cpu = str(HardwareSpec("small", Level("cpu", 8 * 2**30, 1e11, {"bfloat16": 1e12})).save(tmp_path / "cpu.json"))
    r = _plan("--model", "tiny", "--hardware", cpu, "--dtype", "float32")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    for part in ("cpu.json", "a float32 plan needs cpu.flops to hold float32", "cpu.flops holds bfloat16",
                 "--dtype bfloat16"):
        assert says(r.output, part), (part, r.output)
    t4 = get_hardware("t4")
    gpu = str(replace(t4, gpu=replace(t4.gpu, flops={"bfloat16": 6e13})).save(tmp_path / "gpu.json"))
    sim = runner.invoke(app, ["simulate", "--model", "tiny", "--hardware", gpu, "--dtype", "float16"])
    assert sim.exit_code == 2 and "Traceback" not in sim.output, sim.output
    assert says(sim.output, "gpu.flops to hold float16 or float32") and says(sim.output, "gpu.json"), sim.output
    assert _plan("--model", "tiny", "--hardware", gpu, "--dtype", "float32", "--gpus", "0").exit_code == 0


def test_profile_then_plan_with_it(tmp_path, monkeypatch, quick_expert_curve):
    pytest.importorskip("torch")
    from moelight.profiling import machine_profile

    # the expert kernel's curve as test_hrm_measured_level measured it (once a session): the rest is measured here
    monkeypatch.setattr(machine_profile, "measure_expert_curve", quick_expert_curve)
    out = tmp_path / "hw.json"
    r = runner.invoke(app, ["profile", "--output", str(out), "--quick"])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["cpu"]["bandwidth"] > 1e8 and d["cpu"]["flops"]["float32"] > 1e8
    if d["cpu"]["elementwise_bandwidth"]:  # 0.0 where packed bf16 matmuls are unavailable
        assert says(r.output, "element-wise ops between the matmuls")
    r = _plan("--model", "tiny", "--hardware", "profile", "--profile-path", str(out), "--json")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("hardware,want", [("t4", "float16"), ("l4", "bfloat16"), ("s1", "float16")])
def test_plan_auto_dtype_is_the_gpus_faster_16_bit_type(hardware, want):
    r = _plan("--model", "bench-1b", "--hardware", hardware, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["policy"]["dtype"] == want
    cpu = _plan("--model", "bench-1b", "--hardware", hardware, "--gpus", "0", "--json")
    assert json.loads(cpu.output)["policy"]["dtype"] == "bfloat16"


@pytest.mark.parametrize("hardware", ["s1", "s2"])
def test_plan_quantize_shows_the_predicted_gain(hardware):
    e2e = {}
    for q in ("none", "int8", "int4"):
        r = _plan("--model", "mixtral-8x7b", "--hardware", hardware, "--dtype", "float16", "--quantize", q, "--json")
        assert r.exit_code == 0, r.output
        e2e[q] = json.loads(r.output)["e2e_tok_s"]
    assert e2e["none"] * 1.2 < e2e["int8"] <= e2e["int4"] * 1.01, e2e
    r = _plan("--model", "mixtral-8x7b", "--hardware", hardware, "--quantize", "int4")
    assert says(r.output, "routed experts held as uint4 in groups of 128 input channels (--quantize int4): 4.50 bits "
                          "per weight")
    r = _plan("--model", "mixtral-8x7b", "--hardware", hardware, "--quantize", "int3")
    assert r.exit_code == 2 and says(r.output, "'int3' is not one of none, int8, int4")


def test_a_warning_on_the_command_line_is_one_line():
    from moelight.cli import _one_line_warning

    assert _one_line_warning(UserWarning("the MTP head is ignored"), UserWarning, "/x/y.py", 33) == \
        "warning: the MTP head is ignored\n"


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["link"].__setitem__("h2d", 0), "link.h2d must be a positive number, got 0"),
    (lambda d: d["cpu"].__setitem__("bandwidth", 0), "cpu.bandwidth must be a positive number"),
    (lambda d: d["gpu"].__setitem__("flops", {}), "gpu.flops must map dtypes to FLOP/s"),
    (lambda d: d["cpu"].__setitem__("memory_bytes", "lots"), "cpu.memory_bytes must be a positive number, got 'lots'"),
    (lambda d: d["gpu"].__setitem__("memory_bytes", -16e9), "gpu.memory_bytes must be a positive number"),
    (lambda d: d.__setitem__("gpu_count", -2), "gpu_count must be a whole number >= 1 with a gpu, got -2"),
    (lambda d: d["gpu"].__setitem__("bandwidth", float("nan")), "gpu.bandwidth must be a positive number"),
])
def test_a_hardware_file_with_unusable_numbers_is_named(tmp_path, edit, needle):
    from hrm import get_hardware

    d = get_hardware("t4").to_dict()
    edit(d)
    (tmp_path / "hw.json").write_text(json.dumps(d))
    r = _plan("--model", "mixtral-8x7b", "--hardware", str(tmp_path / "hw.json"))
    assert r.exit_code == 2 and says(r.output, needle) and "Traceback" not in r.output, r.output
    (tmp_path / "list.json").write_text("[1, 2]")
    r = _plan("--model", "mixtral-8x7b", "--hardware", str(tmp_path / "list.json"))
    assert r.exit_code == 2 and says(r.output, "a JSON object of cpu, gpu, link"), r.output


def test_plan_and_simulate_warn_of_a_profile_taken_on_a_busy_host(tmp_path):
    from hrm import get_hardware
    from moelight.profiling.host_load import busy_note

    d = get_hardware("t4").to_dict() | {"notes": busy_note(0.83, 2)}
    (tmp_path / "hw.json").write_text(json.dumps(d))
    for args in (["plan", "--model", "mixtral-8x7b"], ["simulate", "--model", "mixtral-8x7b"]):
        r = runner.invoke(app, [*args, "--hardware", str(tmp_path / "hw.json")])
        assert r.exit_code == 0 and says(r.output, "warning: the host was busy when profiled"), r.output


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_an_integer_dtype_is_refused_for_quantize(command):
    r = runner.invoke(app, [command, "--model", "mixtral-8x7b", "--hardware", "s1", "--dtype", "int4"])
    assert r.exit_code == 2 and says(r.output, "integer experts are --quantize int8 / int4"), r.output


@pytest.mark.parametrize("bad", ["int4-g16", "int4-g100", "int8-g64"])
def test_plan_takes_the_quantize_choices_run_takes(bad):
    r = runner.invoke(app, ["plan", "--model", "mixtral-8x7b", "--hardware", "s1", "--quantize", bad])
    assert r.exit_code == 2 and says(r.output, f"'{bad}' is not one of none, int8, int4, int4-g64, int4-g32"), r.output


@pytest.mark.parametrize("requests", [1, 4000])
@pytest.mark.parametrize("cache", [[], ["--cache-policy", "lru", "--cache-size", "0.125"]])
def test_plan_and_run_choose_the_same_mode(requests, cache):
    """`plan --mode auto` and a run's plan (plan_job, what `run` and LLM.generate call) pick alike."""
    import random

    from moelight.engine.options import EngineOptions
    from moelight.loading.presets import PRESETS
    from moelight.planning.job_plan import plan_job
    from moelight.sampling.params import SamplingParams

    r = _plan("--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "auto", "--requests", str(requests),
              "--prompt-len", "64", "--max-prompt-len", "64", "--gen-len", "32", "--prefill-chunk", "4096",
              "--dtype", "float16", *cache)
    assert r.exit_code == 0, r.output
    picked = r.output.split("mode: ")[-1].split()[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 30000) for _ in range(64)] for _ in range(requests)]
    opts = EngineOptions(model="mixtral-8x7b", hardware="t4", mode="auto", enable_prefix_caching=False,
                         cache_policy=cache[1] if cache else "auto", cache_size=float(cache[3]) if cache else None)
    job = plan_job(opts, PRESETS["mixtral-8x7b"], "float16", prompts, [SamplingParams(max_tokens=32)] * requests,
                   "emulated")
    assert picked == job.info["mode"] == ("latency" if requests == 1 else "throughput"), (r.output, job.info)
    if picked == "latency":
        assert says(r.output, f"{job.info['cache']['slots']} expert slots, {job.info['cache']['policy']}")


@pytest.mark.parametrize("args,option,words", [
    (["--gen-len", "100000000"], "--gen-len", "exceed mixtral-8x7b's context"),  # not --prompt-len's fault
    (["--dtype", "fp8"], "--dtype", "not one of auto, float32, bfloat16, float16"),  # int8 is --quantize
    (["--profile-path", "nope.json"], "--profile-path", "read with --hardware profile only"),  # was ignored
])
def test_plan_names_the_option_at_fault(args, option, words):
    res = _plan("--model", "mixtral-8x7b", "--hardware", "t4", *args)
    assert res.exit_code == 2 and says(res.output, f"Invalid value for {option}") and says(res.output, words), \
        res.output


def test_a_one_token_job_plans_without_a_numpy_warning():
    """gen-len 1 has no decode step: its lower bound is prefill alone (was (1 - 1) * inf = nan, warned)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = _plan("--model", "mixtral-8x7b", "--hardware", "t4", "--gen-len", "1")
    assert res.exit_code == 0 and "invalid value" not in res.output, res.output


def test_a_tiny_shortfall_is_said_in_mib():
    from optimizer.policy import size_text

    assert size_text(3 * 2**20) == "3.00 MiB" and size_text(2**31) == "2.00 GiB"
