"""The device kernels that replace per-expert and per-sequence loops: grouped expert GEMMs
(grouped_mm, and the padded bmm of GPUs without it) against the per-expert reference loop, and the
batched decode attention against the reference attention; both without a host sync, and the
grouped experts with a number of kernel launches that does not grow with the expert count."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels.reference import decode_attention_torch
from moelight.devices.compute_counter import ComputeCounts, counting
from moelight.devices.device_attention import batched_decode_attention
from moelight.models import grouped_experts
from moelight.models.grouped_experts import ExpertGroup, GroupedExperts, grouped_expert_mix
from moelight.models.moe import expert_mix, swiglu


def _experts(E: int, h: int, f: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * f, h, generator=gen) * 0.2, torch.randn(E, h, f, generator=gen) * 0.2)


def _routing(T: int, E: int, k: int, h: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=gen)
    probs = torch.softmax(torch.randn(T, E, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), experts


def _table(gu, dn, resident: int) -> GroupedExperts:
    """Experts [0, resident) in one stack, the rest in another (a runtime's resident and paged groups)."""
    return GroupedExperts((ExpertGroup(0, gu[:resident], dn[:resident]), ExpertGroup(resident, gu[resident:],
                                                                                      dn[resident:])), len(gu))


def _clamped(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=0.7), up.clamp(-0.7, 0.7)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


@pytest.mark.parametrize("padded", [False, True], ids=["grouped_mm", "padded-bmm"])
@pytest.mark.parametrize("T,E,k,resident", [(1, 4, 2, 0), (5, 8, 2, 3), (37, 8, 3, 8), (16, 32, 8, 5)])
@pytest.mark.parametrize("biases", [False, True])
def test_grouped_experts_equal_the_per_expert_loop(monkeypatch, padded, T, E, k, resident, biases):
    if padded:
        monkeypatch.setattr(grouped_experts, "grouped_mm_supported", lambda device, dtype: False)
    h, f = 24, 40
    gu, dn = _experts(E, h, f)
    x, w, e = _routing(T, E, k, h)
    gen = torch.Generator().manual_seed(2)
    gb, db = (torch.randn(E, 2 * f, generator=gen), torch.randn(E, h, generator=gen)) if biases else (None, None)
    act = _clamped if biases else swiglu  # GPT-OSS: expert biases and its clamped SwiGLU
    ref = expert_mix(x, w, e, gu, dn, activation=act, gate_up_bias=gb, down_bias=db)
    got = grouped_expert_mix(x, w, e, _table(gu, dn, resident), act, gb, db)
    # grouped_mm: the same GEMMs over the same rows and the same sums in the same order; only the
    # vectorised element-wise functions (sigmoid, silu) may round a value differently in a longer tensor
    torch.testing.assert_close(got, ref, rtol=1e-5 if padded else 1e-6, atol=1e-6 if padded else 1e-7)


@pytest.mark.parametrize("h,f,dtype", [(36, 10, torch.float32), (24, 12, torch.bfloat16), (18, 16, torch.float32)])
def test_widths_grouped_mm_cannot_take_run_padded(h, f, dtype):
    """torch._grouped_mm wants every row a multiple of 16 bytes; a tensor-parallel rank's expert width
    (DBRX's 20 over two ranks: 10 float32 values, 40 bytes) is not, so those experts run the padded bmm."""
    gu, dn = (m.to(dtype) for m in _experts(5, h, f))
    x, w, e = _routing(3, 5, 5, h)
    table = _table(gu, dn, 2)
    assert not grouped_experts.grouped_mm_fits(table, dtype)
    ref = expert_mix(x.to(dtype), w, e, gu, dn, activation=swiglu)
    got = grouped_expert_mix(x.to(dtype), w, e, table, swiglu)
    torch.testing.assert_close(got, ref, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


def test_expert_mix_takes_the_grouped_path_for_a_table_and_the_loop_elsewhere():
    gu, dn = _experts(8, 16, 24)
    x, w, e = _routing(6, 8, 2, 16)
    counts = ComputeCounts()
    with counting(counts, lambda t: True):
        grouped = expert_mix(x, w, e, _table(gu, dn, 3), _table(gu, dn, 3))
    assert counts.syncs == 0
    with counting(counts, lambda t: True):
        loop = expert_mix(x, w, e, gu, dn)
    assert counts.syncs >= 1  # the loop reads the counts back (bincount, tolist): the check can fail
    torch.testing.assert_close(grouped, loop, rtol=1e-6, atol=1e-7)


def test_grouped_experts_launch_as_many_kernels_for_32_experts_as_for_4():
    launches = []
    for E in (4, 32):
        gu, dn = _experts(E, 16, 24)
        x, w, e = _routing(8, E, 2, 16)
        counts = ComputeCounts()
        with counting(counts, lambda t: True):
            grouped_expert_mix(x, w, e, _table(gu, dn, 2), swiglu)
        launches.append(counts.launches)
    assert launches[0] == launches[1] < 60


@pytest.mark.parametrize("window,sinks", [(None, False), (3, False), (None, True), (4, True)])
def test_batched_decode_attention_equals_the_reference(window, sinks):
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 8, 2, 16
    lengths = torch.tensor([1, 5, 9, 2])
    offsets = torch.tensor([0, 12, 20, 40])  # free slots after each sequence, as the engine's pool has
    k = torch.randn(hkv, 48, d, generator=gen)
    v = torch.randn(hkv, 48, d, generator=gen)
    q = torch.randn(4, hq, d, generator=gen)
    sink = torch.randn(hq, generator=gen) if sinks else None
    offs, lens = offsets, lengths
    if window is not None:  # the reference narrows each sequence's block itself in the runtime's caller
        skip = (lengths - window).clamp(min=0)
        offs, lens = offsets + skip, lengths - skip
    ref = decode_attention_torch(q, k, v, offs, lens, d**-0.5, sink)
    counts, longest = ComputeCounts(), int(lengths.max())  # host data, as positions are
    with counting(counts, lambda t: True):
        got = batched_decode_attention(q, k, v, offsets, lengths, longest, d**-0.5, window, sink)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert counts.syncs == 0


def test_a_pass_longer_than_the_expert_chunk_runs_chunk_by_chunk_with_the_same_result(monkeypatch):
    gu, dn = _experts(8, 24, 40)
    x, w, e = _routing(37, 8, 2, 24)
    whole = grouped_expert_mix(x, w, e, _table(gu, dn, 3), swiglu)
    monkeypatch.setattr(grouped_experts, "EXPERT_CHUNK_TOKENS", 8)
    calls = []
    inner = grouped_experts.grouped_expert_mix
    monkeypatch.setattr(grouped_experts, "grouped_expert_mix",
                        lambda *a, **k: calls.append(len(a[0])) or inner(*a, **k))
    chunked = inner(x, w, e, _table(gu, dn, 3), swiglu)
    assert calls == [8, 8, 8, 8, 5]
    # the same rows through the same experts; only the GEMMs' blocking differs with the row count
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("capability,dtype,fast", [((9, 0), torch.bfloat16, True), ((10, 0), torch.bfloat16, True),
                                                   ((8, 0), torch.bfloat16, False), ((8, 9), torch.bfloat16, False),
                                                   ((7, 5), torch.float16, False), ((9, 0), torch.float16, False),
                                                   ((9, 0), torch.float32, False)])
def test_grouped_mm_runs_on_a_gpu_only_where_its_grouped_kernel_does(monkeypatch, capability, dtype, fast):
    """torch._grouped_mm's fallback (every CUDA GPU but sm90/sm100 in bfloat16) reads its offsets on the
    host and runs one mm per group: the padded bmm runs there instead, decided without touching the GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(grouped_experts, "_grouped_mm_works", {})
    gpu = torch.device("cuda", 0)
    assert grouped_experts.grouped_mm_fast_on(gpu, dtype) is fast
    if not fast:  # no probe on the GPU: refused before it
        assert grouped_experts.grouped_mm_supported(gpu, dtype) is False
    assert grouped_experts.grouped_mm_fast_on(torch.device("cpu"), dtype)  # the emulated device's CPU


def test_a_grouped_mm_that_takes_its_fallback_counts_as_a_host_sync(monkeypatch):
    from moelight.devices import compute_counter

    gu, dn = _experts(4, 16, 24)
    x, w, e = _routing(8, 4, 2, 16)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    for fast, syncs in ((True, 0), (False, 1)):
        monkeypatch.setattr(compute_counter, "grouped_mm_fast_on", lambda device, dtype, fast=fast: fast)
        counts = ComputeCounts()
        with counting(counts, lambda t: True):
            torch._grouped_mm(x, gu[:2].transpose(-2, -1), offs=offs)
        assert counts.syncs == syncs
