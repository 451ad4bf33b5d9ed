"""The engine on the fused expert kernel: bf16 against the per-expert oneDNN loop, and --quantize
int8 / int4 against a dequantize-then-matmul model of the same quantized weights (the loop, in bf16).

Whole-model logits of a prefill and a decode step are compared relative to their largest magnitude:
bf16 activations and the kernel's float32 sums differ from the loop's rounding at ~1% of that."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import dequantize
from cpu_kernels.expert_quant import int4_group_for, quantize
from moelight.engine.options import EngineOptions, OptionError
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.runtime.cpu_linear import pack_model
from moelight.runtime.forward import decode_step, prefill
from moelight.runtime.fused_experts import FusedExperts
from moelight.runtime.latent_kv_cache import kv_cache_class

TINY = PRESETS["tiny"]
GPT_OSS = replace(PRESETS["bench-gpt-oss"], hidden_size=128, intermediate_size=96, num_layers=2, vocab_size=512,
                  num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, top_k=2)


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of each prompt's last token, then of one decode step (a fixed token) after it."""
    lens = [len(p) for p in prompts]
    cache = kv_cache_class(model.config).allocate(model.config, [n + 2 for n in lens], model.embed_tokens.weight.dtype)
    tokens = torch.tensor([t for p in prompts for t in p])
    first = model.logits(prefill(model, cache, tokens, torch.tensor(lens), cache.offsets))
    nxt = torch.tensor([p[0] for p in prompts])  # the same next token for every model compared
    second = model.logits(decode_step(model, cache, nxt, cache.offsets, torch.tensor(lens)))
    return torch.cat((first, second))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("cfg", [TINY, GPT_OSS], ids=["mixtral", "gpt-oss"])
def test_bf16_fused_experts_match_the_per_expert_loop(cfg):
    model = build_model(cfg, torch.bfloat16, None, seed=0)
    loop = copy.deepcopy(model)
    pack_model(model)
    pack_model(loop, fused_experts=False)
    assert isinstance(model.layers[0].mlp.gate_up_proj, FusedExperts)
    assert not isinstance(loop.layers[0].mlp.gate_up_proj, FusedExperts)  # oneDNN's packed list, or dense
    prompts = _prompts(cfg.vocab_size)
    assert _rel(_logits(model, prompts), _logits(loop, prompts)) < 3e-2


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("cfg", [TINY, GPT_OSS], ids=["mixtral", "gpt-oss"])
def test_quantized_experts_match_dequantize_then_matmul(cfg, method):
    model = build_model(cfg, torch.bfloat16, None, seed=0)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer in reference.layers:
            moe = layer.mlp
            group = int4_group_for(moe.gate_up_proj.shape[2], moe.down_proj.shape[2])
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(moe, name)
                w.copy_(dequantize(quantize(w.to(torch.bfloat16).float(), method, group)))
    pack_model(model, method)
    pack_model(reference, fused_experts=False)
    packed = model.layers[0].mlp.gate_up_proj.packed
    assert packed.fmt13 == {"int8": "int8", "int4": "uint4"}[method]
    prompts = _prompts(cfg.vocab_size)
    assert _rel(_logits(model, prompts), _logits(reference, prompts)) < 3e-2


def test_quantized_experts_are_smaller():
    model = build_model(TINY, torch.bfloat16, None, seed=0)
    dense = sum(layer.mlp.gate_up_proj.numel() + layer.mlp.down_proj.numel() for layer in model.layers) * 2
    sizes = {}
    for method in ("int8", "int4"):
        m = copy.deepcopy(model)
        pack_model(m, method)
        sizes[method] = sum(layer.mlp.gate_up_proj.nbytes() for layer in m.layers)
    assert sizes["int8"] < 0.55 * dense and sizes["int4"] < 0.33 * dense


def test_quantize_option_is_checked_before_loading():
    with pytest.raises(OptionError, match="--quantize 'int3'.*int8, int4"):
        EngineOptions("tiny", quantize="int3").validate()
    assert EngineOptions("tiny", quantize="int4-g64").quantization() == ("int4", 64)


