"""Paged attention (prefix sharing): the C++ kernels (every ISA) read through block tables exactly as the
torch reference does, and the reference equals plain attention over each sequence's keys gathered in order."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import decode_attention, paged_decode_attention, paged_prefill_attention, prefill_attention
from cpu_kernels.paged_reference import paged_attention_torch, sequence_slots

PAGE = 16


def _cache(hkv: int, pages: int, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(hkv, pages * PAGE, d, generator=g).to(dtype)
    v = torch.randn(hkv, pages * PAGE, d, generator=g).to(dtype)
    return k, v


def _tables(lengths: list[int], pages: int, shared: int, contiguous: bool) -> torch.Tensor:
    """Block tables whose first `shared` pages are the same for every sequence, the rest drawn from the
    other pages (consecutive runs or scattered)."""
    g = torch.Generator().manual_seed(2)
    need = max(-(-n // PAGE) for n in lengths)
    free = list(range(shared, pages))
    if not contiguous:
        free = [free[i] for i in torch.randperm(len(free), generator=g).tolist()]
    rows = []
    for _ in lengths:
        own, free = free[: need - shared], free[need - shared:]
        rows.append(list(range(shared)) + own)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_paged_decode_matches_reference(cpp_backend, dtype, contiguous, hq, hkv):
    d, lengths = 64, [1, 17, 40, 300, 33]
    k, v = _cache(hkv, 200, d, dtype)
    table = _tables(lengths, 200, shared=2, contiguous=contiguous)
    q = torch.randn(len(lengths), hq, d).to(dtype)
    lens = torch.tensor(lengths)
    got = paged_decode_attention(q, k, v, table, lens, PAGE, d**-0.5)
    want = paged_attention_torch(q, k, v, table, lens - 1, torch.arange(len(lengths) + 1), PAGE, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
def test_paged_prefill_matches_reference(cpp_backend, dtype, contiguous, hq, hkv):
    """New tokens after cached prefixes of 0, 16, 32 and 48 positions (whole pages) and a run that starts
    inside a tile of queries (scattered pages)."""
    d = 64
    starts, news = [0, 16, 32, 48], [37, 1, 80, 16]
    lengths = [s + n for s, n in zip(starts, news, strict=True)]
    k, v = _cache(hkv, 200, d, dtype)
    table = _tables(lengths, 200, shared=0, contiguous=contiguous)
    cu = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist())
    q = torch.randn(int(cu[-1]), hq, d).to(dtype)
    got = paged_prefill_attention(q, k, v, table, torch.tensor(starts), cu, PAGE, d**-0.5)
    want = paged_attention_torch(q, k, v, table, torch.tensor(starts), cu, PAGE, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_with_values_narrower_than_keys(cpp_backend, dtype):
    """MLA's prefix prefill (LatentKVCache.prefix_attend): keys 128 + 64 wide, values 128 (zero-padded for
    the kernel and cut back), every position its own "page" of one slot, sequences laid out in order."""
    g = torch.Generator().manual_seed(3)
    starts, news = [0, 16, 40], [30, 5, 70]
    lengths = [s + n for s, n in zip(starts, news, strict=True)]
    k = torch.randn(16, sum(lengths), 192, generator=g).to(dtype)
    v = torch.randn(16, sum(lengths), 128, generator=g).to(dtype)
    firsts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    table = (firsts[:, None] + torch.arange(max(lengths))).clamp(max=sum(lengths) - 1)
    cu = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist())
    q = torch.randn(int(cu[-1]), 16, 192, generator=g).to(dtype)
    got = paged_prefill_attention(q, k, v, table, torch.tensor(starts), cu, 1, 192**-0.5)
    assert got.shape == (int(cu[-1]), 16, 128) and got.dtype == dtype
    want = torch.empty(int(cu[-1]), 16, 128, dtype=torch.float64)
    for b, (s0, n) in enumerate(zip(starts, news, strict=True)):
        for i in range(n):  # position s0 + i sees keys 0 .. s0 + i of its sequence
            keys = slice(int(firsts[b]), int(firsts[b]) + s0 + i + 1)
            p = torch.softmax(torch.einsum("hd,hkd->hk", q[cu[b] + i].double(), k[:, keys].double()) * 192**-0.5, -1)
            want[cu[b] + i] = torch.einsum("hk,hkd->hd", p, v[:, keys].double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_reference_equals_plain_attention_over_gathered_keys():
    """The reference itself: with no cached prefix it is causal prefill attention over the sequence's
    gathered keys; a one-query row is decode attention over them."""
    d, hq, hkv = 64, 8, 2
    k, v = _cache(hkv, 64, d, torch.float32)
    lengths = [30, 45]
    table = _tables(lengths, 64, shared=1, contiguous=False)
    ks = [k[:, sequence_slots(table[b], n, PAGE)] for b, n in enumerate(lengths)]
    vs = [v[:, sequence_slots(table[b], n, PAGE)] for b, n in enumerate(lengths)]
    cu = torch.tensor([0, 30, 75])
    q = torch.randn(75, hq, d)
    flat_k = torch.cat(ks, 1).transpose(0, 1)
    flat_v = torch.cat(vs, 1).transpose(0, 1)
    want = prefill_attention(q, flat_k, flat_v, cu, d**-0.5)
    got = paged_attention_torch(q, k, v, table, torch.zeros(2, dtype=torch.int64), cu, PAGE, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    q1 = torch.randn(2, hq, d)
    ragged_k, ragged_v = torch.cat(ks, 1), torch.cat(vs, 1)
    want1 = decode_attention(q1, ragged_k, ragged_v, torch.tensor([0, 30]), torch.tensor(lengths), d**-0.5)
    got1 = paged_decode_attention(q1, k, v, table, torch.tensor(lengths), PAGE, d**-0.5)
    torch.testing.assert_close(got1, want1, atol=1e-5, rtol=1e-5)


def test_window_and_sinks_take_the_reference_path():
    d, hq, hkv = 64, 4, 2
    k, v = _cache(hkv, 32, d, torch.float32)
    table = _tables([50], 32, shared=0, contiguous=False)
    q = torch.randn(1, hq, d)
    sinks = torch.randn(hq)
    slots = sequence_slots(table[0], 50, PAGE)
    want = decode_attention(q, k[:, slots], v[:, slots], torch.tensor([0]), torch.tensor([50]), d**-0.5,
                            window=8, sinks=sinks)
    got = paged_decode_attention(q, k, v, table, torch.tensor([50]), PAGE, d**-0.5, window=8, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_block_table_out_of_cache_is_an_error():
    k, v = _cache(2, 4, 64, torch.float32)
    q = torch.randn(1, 2, 64)
    with pytest.raises(RuntimeError, match="block table"):
        paged_decode_attention(q, k, v, torch.tensor([[9]]), torch.tensor([5]), PAGE, 0.125)
