"""`moelight plan` holds the routed experts as `run` holds them: a quantized checkpoint's as shipped,
`--quantize` refused where run refuses it, priced by the function a run's plan prices them with."""

import json
import random

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from tests.cli_text import says

pytestmark = pytest.mark.no_race_check  # plans; quantized paging's ordering: test_quantized_paging

runner = CliRunner()
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 512, "hidden_size": 256,
           "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
           "torch_dtype": "bfloat16"}
SHIPPED = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
           "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


def _folder(tmp_path, quant: str | None) -> str:
    """A config-only Mixtral folder (plan reads no weights), its experts shipped as `quant` (None: bf16)."""
    cfg = MIXTRAL | ({"quantization_config": SHIPPED[quant]} if quant else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def _plan(folder: str, *args: str):
    return runner.invoke(app, ["plan", "--model", folder, "--hardware", "t4", "--prompt-len", "64",
                               "--max-prompt-len", "64", "--gen-len", "32", "--prefill-chunk", "4096", *args])


@pytest.mark.parametrize("quant, bits", [("gptq", 4.5), ("fp8", 8.25)])
def test_plan_prices_a_quantized_checkpoint_as_run_holds_it(tmp_path, quant, bits):
    """A GPTQ / FP8 checkpoint's experts run as shipped (4.5 / 8.25 bits a weight, not 16): plan prices
    them so, on a GPU and on the CPU, and solves the policy a run's plan (plan_job) solves."""
    import torch

    from moelight.engine.options import EngineOptions
    from moelight.loading.expert_storage import with_expert_format
    from moelight.loading.model_source import resolve_model
    from moelight.planning.job_plan import plan_job
    from moelight.sampling.params import SamplingParams

    folder = _folder(tmp_path, quant)
    r = _plan(folder, "--dtype", "float16", "--family", "cgopipe", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["quantize"]["expert_bits_per_weight"] == pytest.approx(bits), d.get("quantize")
    cfg = with_expert_format(resolve_model(folder).config, torch.float16, "emulated", "none")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(64)] for _ in range(8)]
    job = plan_job(EngineOptions(model=folder, hardware="t4", enable_prefix_caching=False), cfg, "float16", prompts,
                   [SamplingParams(max_tokens=32)] * len(prompts), "emulated")
    assert d["policy"] == job.solved.to_dict()
    cpu = json.loads(_plan(folder, "--gpus", "0", "--json").output)  # bf16 on the CPU: the kernel reads the codes
    assert cpu["quantize"]["expert_bits_per_weight"] == pytest.approx(bits)
    f32 = json.loads(_plan(folder, "--dtype", "float32", "--json").output)  # dequantised at load, as run does
    assert "quantize" not in f32


def test_plan_refuses_quantize_on_a_quantized_checkpoint_as_run_does(tmp_path):
    r = _plan(_folder(tmp_path, "gptq"), "--quantize", "int8")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert says(r.output, "--quantize int8: this checkpoint's experts are already gptq-quantized; leave --quantize "
                          "out to run them as shipped")
    (tmp_path / "bf16").mkdir()
    assert _plan(_folder(tmp_path / "bf16", None), "--quantize", "int8").exit_code == 0


def test_plan_names_the_group_the_experts_are_held_in(tmp_path):
    """int4's group is the largest of 128 / 64 / 32 that divides the expert widths (bench-qwen3-moe's 224: 32),
    not always the one asked for; plan's line says which, and a checkpoint's own."""
    r = runner.invoke(app, ["plan", "--model", "bench-qwen3-moe", "--hardware", "t4", "--quantize", "int4"])
    assert r.exit_code == 0, r.output
    assert says(r.output, "routed experts held as uint4 in groups of 32 input channels (--quantize int4): 6.00 bits "
                          "per weight")
    r = _plan(_folder(tmp_path, "gptq"))
    assert says(r.output, "routed experts held as uint4 in groups of 128 input channels (checkpoint gptq): 4.50 bits "
                          "per weight"), r.output


def _simulate(folder: str, *args: str):
    return runner.invoke(app, ["simulate", "--model", folder, "--hardware", "t4", "--prompt-len", "64",
                               "--gen-len", "32", "--dtype", "float16", *args])


def _decode_rate(output: str) -> float:
    line = next(s for s in output.splitlines() if "throughput: decode" in s)
    return float(line.split("decode ")[1].split(" tok/s")[0])


def test_simulate_holds_the_experts_as_run_does(tmp_path):
    """simulate prices a GPTQ checkpoint's experts at its 4.5 bits, as plan and run do; --quantize int4
    on a 16-bit one prices the same codes, and on a GPTQ one is refused as run refuses it."""
    (tmp_path / "gptq").mkdir()
    (tmp_path / "bf16").mkdir()
    shipped, plain = _folder(tmp_path / "gptq", "gptq"), _folder(tmp_path / "bf16", None)
    r = _simulate(shipped)
    assert r.exit_code == 0, r.output
    assert says(r.output, "routed experts held as uint4 in groups of 128 input channels (checkpoint gptq): 4.50 bits "
                          "per weight")
    dense = _simulate(plain)
    assert "routed experts held" not in dense.output
    int4 = _simulate(plain, "--quantize", "int4")
    assert says(int4.output, "(--quantize int4): 4.50 bits per weight"), int4.output
    assert _decode_rate(int4.output) == pytest.approx(_decode_rate(r.output))
    assert _decode_rate(r.output) != pytest.approx(_decode_rate(dense.output))
    refused = _simulate(shipped, "--quantize", "int8")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    assert says(refused.output, "this checkpoint's experts are already gptq-quantized")
