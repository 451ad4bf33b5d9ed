"""The latent (MLA) decode kernel against a float64 reference: every ISA the CPU offers (AMX, AVX512-BF16,
AVX-512, AVX2), every cache dtype, DeepSeek's row shape and the small test shape, head counts that do
and do not fill a tile, ragged lengths from 0 to split sequences; the dispatch and the torch fallback; the
paged form (prefix sharing) against the ragged one."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import kernel_backend, latent_decode_attention, paged_latent_decode_attention
from cpu_kernels.latent import LATENT_SHAPES, latent_decode_attention_torch

CPP = kernel_backend() != "torch"
needs_cpp = pytest.mark.skipif(not CPP, reason="C++ kernels unavailable")
LENGTHS = [1, 5, 16, 17, 33, 700, 0, 1500]  # 700 and 1500 are split into chunks and merged


def reference64(q, cache, offsets, lengths, scale, dv):
    out = torch.empty(q.shape[0], q.shape[1], dv, dtype=torch.float64)
    for b, (o, n) in enumerate(zip(offsets.tolist(), lengths.tolist(), strict=True)):
        rows = cache[0, o : o + n].double()
        p = torch.softmax(q[b].double() @ rows.T * scale, dim=-1)
        out[b] = p @ rows[:, :dv]
    return out


def case(w: int, dt: torch.dtype, heads: int, seed: int = 0, lengths=LENGTHS, q_dtype=None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    caps = lens + 3  # slack after each sequence, as the engine's regions have
    offs = torch.cumsum(caps, 0) - caps
    cache = torch.randn(1, int(caps.sum()), w, generator=g).to(dt)
    q = (torch.randn(len(lens), heads, w, generator=g) * 0.2).to(q_dtype or dt)
    return q, cache, offs, lens


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Error at the output's own rounding: two ulps of the largest value."""
    tol = 2 * torch.finfo(got.dtype).eps * float(want.abs().max())
    err = float((got.double() - want).abs().max())
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


def isas() -> list[str]:
    """The ISA levels this CPU runs, best first (amx: AMX tiles for a bf16 cache, AVX512-BF16 else)."""
    if not CPP:
        return []
    best = torch.ops.moelight.set_isa("auto")
    order = ["amx", "avx512bf16", "avx512", "avx2"]
    return order[order.index(best):] if best in order else []


@pytest.fixture(params=isas() or ["none"])
def isa(request):
    if request.param == "none" or torch.ops.moelight.set_isa(request.param) != request.param:
        torch.ops.moelight.set_isa("auto")
        pytest.skip(f"no {request.param} kernels on this CPU")
    yield request.param
    torch.ops.moelight.set_isa("auto")


@needs_cpp
@pytest.mark.parametrize("w,dv", LATENT_SHAPES)
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_float64_on_every_isa(isa, w, dv, dt):
    for heads in (1, 3, 16, 20, 32):  # 20: a full tile of 16 heads and a partial one; 32: two of 16
        q, cache, offs, lens = case(w, dt, heads, seed=heads)
        got = latent_decode_attention(q, cache, offs, lens, w**-0.5 * 2, dv)
        assert got.shape == (len(lens), heads, dv) and got.dtype == dt
        within_rounding(got, reference64(q, cache, offs, lens, w**-0.5 * 2, dv))
        assert (got[lens == 0] == 0).all()  # no keys: zeros, as the GQA kernel gives


@needs_cpp
def test_float32_queries_over_a_bf16_cache(isa):
    """A float32 model's queries over a bf16 cache: q keeps ~16 bits (split into two bf16 parts)."""
    q, cache, offs, lens = case(576, torch.bfloat16, 16, q_dtype=torch.float32)
    got = latent_decode_attention(q, cache, offs, lens, 0.05, 512)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference64(q, cache, offs, lens, 0.05, 512), rtol=0, atol=2e-5)


@needs_cpp
def test_one_long_sequence_spreads_and_merges(isa):
    q, cache, offs, lens = case(96, torch.bfloat16, 16, lengths=[5000])
    within_rounding(latent_decode_attention(q, cache, offs, lens, 0.1, 64),
                    reference64(q, cache, offs, lens, 0.1, 64))


def test_torch_path_for_other_shapes_and_the_fallback(monkeypatch):
    """Row widths without a C++ instantiation (and MOELIGHT_CPU_KERNELS=torch) run the reference."""
    q, cache, offs, lens = case(24, torch.float32, 4, lengths=[3, 9])
    torch.testing.assert_close(latent_decode_attention(q, cache, offs, lens, 0.3, 16).double(),
                               reference64(q, cache, offs, lens, 0.3, 16), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"cache \[1, T, W\]"):
        latent_decode_attention_torch(q, cache[..., :20], offs, lens, 0.3, 16)


@needs_cpp
def test_kernel_refuses_what_it_cannot_read():
    q, cache, offs, lens = case(576, torch.bfloat16, 16, lengths=[4, 4])
    with pytest.raises(RuntimeError, match="out of cache"):
        torch.ops.moelight.latent_decode_attention(q, cache, offs, torch.tensor([4, 400]), 0.1, 512)
    with pytest.raises(RuntimeError, match="no latent kernel"):
        torch.ops.moelight.latent_decode_attention(q[..., :544], cache[..., :544].contiguous(), offs, lens, 0.1, 512)


