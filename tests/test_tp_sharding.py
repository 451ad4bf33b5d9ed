"""Megatron-style shards of every family, run as N ranks on threads of one process: greedy
float32 tokens equal the unsharded model's, and prefill logits agree within rtol 1e-4 (the
shards sum the O projection and the FFN in another order than one matmul does, so the last
bits differ; see tests/test_tp_ranks.py for the same over processes and the pipeline)."""

from __future__ import annotations

import pytest
import torch

from moelight.engine.generation import Engine
from moelight.models.config import ModelConfig
from moelight.parallel import TensorParallelError, shard_config, shard_model, tensor_parallel_problems
from moelight.runtime.latent_kv_cache import kv_cache_class
from moelight.runtime.plain_executor import PlainExecutor
from moelight.sampling.params import SamplingParams
from tests.checkpoints import random_prompts
from tests.tp_helpers import FAMILY_CONFIGS, ThreadAllReduce, family_config, random_model, run_ranks

PROMPTS = random_prompts(5, 300, min_len=2, max_len=14, seed=7)
PARAMS = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in PROMPTS]
BF16_PROMPTS = random_prompts(40, 300, min_len=2, max_len=14, seed=21)


def _generate(model, prompts=PROMPTS):
    out = Engine(model, (2,), max_prefill_tokens=64).generate(prompts, PARAMS, [0] * len(prompts),
                                                              batch_size=5, micro_batch_size=2)
    return [r.token_ids for r in out]


def _prefill_logits(model, prompts=PROMPTS):
    lens = torch.tensor([len(p) for p in prompts])
    cache = kv_cache_class(model.config).pool(model.config, int(lens.sum()), model.embed_tokens.weight.dtype)
    offsets = torch.cumsum(lens, 0) - lens
    tokens = torch.tensor([t for p in prompts for t in p])
    return PlainExecutor(model).prefill(cache, tokens, lens, offsets)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_shards_give_the_unsharded_tokens(name, n):
    cfg = family_config(name)
    full = random_model(cfg, seed=3)
    ref_tokens, ref_logits = _generate(full), _prefill_logits(full)
    reduce = ThreadAllReduce(n)
    parts = [shard_model(full, r, n, reduce.for_rank(r)) for r in range(n)]

    def work(r):
        return _prefill_logits(parts[r]), _generate(parts[r])

    results = run_ranks(n, work)
    for logits, tokens in results:
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert tokens == ref_tokens
    assert all(torch.equal(results[0][0], lg) for lg, _ in results)  # every rank holds the same logits


def bf16_within_its_own_rounding(tp: torch.Tensor, single: torch.Tensor, f32: torch.Tensor) -> None:
    """The honest bf16 check: each rank rounds its partial sums to bf16 before the all-reduce,
    so logits move by about bf16's own error and a near-tied greedy token can flip (after which
    a generation diverges, as it does between any two bf16 engines). So: the ranks' logits are
    no further from the single-device bf16 run than bf16 itself is from float32 (x1.25), no
    further from float32 than 2x bf16's own error, and pick the same top token for >= 85% of
    the prompts (measured: 0.90-1.00, mean |dlogit| 0.3-1.0x bf16's own error)."""
    own = (single - f32).abs().mean()
    assert (tp - single).abs().mean() <= 1.25 * own
    assert (tp - f32).abs().mean() <= 2.0 * own
    assert (tp.argmax(-1) == single.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_bfloat16_shards_stay_within_bfloat16s_own_rounding(name, n):
    cfg = family_config(name)
    full = random_model(cfg, torch.bfloat16, seed=3)
    single, f32 = _prefill_logits(full, BF16_PROMPTS), _prefill_logits(random_model(cfg, seed=3), BF16_PROMPTS)
    reduce = ThreadAllReduce(n)
    parts = [shard_model(full, r, n, reduce.for_rank(r)) for r in range(n)]
    tp = run_ranks(n, lambda r: _prefill_logits(parts[r], BF16_PROMPTS))[0]
    bf16_within_its_own_rounding(tp, single, f32)


@pytest.mark.parametrize("layout", ["legacy", "packed"])
def test_a_rank_loads_its_shard_straight_from_the_checkpoint(tmp_path, layout):
    """load_shard (what the ranks run) gives exactly shard_model of the whole loaded model, from a
    sharded checkpoint in either expert layout, with tied embeddings, and from the dummy init."""
    from moelight.loading.model_source import load_model, resolve_model
    from moelight.parallel.shard_loader import load_shard
    from tests.checkpoints import make_hf_model, save_checkpoint

    pytest.importorskip("transformers")
    hf = make_hf_model(seed=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=48,
                       tie_word_embeddings=layout == "packed")
    ckpt = save_checkpoint(hf, tmp_path / "ckpt", layout=layout, shards=3)
    for fmt in ("auto", "dummy"):
        src = resolve_model(str(ckpt), fmt, "float32")
        whole = load_model(src, seed=9)
        for r in range(4):
            want = dict(shard_model(whole, r, 4, lambda t: t).named_parameters())
            got = dict(load_shard(src, r, 4, lambda t: t, seed=9).named_parameters())
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), (fmt, r)


