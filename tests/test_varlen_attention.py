"""varlen_attention (the GPU path's prefill and the CPU fallback): a few padded calls over length-sorted
groups give the per-sequence reference's attention, whatever the grouping, the padding's contents or the
budget; its plan keeps padding and memory bounded."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels.paged_reference import paged_attention_torch
from cpu_kernels.varlen_attention import group_cost, plan_chunks, varlen_attention


def _case(starts: list[int], news: list[int], hq: int, hkv: int, d: int, dv: int, page: int, seed: int = 0):
    """Random queries and a paged cache whose unused slots hold NaN (as a fresh device block may)."""
    g = torch.Generator().manual_seed(seed)
    need = max(-(-(s + n) // page) for s, n in zip(starts, news, strict=True))
    pages = need * len(starts) + 3
    table = torch.randperm(pages, generator=g)[: need * len(starts)].view(len(starts), need)
    k = torch.full((hkv, pages * page, d), float("nan"))
    v = torch.full((hkv, pages * page, dv), float("nan"))
    for b, (s, n) in enumerate(zip(starts, news, strict=True)):
        pos = torch.arange(s + n)
        slots = table[b, pos // page] * page + pos % page
        k[:, slots] = torch.randn(hkv, s + n, d, generator=g)
        v[:, slots] = torch.randn(hkv, s + n, dv, generator=g)
    cu = [0]
    for n in news:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, generator=g)
    return q, k, v, table, cu


def _reference(q, k, v, table, starts, cu, page, scale, window, sinks):
    """paged_attention_torch, with values narrower than keys (MLA) zero-padded to the keys' width."""
    dv = v.shape[-1]
    if dv < k.shape[-1]:
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - dv))
    out = paged_attention_torch(q, k, v, table, torch.tensor(starts), torch.tensor(cu), page, scale, window, sinks)
    return out[..., :dv]


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("budget", [1 << 24, 3000])
def test_paged_groups_equal_the_per_sequence_reference(hq, hkv, window, with_sinks, budget):
    """Prefixes of several lengths, one empty prompt, a decode-like single query; a small budget cuts the
    long prompt into query chunks and the batch into many groups."""
    starts, news = [0, 9, 3, 21, 0, 40], [13, 1, 30, 5, 0, 2]
    d, page = 16, 4
    q, k, v, table, cu = _case(starts, news, hq, hkv, d, d, page)
    sinks = torch.randn(hq) if with_sinks else None
    got = varlen_attention(q, k, v, starts, cu, 0.3, block_table=table, page_size=page, window=window, sinks=sinks,
                           budget=budget)
    want = _reference(q, k, v, table, starts, cu, page, 0.3, window, sinks)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_contiguous_keys_and_narrow_values():
    """Keys at a base slot per sequence (the ragged cache, packed prompts) and MLA's narrower values."""
    starts, news = [0, 0, 0, 5], [7, 19, 1, 3]
    q, k, v, table, cu = _case(starts, news, 8, 2, 24, 16, page=1)
    # page size 1 and a table whose rows are runs: the same keys through bases
    lengths = [s + n for s, n in zip(starts, news, strict=True)]
    bases = [0]
    for n in lengths[:-1]:
        bases.append(bases[-1] + n)
    flat_k = torch.cat([k[:, table[b, :n]] for b, n in enumerate(lengths)], 1)
    flat_v = torch.cat([v[:, table[b, :n]] for b, n in enumerate(lengths)], 1)
    got = varlen_attention(q, flat_k, flat_v, starts, cu, 0.25, bases=bases)
    want = _reference(q, k, v, table, starts, cu, 1, 0.25, None, None)
    assert got.shape == (cu[-1], 8, 16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_low_precision_inputs_compute_in_float32_on_the_cpu():
    starts, news = [2, 0], [3, 11]
    q, k, v, table, cu = _case(starts, news, 4, 2, 32, 32, page=8)
    q, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = varlen_attention(q, kb, vb, starts, cu, 0.2, block_table=table, page_size=8)
    want = _reference(q.float(), kb.float(), vb.float(), table, starts, cu, 8, 0.2, None, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_sequences_without_keys_attend_to_nothing():
    """A batch's empty slot (length 0 in decode: start -1) gives zeros, not NaN."""
    q = torch.randn(2, 2, 8)
    k, v = torch.randn(1, 10, 8), torch.randn(1, 10, 8)
    out = varlen_attention(q, k, v, [-1, 3], [0, 1, 2], 1.0, bases=[0, 5])
    assert torch.equal(out[0], torch.zeros(2, 8))
    want = torch.softmax(q[1] @ k[0, 5:9].T, -1) @ v[0, 5:9]
    torch.testing.assert_close(out[1], want)


def test_plan_covers_every_row_once_with_bounded_padding_and_memory():
    """256 prompts of 20-200 tokens: every query row in exactly one chunk, each group's padded scores at most
    twice its real ones and within the budget, and a handful of calls, not one per prompt."""
    g = torch.Generator().manual_seed(3)
    news = torch.randint(20, 201, (256,), generator=g).tolist()
    starts = [0] * 128 + torch.randint(0, 64, (128,), generator=g).tolist()
    heads, kv_width, budget = 16, 2 * 4 * 64, 1 << 24
    groups = plan_chunks(starts, news, None, heads, kv_width, budget)
    covered = [[0] * n for n in news]
    for grp in groups:
        rows, keys = max(c.rows for c in grp), max(c.keys for c in grp)
        real = sum(c.rows * c.keys for c in grp)
        assert len(grp) * rows * keys <= 2 * real
        assert group_cost(len(grp), rows, keys, heads, kv_width) <= budget
        for c in grp:
            assert c.keys == starts[c.seq] + c.q1
            for r in range(c.q0, c.q1):
                covered[c.seq][r] += 1
    assert all(x == 1 for row in covered for x in row)
    assert len(groups) <= 12


def test_a_prompt_over_the_budget_is_cut_into_query_chunks():
    groups = plan_chunks([0], [4096], 128, heads=32, kv_width=2 * 8 * 128, budget=1 << 22)
    chunks = [c for grp in groups for c in grp]
    assert len(chunks) > 1 and sum(c.rows for c in chunks) == 4096
    for c in chunks:  # a window bounds the keys each chunk reads
        assert c.first_key == max(0, c.q0 - 127)
        assert group_cost(1, c.rows, c.keys, 32, 2 * 8 * 128) <= 1 << 22


def test_bounds_on_the_device_are_refused():
    """The sequences' bounds are host data: reading them from a GPU would cost the sync this path avoids."""
    q = torch.randn(2, 2, 8)
    with pytest.raises(AssertionError, match="host data"):
        varlen_attention(q, torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.zeros(1, device="meta"), [0, 2], 1.0,
                         bases=[0])


def test_uploads_go_through_the_callers_copy():
    """One small table per group, through the caller's (pinned) upload."""
    starts, news = [0, 0, 0], [3, 90, 4]
    q, k, v, table, cu = _case(starts, news, 4, 2, 8, 8, page=4)
    seen = []

    def upload(t: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(t.shape))
        return t.clone()

    varlen_attention(q, k, v, starts, cu, 0.3, block_table=table, page_size=4, upload=upload)
    groups = plan_chunks(starts, news, None, 4, 2 * 2 * 8)
    assert seen == [(len(grp), 6) for grp in groups] and len(seen) == 2