def paged_case(w: int, dt: torch.dtype, heads: int, lengths: list[int], page: int = 16, seed: int = 0):
    """Sequences placed in shuffled pages, the first two sharing their leading pages (a shared prefix),
    each sequence's pages partly in order (coalesced into runs) -> the paged inputs and the same
    sequences copied into a ragged cache."""
    g = torch.Generator().manual_seed(seed)
    pages_of = [-(-n // page) for n in lengths]
    n_pages = sum(pages_of) + 4
    cache = torch.randn(1, n_pages * page, w, generator=g).to(dt)
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, used = [], 0
    for b, k in enumerate(pages_of):
        own = sorted(order[used:used + k]) if b % 2 else order[used:used + k]  # odd rows: consecutive runs
        used += k
        if b == 1 and pages_of[0] > 1:  # row 1 starts with row 0's first pages
            shared = min(pages_of[0] - 1, k)
            own = tables[0][:shared] + own[shared:]
        tables.append(own)
    width = max(pages_of + [1])
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    lens = torch.tensor(lengths)
    slots = [torch.tensor([table[b, p // page] * page + p % page for p in range(n)], dtype=torch.int64)
             for b, n in enumerate(lengths)]
    ragged = cache[:, torch.cat(slots)] if sum(lengths) else cache[:, :0]
    offs = torch.cumsum(lens, 0) - lens
    q = (torch.randn(len(lengths), heads, w, generator=g) * 0.2).to(dt)
    return q, cache, table, lens, ragged, offs


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,heads", [(16, 16), (16, 32), (8, 16)])
def test_paged_cache_reads_the_same_rows_as_the_ragged_one(isa, dt, page, heads):
    """Pages of 16 keys (the kernel's block) are read in place block by block; pages of 8 split blocks,
    so a short sequence's rows are copied together first."""
    lengths = [40, 70, 0, 1, 16, 17, 900, 333]  # 900: runs cut into chunks and merged
    for w, dv in LATENT_SHAPES:
        q, cache, table, lens, ragged, offs = paged_case(w, dt, heads, lengths, page=page, seed=w)
        got = paged_latent_decode_attention(q, cache, table, lens, page, w**-0.5, dv)
        assert got.shape == (len(lengths), heads, dv) and got.dtype == dt
        within_rounding(got, reference64(q, ragged, offs, lens, w**-0.5, dv))
        assert (got[lens == 0] == 0).all()


def test_paged_torch_fallback_matches_the_reference():
    q, cache, table, lens, ragged, offs = paged_case(24, torch.float32, 4, [5, 30, 18])
    torch.testing.assert_close(paged_latent_decode_attention(q, cache, table, lens, 16, 0.3, 16).double(),
                               reference64(q, ragged, offs, lens, 0.3, 16), rtol=0, atol=1e-6)


@needs_cpp
def test_paged_kernel_refuses_a_short_block_table():
    q, cache, table, lens, _, _ = paged_case(576, torch.bfloat16, 16, [20, 20])
    with pytest.raises(RuntimeError, match="block table shorter"):
        torch.ops.moelight.paged_latent_decode_attention(q, cache, table, torch.tensor([20, 400]), 16, 0.1, 512)


@needs_cpp
@pytest.mark.parametrize("paged", [False, True])
def test_rows_past_each_sequence_are_never_read(isa, paged):
    """Every cache row no sequence owns is NaN: a kernel that reads a block of 16 rows past a sequence's
    end (AMX tiles read whole blocks; the kernels prefetch the next item) must not let them into the
    output, where P = 0 times NaN would be NaN."""
    lengths = [1, 5, 16, 17, 33, 117, 250, 700]  # tails of every size, full blocks, split sequences
    for w, dv in LATENT_SHAPES:
        if paged:
            q, cache, table, lens, ragged, offs = paged_case(w, torch.bfloat16, 16, lengths, seed=3)
            owned = torch.zeros(cache.shape[1], dtype=torch.bool)
            for b, n in enumerate(lengths):
                pos = torch.arange(n)
                owned[table[b, pos // 16] * 16 + pos % 16] = True
            cache[0, ~owned] = float("nan")
            got = paged_latent_decode_attention(q, cache, table, lens, 16, w**-0.5, dv)
        else:
            q, cache, offs, lens = case(w, torch.bfloat16, 16, seed=3, lengths=lengths)
            owned = torch.zeros(cache.shape[1], dtype=torch.bool)
            for o, n in zip(offs.tolist(), lengths, strict=True):
                owned[o : o + n] = True
            ragged = cache.clone()
            cache[0, ~owned] = float("nan")
            got = latent_decode_attention(q, cache, offs, lens, w**-0.5, dv)
        assert not got.isnan().any()
        within_rounding(got, reference64(q, ragged, offs, lens, w**-0.5, dv))


@needs_cpp
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_every_tail_and_rescale_of_a_step(isa, dt):
    """Every length over one to two steps of 32 keys (the AVX2 kernel's; key passes of 1 to 6), with
    scores that climb by more than the softmax's slack from key to key for some heads and not others:
    each head's maximum moves at its own steps and rescales only its own accumulator row."""
    lengths = list(range(1, 66))
    for w, dv in LATENT_SHAPES:
        q, cache, offs, lens = case(w, dt, 16, seed=5, lengths=lengths)
        for o, n in zip(offs.tolist(), lengths, strict=True):  # heads 0-7: each key's score ~0.8 above the last
            cache[0, o : o + n, 0] = (torch.arange(n) * 0.5).to(dt)
        q[:, :8, 0] = 40.0
        q[:, 8:, 0] = -40.0
        got = latent_decode_attention(q, cache, offs, lens, w**-0.5, dv)
        within_rounding(got, reference64(q, cache, offs, lens, w**-0.5, dv))