def test_a_shard_holds_its_part_only():
    cfg = family_config("qwen2_moe-shared-dense-bias")
    full = random_model(cfg)
    part = shard_model(full, 1, 2, lambda t: t)
    c = part.config
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (4, 2, 12)
    assert (c.shared_expert_size, c.dense_intermediate_size) == (20, 40)
    sparse = full.layers[0]
    assert torch.equal(part.layers[0].self_attn.q_proj.weight, sparse.self_attn.q_proj.weight[32:])
    assert torch.equal(part.layers[0].self_attn.q_proj.bias, sparse.self_attn.q_proj.bias[32:])
    assert torch.equal(part.layers[0].self_attn.o_proj.weight, sparse.self_attn.o_proj.weight[:, 32:])
    gu = sparse.mlp.gate_up_proj  # [E, 2f, h]: rank 1 takes the second half of gate and of up
    assert torch.equal(part.layers[0].mlp.gate_up_proj, torch.cat((gu[:, 12:24], gu[:, 36:48]), 1))
    assert torch.equal(part.layers[0].mlp.down_proj, sparse.mlp.down_proj[:, :, 12:])
    assert torch.equal(part.layers[0].mlp.gate.weight, sparse.mlp.gate.weight)  # the router: replicated
    assert torch.equal(part.embed_tokens.weight, full.embed_tokens.weight)
    shard_params = sum(p.numel() for p in part.parameters())
    assert shard_params < 0.75 * sum(p.numel() for p in full.parameters())


def test_biases_after_a_row_parallel_matmul_stay_on_rank_0():
    cfg = family_config("gpt_oss-sinks-window-biases")
    full = random_model(cfg)
    zero, one = (shard_model(full, r, 2, lambda t: t) for r in (0, 1))
    layer = full.layers[0]
    assert torch.equal(zero.layers[0].self_attn.o_proj.bias, layer.self_attn.o_proj.bias)
    assert not one.layers[0].self_attn.o_proj.bias.any()
    assert not one.layers[0].mlp.expert_bias.down.any()
    assert torch.equal(one.layers[0].self_attn.sinks, layer.self_attn.sinks[4:])


def test_counts_that_n_does_not_divide_are_named():
    cfg = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=30, num_layers=1, num_heads=6,
                      num_kv_heads=2, num_experts=4, top_k=2)
    assert tensor_parallel_problems(cfg, 2) == []
    assert tensor_parallel_problems(cfg, 3) == ["KV heads 2"]
    assert tensor_parallel_problems(cfg, 4) == ["attention heads 6", "KV heads 2", "expert intermediate size 30"]
    with pytest.raises(TensorParallelError, match=r"needs 4 to divide .*attention heads 6.*--gpus with one of 1, 2"):
        shard_config(cfg, 4)


