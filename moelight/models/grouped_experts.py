"""A layer's routed experts as a few stacked groups, run by grouped GEMMs without a host sync.

A runtime holds a layer's experts in a few contiguous stacks (the resident ones, a paged slot);
`GroupedExperts` names them, and `grouped_expert_mix` computes the MoE block over them with every
index on the device: no per-expert Python loop (two grouped GEMMs per group instead of ~8 small
kernels per expert) and no count read back to the host. Where `torch._grouped_mm` runs its grouped
kernel (bfloat16 on compute capability 9.x/10.x, or the CPU; checked once per device and dtype against
per-group matmuls, and where every row of its operands is a multiple of 16 bytes, as it requires: a
tensor-parallel rank's odd expert width is not) it does the GEMMs;
elsewhere each group is
padded to [experts, tokens, hidden] for a `bmm` (every expert has room for every token: with k
experts per token that is E/k times the rows, acceptable for decode micro-batches; a larger
batch, e.g. a prefill, falls back to the per-expert loop of `moe.expert_mix`).

Groups may hold their experts quantized (`QuantizedStack`, models/fused_dequant.py): a runtime on a
GPU that multiplies the codes directly runs the fused dequant-GEMM kernel there, at any token count.

The expert outputs of a token are summed in ascending expert order, as `expert_mix` and the
reference implementations sum them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hrm.operators import EXPERT_CHUNK_TOKENS
from moelight.models.fused_dequant import QuantizedStack, fused_linear, tile_map

PADDED_MAX_TOKENS = 512  # above this many tokens the padded bmm wastes too much: the per-expert loop runs
_grouped_mm_works: dict[tuple[str, torch.dtype], bool] = {}


@dataclass(frozen=True)
class ExpertGroup:
    first: int  # expert id of gate_up[0]
    gate_up: torch.Tensor | QuantizedStack  # [n, 2f, h]
    down: torch.Tensor | QuantizedStack  # [n, h, f]


@dataclass(frozen=True)
class GroupedExperts:
    """Experts first .. first + n - 1 of each group in one stack; together all E experts."""

    groups: tuple[ExpertGroup, ...]
    num_experts: int
    gate_up_side: bool = True  # which matrix `[e]` indexes (the per-expert loop reads both views)

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, e: int) -> torch.Tensor:
        for g in self.groups:
            if g.first <= e < g.first + g.gate_up.shape[0]:
                return (g.gate_up if self.gate_up_side else g.down)[e - g.first]
        raise IndexError(f"expert {e} is in no group")

    @property
    def quantized(self) -> bool:
        """Whether the groups hold their experts quantized (all of them do, or none)."""
        return any(isinstance(g.gate_up, QuantizedStack) for g in self.groups)

    @property
    def down_side(self) -> GroupedExperts:
        return GroupedExperts(self.groups, self.num_experts, gate_up_side=False)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of one gate_up matmul (here, not in moe.py, so the
    fused dequant-GEMM can recognise it and compute it in its epilogue)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_mm_fast_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs its grouped kernel here. Elsewhere on a GPU it runs its fallback
    (torch 2.13: GroupedBlas.cpp `_grouped_mm_cuda`, GroupedMMUtils.h `_grouped_mm_fallback`), which
    copies the offsets to the host (a host sync per call, unseen by a dispatch-mode counter) and
    launches one mm per group: the grouped kernel takes bfloat16 on compute capability 9.x or 10.x
    only (not T4, L4, A100, nor float16/float32 anywhere; on ROCm, the fallback too). On the CPU (the
    emulated device) there is no GPU to stall: the fallback is as good as a grouped GEMM there."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here without a host sync (`grouped_mm_fast_on`) and agrees
    with per-group matmuls (probed once); where not, the padded bmm runs."""
    key = (str(device), dtype)
    if key not in _grouped_mm_works:
        ok = hasattr(torch, "_grouped_mm") and grouped_mm_fast_on(device, dtype)
        if ok:
            try:
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(13, 32, generator=gen).to(device, dtype)
                w = torch.randn(3, 48, 32, generator=gen).to(device, dtype)
                offs = torch.tensor([5, 5, 11], dtype=torch.int32, device=device)  # an empty group, a short tail
                got = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)[:11].float()
                ref = torch.cat([x[:5] @ w[0].T, x[5:11] @ w[2].T]).float()
                ok = bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-2))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _grouped_mm_works[key] = ok
    return _grouped_mm_works[key]


