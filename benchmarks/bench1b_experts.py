"""bench-1b's routed experts as the CPU engine holds them, for the one-process A/B scripts
(ab_weight_pages.py, ab_expert_t1_ceiling.py, ab_expert_quant_cold.py): 8 experts a layer, hidden 1024,
width 3584, two routed per token, packed (and quantized) as pack_moe does, on huge pages unless asked."""

from __future__ import annotations

import dataclasses
import time

import torch

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import PackedExperts, bf16_matrix, pack_experts
from cpu_kernels.expert_quant import quantize
from moelight.runtime.fused_experts import on_huge_pages

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 8, 8, 1024, 3584, 2


def dense_layer(inter: int = INTER) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's random gate_up [E, 2F, H] and down [E, H, F] in bf16."""
    gu = torch.randn(EXPERTS, 2 * inter, HIDDEN, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(EXPERTS, HIDDEN, inter, dtype=torch.bfloat16) * 0.02
    return gu, dn


def pack_layer(gate_up: torch.Tensor, down: torch.Tensor, fmt: str, huge: bool = True) -> PackedExperts:
    """The layer packed in `fmt` (bf16, int8, int4 with groups of 128); a copy on huge pages when `huge`."""
    mats = (bf16_matrix(gate_up), bf16_matrix(down)) if fmt == "bf16" else (quantize(gate_up, fmt, 128),
                                                                             quantize(down, fmt, 128))
    packed = pack_experts(*mats)
    return huge_pages_copy(packed) if huge else packed


def quantized_layers(formats: tuple[str, ...] = ("int4", "int8")) -> dict[str, list[PackedExperts]]:
    """LAYERS random layers packed in each of `formats` (the same dense weights for all), on huge pages."""
    layers: dict[str, list[PackedExperts]] = {f: [] for f in formats}
    for _ in range(LAYERS):
        gu, dn = dense_layer()
        for f, packs in layers.items():
            packs.append(pack_layer(gu, dn, f))
    return layers


def timed_pass(big: torch.Tensor, layers: list[PackedExperts], routes: list[torch.Tensor], x: torch.Tensor,
               w: torch.Tensor) -> tuple[float, float]:
    """(read bandwidth of `big` in B/s, seconds of one cold decode step: each layer's experts on its route),
    the read just before the step, so both see the host's same state."""
    t0 = time.perf_counter()
    torch.ops.moelight.stream_read(big)
    bw = big.numel() * big.element_size() / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for p, r in zip(layers, routes, strict=True):
        dispatch.expert_mix(x, r, w, p)
    return bw, time.perf_counter() - t0


def huge_pages_copy(packed: PackedExperts) -> PackedExperts:
    """The same packed experts copied onto huge pages (on_huge_pages), `packed` left as it is."""
    return on_huge_pages(dataclasses.replace(packed))


def random_routes(tokens: int, count: int) -> list[torch.Tensor]:
    """`count` routings of `tokens` tokens, each to TOP_K distinct experts ([tokens, TOP_K] int64)."""
    return [torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)]) for _ in range(count)]