def _quantized(cfg_dict: dict, method: str, group: int, seed: int = 3):
    """A random model whose routed experts are held quantized (round-to-nearest of its dense ones)."""
    import copy
    from dataclasses import replace

    from moelight.loading.hf_config import config_from_hf_dict
    from moelight.models.expert_format import quantize_format
    from moelight.models.quantized_experts import hold_experts_quantized

    cfg = config_from_hf_dict(cfg_dict, where="test config")
    dense = random_model(cfg, seed=seed)
    form = quantize_format(method, (cfg.hidden_size, group), group)
    held = copy.deepcopy(dense)
    hold_experts_quantized(held, form)
    held.config = replace(cfg, expert_format=form)
    for layer, src in zip(held.layers, dense.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            getattr(layer.mlp, name)[()].copy_(getattr(src.mlp, name).detach())
    return held


# expert width 128: int4 groups of 32 fit a rank's columns at 2 and 4 ranks
QUANT_MIXTRAL = {**FAMILY_CONFIGS["mixtral"], "intermediate_size": 128}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_shards_hold_the_codes_and_scales_one_device_holds(method, n):
    """A rank keeps its experts quantized: its codes and scales dequantise to exactly its part of the
    one-device experts' values (int8's per-row scales are the whole row's; int4's groups are cut
    along the down projection's columns), in a quarter (int4) of the 16-bit bytes."""
    from cpu_kernels.expert_pack import dequantize
    from moelight.models.quantized_experts import QuantizedExperts
    from moelight.parallel.sharding import part_of

    full = _quantized(QUANT_MIXTRAL, method, 32)
    for r in range(n):
        part = shard_model(full, r, n, lambda t: t)
        assert part.config.expert_format == full.config.expert_format
        for j, layer in enumerate(part.layers):
            for name in ("gate_up_proj", "down_proj"):
                got = getattr(layer.mlp, name)
                assert isinstance(got, QuantizedExperts)
                whole = dequantize(getattr(full.layers[j].mlp, name).matrix())
                want = part_of(f"layers.{j}.mlp.{name}", whole, full.config, r, n)
                assert torch.equal(dequantize(got.matrix()), want), (r, j, name)
                e, rows, cols = got.shape
                held = e * full.config.expert_format.matrix_bytes(rows, cols)
                assert got.nbytes() == held < 0.6 * 2 * e * rows * cols


def test_a_quantization_group_that_a_ranks_columns_split_is_named():
    full = _quantized(QUANT_MIXTRAL, "int4", 64)  # 128 columns: 2 ranks hold 64, 4 ranks 32
    shard_model(full, 0, 2, lambda t: t)
    with pytest.raises(TensorParallelError, match=r"4 ranks split each expert's down projection into 32 columns, "
                                                  r"which its uint4 scale groups of 64 do not divide"):
        shard_config(full.config, 4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_rank_loads_its_quantized_shard_straight_from_the_checkpoint(tmp_path, method):
    """load_shard with experts held quantized gives exactly shard_model of the whole quantized model,
    from a checkpoint and from the dummy init (the dummy codes the one device draws)."""
    from dataclasses import replace

    from moelight.loading.expert_storage import with_expert_format
    from moelight.loading.model_source import load_model, resolve_model
    from moelight.parallel.shard_loader import load_shard
    from tests.checkpoints import make_hf_model, save_checkpoint

    pytest.importorskip("transformers")
    hf = make_hf_model(seed=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128)
    ckpt = save_checkpoint(hf, tmp_path / "ckpt", shards=2)
    for fmt in ("auto", "dummy"):
        src = resolve_model(str(ckpt), fmt, "float32")
        src = replace(src, config=with_expert_format(src.config, torch.float32, "emulated", method, 128, ranks=2))
        assert src.config.expert_format.group == (0 if method == "int8" else 64)
        whole = load_model(src, seed=9)
        for r in range(2):
            want = shard_model(whole, r, 2, lambda t: t).state_dict()
            got = load_shard(src, r, 2, lambda t: t, seed=9).state_dict()
            assert want.keys() == got.keys() and any(k.endswith("codes") for k in got)
            assert all(torch.equal(want[k], got[k]) for k in want), (fmt, r)


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3-mla-groups-shared-dense", "deepseek_v2-mla-no-q-lora"])
def test_shards_share_prefixes_as_the_unsharded_model_computes_them_in_full(name):
    """Two ranks with prefix sharing (MLA: each rank's latent pages, the prefix expanded to its own heads)
    against the whole model without it: the same greedy tokens, the shared pages computed once."""
    from moelight.engine.generation import GenerationStats

    system = random_prompts(1, 300, min_len=36, max_len=36, seed=8)[0]
    prompts = [system + p for p in PROMPTS[:3]] + [system + PROMPTS[0], system[:20]]
    full = random_model(family_config(name), seed=3)

    def generate(model, share: bool, stats=None):
        engine = Engine(model, (2,), max_prefill_tokens=64, prefix_sharing=share)
        out = engine.generate(prompts, PARAMS, [0] * len(prompts), batch_size=5, micro_batch_size=2, stats=stats)
        return [r.token_ids for r in out]

    ref = generate(full, share=False)
    reduce = ThreadAllReduce(2)
    parts = [shard_model(full, r, 2, reduce.for_rank(r)) for r in range(2)]
    stats = [GenerationStats() for _ in range(2)]
    for tokens in run_ranks(2, lambda r: generate(parts[r], True, stats[r])):
        assert tokens == ref
    assert all(s.prefix_reused_tokens >= 2 * 32 for s in stats)
