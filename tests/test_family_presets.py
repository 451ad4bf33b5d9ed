"""Each family's preset at its real shape: the HRM counts what the engine builds (shared experts,
dense layers, biases, q/k norms), matches the published sizes, and `plan` / `simulate` / `run`
accept it; per-layer FLOPs and bytes against a hand computation."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hrm import model_from_hf_config
from hrm import operators as ops
from hrm.model import ModelSpec
from hrm.model_presets import MODEL_PRESETS
from moelight.cli import app
from moelight.loading.presets import PRESETS
from moelight.planning.memory_check import parameter_count
from tests.cli_text import says

# published totals and active parameters per token, billions
PUBLISHED = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39), "dbrx": (132, 36),
             "qwen3-30b-a3b": (30.5, 3.3), "qwen2-57b-a14b": (57.4, 14.2), "olmoe-1b-7b": (6.9, 1.3),
             "gpt-oss-20b": (20.91, 3.61), "gpt-oss-120b": (116.83, 5.13)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_sizes_match_the_published_ones(name):
    total, active = PUBLISHED[name]
    m = MODEL_PRESETS[name]
    assert m.total_params() / 1e9 == pytest.approx(total, rel=0.02)
    # OpenAI's GPT-OSS model card counts the unembedding but not the embedding as active
    embedding = m.vocab_size * m.hidden_size if m.model_type == "gpt_oss" else 0
    assert (m.active_params() - embedding) / 1e9 == pytest.approx(active, rel=0.03)


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_hrm_counts_every_parameter_the_engine_builds(name):
    cfg = PRESETS[name]
    assert parameter_count(cfg) == MODEL_PRESETS[name].total_params()
    # the planner sees the engine's config through to_hf_dict: the same model
    assert model_from_hf_config(cfg.to_hf_dict()).total_params() == MODEL_PRESETS[name].total_params()


def test_average_layer_ffn_by_hand():
    """4 layers, one dense (width 40), 8 experts of width 16 top-2, a shared expert of width 24."""
    h, t, b = 32, 10, 2.0
    m = ModelSpec("x", 100, h, 16, 4, 8, 2, 4, 2, 8, shared_expert_size=24, num_dense_layers=1,
                  dense_intermediate_size=40)
    cost = ops.moe_ffn(m, t, b)
    touched = 8 * (1 - (1 - 2 / 8) ** t)
    sparse_flops = 6 * h * 16 * 2 * t + 6 * h * 24 * t + 2 * h * t  # routed + shared + its gate
    dense_flops = 6 * h * 40 * t
    assert cost.flops == pytest.approx(0.75 * sparse_flops + 0.25 * dense_flops)
    sparse_bytes = touched * 3 * h * 16 * b + (3 * h * 24 + h) * b
    assert cost.bytes == pytest.approx(0.75 * sparse_bytes + 0.25 * 3 * h * 40 * b + 2 * t * h * b)
    # parameters: 3 sparse layers carry 8 experts, a router and a shared expert, the dense one its MLP
    attn = h * (32 + 2 * 16) + 32 * h + 2 * h
    assert m.non_expert_params() == 4 * attn + 3 * h * 8 + 3 * (3 * h * 24 + h) + 3 * h * 40 + 2 * 100 * h + h
    assert m.layer_expert_params() == round(0.75 * 8 * 3 * h * 16)


@pytest.mark.parametrize("name, hw", [("dbrx", "s9"), ("qwen3-30b-a3b", "s2"), ("qwen2-57b-a14b", "s9"),
                                      ("olmoe-1b-7b", "s1"), ("gpt-oss-20b", "s2"), ("gpt-oss-120b", "s9")])
def test_plan_and_simulate_take_every_family_preset(name, hw):
    r = CliRunner().invoke(app, ["plan", "--model", name, "--hardware", hw, "--gen-len", "64"])
    assert r.exit_code == 0, r.output
    assert says(r.output, f"model {name} on {hw}")
    r = CliRunner().invoke(app, ["simulate", "--model", name, "--hardware", hw, "--gen-len", "32"])
    assert r.exit_code == 0, r.output
    assert says(r.output, "schedule cgopipe")


@pytest.mark.parametrize("hw", ["t4", "l4"])
def test_deepseek_v2_lite_plans_and_simulates_on_one_gpu(hw):
    r = CliRunner().invoke(app, ["plan", "--model", "deepseek-v2-lite", "--hardware", hw, "--gen-len", "64"])
    assert r.exit_code == 0, r.output
    assert says(r.output, f"model deepseek-v2-lite on {hw}")
    r = CliRunner().invoke(app, ["simulate", "--model", "deepseek-v2-lite", "--hardware", hw, "--gen-len", "32"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("hw", ["s6", "s9"])
def test_deepseek_v3_on_the_multi_gpu_presets_says_what_does_not_fit(hw):
    """671 B parameters do not fit a 416 GB host: the plan says so, with the sizes."""
    r = CliRunner().invoke(app, ["plan", "--model", "deepseek-v3", "--hardware", hw, "--gen-len", "64"])
    assert r.exit_code != 0
    assert says(r.output, "no policy fits deepseek-v3") and says(r.output, "CPU memory short")
    assert says(r.output, "the weights alone take 1249.88 GiB in float16, beyond the")  # 671 B params x 2 B


def test_a_plan_that_fits_with_its_weights_does_not_blame_them():
    small = CliRunner().invoke(app, ["plan", "--model", "deepseek-v2-lite", "--hardware", "t4", "--gen-len", "32"])
    assert small.exit_code == 0 and not says(small.output, "the weights alone")


def test_a_mixtral_window_holds_on_every_layer_and_null_means_none():
    from hrm.model import model_from_hf_config

    cfg = dict(model_type="mixtral", vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    m = model_from_hf_config(cfg)
    assert (m.sliding_window, m.num_sliding_layers, m.attended_context(100)) == (8, 3, 8.0)
    m = model_from_hf_config(cfg | {"sliding_window": None})
    assert (m.num_sliding_layers, m.attended_context(100)) == (0, 100)


def test_sliding_window_layers_read_their_window_by_hand():
    """GPT-OSS-like: half the layers attend to 128 keys; decode attention at 1000 tokens reads
    (1000 + 128) / 2 keys per layer on average; below the window, all of them."""
    m = ModelSpec("w", 100, 64, 32, 4, 4, 2, 8, 2, 16, sliding_window=128, num_sliding_layers=2,
                  attention_sinks=True, o_bias=True, expert_bias=True)
    b = 2.0
    for ctx, keys in ((1000, 564.0), (100, 100.0)):
        cost = ops.decode_attention(m, 3, ctx, b)
        assert cost.flops == pytest.approx(4 * 128 * keys * 3)
        assert cost.bytes == pytest.approx(2 * 32 * keys * b * 3 + 3 * (2 * 128 + 2 * 32) * b)
    # sinks (one per head), o bias, router bias; experts carry their biases
    h, f = 64, 32
    assert m.attn_params_per_layer() == h * (128 + 64) + 128 * h + 2 * h + h * 4 + h + 8 + 4
    assert m.expert_params() == 3 * h * f + 2 * f + h


def test_a_real_shape_preset_that_does_not_fit_says_so_before_loading(tmp_path, monkeypatch):
    import moelight.engine.session

    monkeypatch.setattr(moelight.engine.session, "load_model", lambda *a, **k: pytest.fail("loaded"))
    ds = tmp_path / "p.jsonl"
    ds.write_text('{"id": "a", "prompt": "hi"}\n')
    r = CliRunner().invoke(app, ["run", "--dataset", str(ds), "--model", "qwen3-30b-a3b", "--load-format", "dummy",
                                 "--output", str(tmp_path / "o.jsonl"), "--hardware", "cpu-server", "--device", "cpu",
                                 "--gpus", "0"])
    assert r.exit_code == 2, r.output
    assert says(r.output, "does not fit") and not (tmp_path / "o.jsonl").exists()


def test_engine_builds_each_family_preset_on_the_meta_device():
    from moelight.models.causal_lm import MoECausalLM

    for name in ("dbrx", "qwen3-30b-a3b", "qwen2-57b-a14b", "olmoe-1b-7b", "gpt-oss-20b"):
        with torch.device("meta"):
            model = MoECausalLM(PRESETS[name])
        assert model.config.model_type == MODEL_PRESETS[name].model_type or name == "dbrx"
