"""Prefill attention's device temporaries: what one varlen group call holds on the strict emulated device
against hrm.attention_memory's bytes per element, the device's score budget bounding a call (with the
same results), and auto plans of the families whose attention holds the most (GPT-OSS's sinks: explicit
float32 scores; DeepSeek's MLA: per-head K and V expanded from the latent) that run on a small GPU
instead of running out of its memory mid-job."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from cpu_kernels.varlen_attention import varlen_attention
from hrm import hardware_presets
from hrm.attention_memory import SCORE_BUDGET, SCORE_ELEMENT_BYTES, attention_score_budget, call_elements
from moelight.cli import app
from moelight.devices.compute_counter import ComputeCounts, counting
from moelight.devices.emulated_memory import DeviceMemory

pytestmark = pytest.mark.no_race_check  # attention's device memory; ordering: the runtimes' own tests


def call_peak(B: int, p: int, Hq: int, Hkv: int, d: int, sinks: bool, budget: int = SCORE_BUDGET):
    """(device peak of one varlen_attention call beyond its output, the HRM's bytes for it, its result)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B * p, Hq, d, generator=g).bfloat16()
    k, v = (torch.randn(Hkv, B * p, d, generator=g).bfloat16() for _ in range(2))
    sink = torch.randn(Hq, generator=g).bfloat16() if sinks else None
    cu = [i * p for i in range(B + 1)]
    memory = DeviceMemory(1 << 40, lambda: ({}, {}))
    with counting(ComputeCounts(), lambda t: True, memory=memory):
        out = varlen_attention(q, k, v, [0] * B, cu, d**-0.5, bases=cu[:-1], sinks=sink, budget=budget)
    shape = SimpleNamespace(num_heads=Hq, num_kv_heads=Hkv, head_dim=d, latent=False)
    counted = float(call_elements(shape, B, p, budget)) * SCORE_ELEMENT_BYTES
    return memory.peak - out.numel() * out.element_size(), counted, out


@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("budget", [1 << 16, SCORE_BUDGET])
@pytest.mark.parametrize("shape", [(16, 256, 8, 2, 32), (16, 128, 8, 2, 64)])
def test_a_group_call_holds_at_most_what_the_hrm_counts(sinks, budget, shape):
    held, counted, _ = call_peak(*shape, sinks=sinks, budget=budget)
    assert 0.15 * counted <= held <= counted, (held / counted)


@pytest.mark.parametrize("sinks", [True, False])
def test_a_small_budget_bounds_the_call_and_keeps_its_results(sinks):
    """Within bfloat16 rounding: smaller groups pad to other key counts, which reorders the sums."""
    shape = (8, 256, 8, 2, 32)
    held_whole, _, whole = call_peak(*shape, sinks=sinks)
    held_cut, _, cut = call_peak(*shape, sinks=sinks, budget=1 << 16)
    assert held_cut < held_whole / 5
    torch.testing.assert_close(cut, whole)


def test_the_device_budget_is_the_kernels_default_on_a_real_gpu_and_a_share_of_a_small_one():
    assert attention_score_budget(16 << 30) == SCORE_BUDGET
    small = attention_score_budget(48 << 20)
    assert small < SCORE_BUDGET and small * SCORE_ELEMENT_BYTES <= (48 << 20) / 16


def _model(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / name
    path.mkdir()
    common = {"vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
              "head_dim": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 2, "torch_dtype": "bfloat16", "rope_theta": 1e6}
    (path / "config.json").write_text(json.dumps(common | config))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))
    return str(path)


FAMILIES = {
    "gpt_oss": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_key_value_heads": 2,
                "max_position_embeddings": 4096, "intermediate_size": 256, "num_local_experts": 8,
                "num_experts_per_tok": 2, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v2": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                    "num_key_value_heads": 8, "max_position_embeddings": 4096, "intermediate_size": 512,
                    "moe_intermediate_size": 128, "kv_lora_rank": 64, "q_lora_rank": None,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 16,
                    "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
}
# prompts per job: enough for each family's planned batch on the 48 MiB device (GPT-OSS 30, DeepSeek 14, both
# modes plan as with more); each more DeepSeek prompt is one more prefill of many small attention groups
PROMPTS = {"gpt_oss": 32, "deepseek_v2": 16}


@pytest.mark.parametrize("mode", ["throughput", "latency"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_auto_plan_on_a_small_gpu_runs_without_running_out_of_its_memory(tmp_path, family, mode):
    """256-byte prompts on a T4 cut to 48 MiB: the plan's prefill groups held 30 MB of float32 scores
    (GPT-OSS) beside the expanded K and V (DeepSeek) and ran out mid-job."""
    hw = hardware_presets.get_hardware("t4").to_dict()
    hw["gpu"]["memory_bytes"], hw["name"] = 48 << 20, "t4-48m"
    (tmp_path / "hw.json").write_text(json.dumps(hw))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": "".join(chr(97 + (i * 7 + j * 3) % 11)
                                                                        for j in range(256))}) + "\n"
                            for i in range(PROMPTS[family])))
    out = tmp_path / "out.jsonl"
    model = _model(tmp_path, family, FAMILIES[family])
    r = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", model, "--load-format", "dummy",
                                 "--device", "emulated", "--hardware", str(tmp_path / "hw.json"), "--mode", mode,
                                 "--gen-len", "2", "--ignore-eos", "--output", str(out), "--no-progress"])
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == PROMPTS[family]
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    peak, predicted = report["runtime"]["device_memory_peak"], report["prediction"]["gpu_memory_bytes"]
    assert peak <= predicted <= 0.9 * (48 << 20)  # the plan counted at least what the device held
    assert "MiB peak" in r.output and "predicted (HRM)" in r.output