@pytest.mark.parametrize("form", ["strips", "float32"])
@pytest.mark.parametrize("cfg", [TINY, GPT_OSS], ids=["mixtral", "gpt-oss"])
def test_bf16_matmuls_where_onednn_packs_no_bf16(cfg, form, monkeypatch):
    """An AVX2 host (simulated on any host): the attention, dense and LM-head matmuls of a bf16 model run
    on bf16 strips (strip_linear, the AVX2 expert GEMM) or, without those kernels, packed float32 copies of
    their weights: the products of the same bf16 values, so the logits are the unpacked model's up to its own
    bf16 rounding; the memory check counts the float32 copies (2 bytes a weight) and strips at the weight's."""
    from cpu_kernels import strip_linear
    from moelight.planning import memory_check
    from moelight.runtime import cpu_linear

    real = cpu_linear.packing_supported
    monkeypatch.setattr(cpu_linear, "packing_supported", lambda dt: dt != torch.bfloat16 and real(dt))
    if not real(torch.float32):
        pytest.skip("no oneDNN packing on this torch build")
    if form == "float32":
        monkeypatch.setattr(cpu_linear, "strip_linear_available", lambda: False)
    elif not dispatch.small_linear_available():
        pytest.skip("no C++ kernels here")
    if form == "strips" and not strip_linear.strip_linear_available():
        torch.ops.moelight.set_isa("avx2")  # an AMX / AVX512-BF16 host runs the AVX2 GEMM the strips take
    try:
        model = build_model(cfg, torch.bfloat16, None, seed=0)
        dense = copy.deepcopy(model)
        packed = list(cpu_linear.packed_linears(model))
        count = sum(sum(p.numel() for p in lin.parameters()) for *_, lin in packed)
        pack_model(model, fused_experts=False)
        assert {getattr(parent, name).form for parent, name, _ in packed} == {form}
        prompts = _prompts(cfg.vocab_size)
        assert _rel(_logits(model, prompts), _logits(dense, prompts)) < 2e-2
        assert sum(n for _, n, _ in memory_check.packed_linear_sizes(cfg)) == count
        plain = memory_check.weight_bytes(cfg, torch.bfloat16)
        extra = (2 if form == "float32" else 0) + (2 if dispatch.small_linear_available() else 0)  # + plain copies
        assert memory_check.weight_bytes(cfg, torch.bfloat16, on_cpu=True) == plain + extra * count
    finally:
        if dispatch.small_linear_available():
            torch.ops.moelight.set_isa("auto")
    assert memory_check.weight_bytes(cfg, torch.float32, on_cpu=True) == memory_check.weight_bytes(cfg, torch.float32)


@pytest.mark.parametrize("cfg", [TINY, GPT_OSS], ids=["mixtral", "gpt-oss"])
def test_bf16_layers_keep_their_plain_weight_for_one_row_where_onednn_packs_bf16(cfg, monkeypatch):
    """An AVX512-BF16 host (oneDNN packs bf16): each packed bf16 layer keeps its plain weight too, and a
    one-row matmul (a decode step at batch 1) runs small_linear on it, faster there than oneDNN at one
    row; two rows and more stay on oneDNN. Either way the logits are the unpacked model's up to bf16
    rounding, and the memory check counts the plain copies (2 bytes a weight)."""
    from moelight.planning import memory_check
    from moelight.runtime import cpu_linear

    if not dispatch.small_linear_available():
        pytest.skip("no C++ kernels here")
    real = cpu_linear.packing_supported
    monkeypatch.setattr(cpu_linear, "packing_supported", lambda dt: True)  # the memory check's view of such a host
    count = sum(n for _, n, _ in memory_check.packed_linear_sizes(cfg))
    plain = memory_check.weight_bytes(cfg, torch.bfloat16)
    assert memory_check.weight_bytes(cfg, torch.bfloat16, on_cpu=True) == plain + 2 * count
    assert memory_check.weight_bytes(cfg, torch.float32, on_cpu=True) == memory_check.weight_bytes(cfg, torch.float32)
    monkeypatch.setattr(cpu_linear, "packing_supported", real)
    if not real(torch.bfloat16):
        pytest.skip("oneDNN packs no bf16 on this CPU")
    model = build_model(cfg, torch.bfloat16, None, seed=0)
    dense = copy.deepcopy(model)
    sites = [(parent, name) for parent, name, _ in cpu_linear.packed_linears(model)]
    pack_model(model, fused_experts=False)
    layers = [getattr(parent, name) for parent, name in sites]
    assert layers and all(lin.plain_rows == 1 and lin.weight_bf16 is not None for lin in layers)
    rows = []
    small = dispatch.small_linear
    routers = {layer.mlp.gate.weight.data_ptr() for m in (model, dense) for layer in m.layers}  # moe.router_logits

    def counted(x, w, *a):
        if w.data_ptr() not in routers:
            rows.append(x.numel() // x.shape[-1])
        return small(x, w, *a)

    monkeypatch.setattr(dispatch, "small_linear", counted)
    prompts = _prompts(cfg.vocab_size)
    assert _rel(_logits(model, prompts[:1]), _logits(dense, prompts[:1])) < 2e-2  # its decode step: one row
    assert rows and set(rows) == {1}
    rows.clear()
    assert _rel(_logits(model, prompts), _logits(dense, prompts)) < 2e-2  # four rows: oneDNN
    assert rows == []
