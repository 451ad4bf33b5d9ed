"""The weights a bf16 decode step streams whole: on huge pages (host_memory.huge_copy), q/k/v read by one
small_linear call (runtime/fused_qkv.py), the router's one row by small_linear (models/moe.router_logits).
None of it may change a number: logits are compared bit for bit against the layout they replace."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import pack_experts
from cpu_kernels.expert_quant import quantize
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.models import moe
from moelight.runtime import cpu_linear, fused_experts, fused_qkv, host_memory
from moelight.runtime.forward import decode_step, prefill
from moelight.runtime.host_memory import HUGE_PAGE, huge_copy
from moelight.runtime.latent_kv_cache import kv_cache_class
from tests.test_host_memory import _mapping_of

THP = host_memory.huge_pages_available()
KERNELS = dispatch.small_linear_available() and cpu_linear.packing_supported(torch.bfloat16)
# hidden 1024: the q / o weights are 2 MiB and the experts 8 MiB a layer, large enough for huge pages
WIDE = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=1024, num_layers=2, vocab_size=512,
               num_heads=16, num_kv_heads=4, head_dim=64, num_experts=2, top_k=2)


def test_huge_copy_keeps_values_and_moves_large_tensors():
    t = torch.randn(3, HUGE_PAGE // 4)
    h = huge_copy(t)
    assert torch.equal(h, t) and h.dtype == t.dtype and h.is_contiguous()
    if THP:
        assert h.data_ptr() % HUGE_PAGE == 0 and h.data_ptr() != t.data_ptr()
    small, strided = torch.randn(16, 16), t.T
    assert huge_copy(small) is small and huge_copy(strided) is strided and huge_copy(None) is None


def test_huge_copy_is_the_tensor_itself_without_huge_pages(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_available", lambda: False)
    t = torch.randn(3, HUGE_PAGE // 4)
    assert huge_copy(t) is t


@pytest.mark.skipif(not THP, reason="needs transparent huge pages")
def test_expert_scales_under_a_huge_page_get_a_whole_one():
    """A layer's int4 scales (bench-1b's: 1.8 and 0.9 MB) are streamed beside its codes: packed onto a
    2 MiB page of their own, where empty_huge's default leaves arrays under a huge page on 4 KiB pages."""
    gate_up = torch.randn(4, 2 * 3584, 1024, dtype=torch.bfloat16) * 0.02
    down = torch.randn(4, 1024, 3584, dtype=torch.bfloat16) * 0.02
    plain = pack_experts(quantize(gate_up, "int4", 128), quantize(down, "int4", 128))
    assert HUGE_PAGE // 4 <= plain.s13.numel() * 4 < HUGE_PAGE
    packed = pack_experts(quantize(gate_up, "int4", 128), quantize(down, "int4", 128),
                          alloc=fused_experts.expert_alloc)
    for name in ("w13", "s13", "w2"):  # s2 here is under a quarter of a huge page: left on 4 KiB pages
        t = getattr(packed, name)
        assert t.data_ptr() % HUGE_PAGE == 0, name
        assert torch.equal(t, getattr(plain, name)), name
        whole_page = _mapping_of(t.data_ptr() + HUGE_PAGE - 1)  # the 2 MiB page from t's start is advised
        assert whole_page is not None and "hg" in whole_page["VmFlags"].split(), name


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """A prefill's last-token logits, then two decode steps' (1 row each and all rows at once)."""
    lens = [len(p) for p in prompts]
    cache = kv_cache_class(model.config).allocate(model.config, [n + 4 for n in lens], model.embed_tokens.weight.dtype)
    tokens = torch.tensor([t for p in prompts for t in p])
    out = [model.logits(prefill(model, cache, tokens, torch.tensor(lens), cache.offsets))]
    pos = torch.tensor(lens)
    for i in range(len(prompts)):  # one row: the small_linear paths
        out.append(model.logits(decode_step(model, cache, torch.tensor([prompts[i][0]]), cache.offsets[i:i + 1],
                                            pos[i:i + 1])))
    out.append(model.logits(decode_step(model, cache, torch.tensor([p[1] for p in prompts]), cache.offsets, pos + 1)))
    return torch.cat(out)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 12, 7)]


@pytest.mark.skipif(not KERNELS, reason="needs the C++ kernels and oneDNN's bf16 packing")
def test_packed_model_streams_huge_pages_and_fused_qkv_with_the_same_logits(monkeypatch):
    model = build_model(WIDE, torch.bfloat16, None, seed=0)
    plain = copy.deepcopy(model)
    cpu_linear.pack_model(model)
    attn = model.layers[0].self_attn
    assert isinstance(attn.fused_qkv, fused_qkv.FusedQKV)
    stacked = attn.fused_qkv.weight
    assert attn.q_proj.weight_bf16.data_ptr() == stacked.data_ptr()  # views: the weights are held once
    assert attn.v_proj.weight_bf16.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    if THP:
        experts = model.layers[0].mlp.gate_up_proj.packed
        for t in (experts.w13, experts.w2, stacked, attn.o_proj.weight_bf16):
            assert t.data_ptr() % HUGE_PAGE == 0
    # the layout that was there before: 4 KiB pages, one call per projection
    monkeypatch.setattr(cpu_linear, "fuse_qkv", lambda attn, huge_pages: False)
    cpu_linear.pack_model(plain, huge_pages=False)
    assert plain.layers[0].self_attn.fused_qkv is None
    prompts = _prompts(WIDE.vocab_size)
    assert torch.equal(_logits(model, prompts), _logits(plain, prompts))


@pytest.mark.skipif(not KERNELS, reason="needs the C++ kernels and oneDNN's bf16 packing")
def test_fused_qkv_serves_few_rows_only(monkeypatch):
    model = build_model(WIDE, torch.bfloat16, None, seed=1)
    cpu_linear.pack_model(model)
    attn = model.layers[1].self_attn
    calls = []
    real = dispatch.small_linear
    monkeypatch.setattr(dispatch, "small_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    h = torch.randn(1, WIDE.hidden_size).to(torch.bfloat16)
    q, k, v = attn.qkv(h)
    assert calls == [(1024 + 2 * 256, 1024)]  # one call over the stacked weight
    assert torch.equal(q, attn.q_proj(h)) and torch.equal(k, attn.k_proj(h)) and torch.equal(v, attn.v_proj(h))
    assert attn.fused_qkv(torch.randn(attn.fused_qkv.rows + 1, WIDE.hidden_size).to(torch.bfloat16)) is None


def test_fuse_qkv_leaves_layers_without_plain_weights_alone():
    model = build_model(PRESETS["tiny"], torch.float32, None, seed=0)
    cpu_linear.pack_model(model)  # float32: no plain bf16 weights
    assert all(layer.self_attn.fused_qkv is None for layer in model.layers)


@pytest.mark.skipif(not dispatch.small_linear_available(), reason="C++ kernels unavailable")
def test_router_reads_few_bf16_rows_with_small_linear(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(8, 256, generator=g) * 0.05).to(torch.bfloat16)
    calls = []
    real = dispatch.small_linear
    monkeypatch.setattr(dispatch, "small_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.inference_mode():
        for rows in (1, 4, 9):
            x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
            got = moe.router_logits(x, w)
            ref = F.linear(x.double(), w.double())
            assert got.dtype == torch.bfloat16
            assert torch.allclose(got.double(), ref, rtol=2 ** -8, atol=1e-3)
        moe.router_logits(torch.randn(2, 256), w.float())  # float32: F.linear
    assert calls == [1, 4]