def grouped_mm_fits(table: GroupedExperts, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm takes these experts' shapes: rows of h, 2f and f values, each a multiple
    of 16 bytes."""
    size = dtype.itemsize
    return all(d * size % 16 == 0 for g in table.groups for d in (*g.gate_up.shape[1:], g.down.shape[2]))


def _use_grouped_mm(x: torch.Tensor, table: GroupedExperts) -> bool:
    return grouped_mm_supported(x.device, x.dtype) and grouped_mm_fits(table, x.dtype)


def use_grouped_path(x: torch.Tensor, table) -> bool:
    return isinstance(table, GroupedExperts) and (table.quantized or _use_grouped_mm(x, table)
                                                  or x.shape[0] <= PADDED_MAX_TOKENS)


def _group_linear(xs: torch.Tensor, w: torch.Tensor, first: int, sorted_e: torch.Tensor, starts: torch.Tensor,
                  ends: torch.Tensor, tokens: int, grouped_mm: bool) -> torch.Tensor:
    """Rows of xs [P, K] (sorted by expert) through their expert's w[e - first] [N, K] -> [P, N];
    only the rows of this group's experts are meaningful."""
    n, P = w.shape[0], xs.shape[0]
    arange = torch.arange(P, device=xs.device)
    if grouped_mm:
        if first == 0:
            return torch._grouped_mm(xs, w.transpose(-2, -1), offs=ends[:n].to(torch.int32))
        lo = starts[first]  # the group's rows start here: rotate them to row 0 (on the device)
        offs = (ends[first:first + n] - lo).to(torch.int32)
        y = torch._grouped_mm(xs.index_select(0, (arange + lo) % P), w.transpose(-2, -1), offs=offs)
        return y.index_select(0, (arange - lo) % P)
    local = sorted_e - first  # padded: expert-local row e * tokens + position, the rest to a spare row
    inside = (local >= 0) & (local < n)
    slot = torch.where(inside, local * tokens + (arange - starts[sorted_e]), n * tokens)
    padded = xs.new_zeros(n * tokens + 1, xs.shape[1]).index_copy_(0, slot, xs)
    y = torch.bmm(padded[:-1].view(n, tokens, -1), w.transpose(-2, -1)).view(n * tokens, -1)
    return y.index_select(0, slot.clamp(max=n * tokens - 1))


def grouped_expert_mix(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: GroupedExperts,
                       activation: Callable[[torch.Tensor], torch.Tensor],
                       gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """x [T, h], routing weights / expert ids [T, k] -> the weighted sum of the experts [T, h]. A pass
    of more than EXPERT_CHUNK_TOKENS tokens runs in chunks of that many: every token's k rows are live
    at once, so chunks bound the pass's expert activations as the HRM counts them (a token's result
    does not depend on the others in its chunk)."""
    T, k = experts.shape
    if T > EXPERT_CHUNK_TOKENS:
        return torch.cat([grouped_expert_mix(x[i:i + EXPERT_CHUNK_TOKENS], weights[i:i + EXPERT_CHUNK_TOKENS],
                                             experts[i:i + EXPERT_CHUNK_TOKENS], gate_up, activation, gate_up_bias,
                                             down_bias) for i in range(0, T, EXPERT_CHUNK_TOKENS)])
    E = gate_up.num_experts
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat.index_select(0, order)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    starts = ends - counts
    xs = x.index_select(0, order // k)
    if gate_up.quantized:
        y = _fused_groups(xs, gate_up, starts, ends, sorted_e, activation, gate_up_bias, down_bias)
    else:
        y = _dense_groups(xs, gate_up, sorted_e, starts, ends, T, activation, gate_up_bias, down_bias)
    # scale in float32 and round once, as expert_mix does; then each token's k outputs in expert order
    scaled = (y * weights.reshape(-1, 1).index_select(0, order)).to(x.dtype)
    by_token = scaled.index_select(0, torch.argsort(order)).view(T, k, -1)
    by_token = by_token.gather(1, experts.argsort(dim=1).unsqueeze(-1).expand(-1, -1, by_token.shape[-1]))
    out = by_token[:, 0]
    for j in range(1, k):
        out = out + by_token[:, j]
    return out


def _dense_groups(xs: torch.Tensor, table: GroupedExperts, sorted_e: torch.Tensor, starts: torch.Tensor,
                  ends: torch.Tensor, T: int, activation, gate_up_bias, down_bias) -> torch.Tensor:
    """The experts' outputs [P, h] for the sorted rows xs, group by group: grouped_mm or the padded bmm
    (T tokens: the padded bmm's rows per expert)."""
    grouped_mm = _use_grouped_mm(xs, table)
    y = None
    for g in table.groups:
        n = g.gate_up.shape[0]
        if n == 0:
            continue
        h = _group_linear(xs, g.gate_up, g.first, sorted_e, starts, ends, T, grouped_mm)
        if gate_up_bias is not None:
            h = h + gate_up_bias.index_select(0, sorted_e)
        h = _group_linear(activation(h), g.down, g.first, sorted_e, starts, ends, T, grouped_mm)
        if down_bias is not None:
            h = h + down_bias.index_select(0, sorted_e)
        inside = ((sorted_e >= g.first) & (sorted_e < g.first + n)).unsqueeze(1)
        y = h if y is None else torch.where(inside, h, y)
    return y


def _fused_groups(xs: torch.Tensor, table: GroupedExperts, starts: torch.Tensor, ends: torch.Tensor,
                  sorted_e: torch.Tensor, activation, gate_up_bias, down_bias) -> torch.Tensor:
    """The experts' outputs [P, h] for the sorted rows xs, quantized groups through the fused
    dequant-GEMM: each group writes its own experts' rows of one buffer (the groups cover every expert,
    so every row), gate_up then the activation (plain SwiGLU: in gate_up's epilogue) then down."""
    groups = [g for g in table.groups if g.gate_up.shape[0]]
    if not all(isinstance(g.gate_up, QuantizedStack) and isinstance(g.down, QuantizedStack) for g in groups):
        raise TypeError("a table mixes quantized and dense expert groups")
    tiles = [tile_map(starts, ends, g.first, g.gate_up.shape[0], xs.shape[0]) for g in groups]
    glu = activation is swiglu and gate_up_bias is None  # the kernel's epilogue applies it: one launch
    h = None
    for g, t in zip(groups, tiles, strict=True):
        h = fused_linear(xs, g.gate_up, g.first, starts, ends, h, t, glu)
    if gate_up_bias is not None:
        h = h + gate_up_bias.index_select(0, sorted_e)
    a, y = h if glu else activation(h), None
    for g, t in zip(groups, tiles, strict=True):
        y = fused_linear(a, g.down, g.first, starts, ends, y, t)
    if down_bias is not None:
        y = y + down_bias.index_select(0, sorted_e)
    return y
