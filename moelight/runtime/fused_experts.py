"""A layer's routed experts packed once for the fused CPU kernel (cpu_kernels.expert_mix).

`pack_model` (runtime/cpu_linear.py) swaps a MoE block's gate_up_proj / down_proj for one
`FusedExperts`; `models.moe.expert_mix` hands it the whole layer (no Python loop per expert).
bf16 models run it by default, float32 models keep the oneDNN loop (bit-exact against
transformers); quantized experts (`--quantize int8|int4`) run it in bf16, and in float32 are
dequantized at pack time onto the float32 loop (runtime/cpu_linear.py: the device paths' numbers).
MOELIGHT_EXPERTS=loop keeps bf16 on the loop (to measure one against the other).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from cpu_kernels import expert_mix, pack_experts
from cpu_kernels.expert_pack import Alloc, PackedExperts, QuantMatrix, bf16_matrix
from cpu_kernels.expert_quant import int4_group_for, quantize
from cpu_kernels.expert_reference import ActSpec
from moelight.runtime.expert_sources import ExpertSources, sole_expert_arrays
from moelight.runtime.host_memory import HUGE_PAGE, empty_huge

QUANTIZE_CHOICES = ("none", "int8", "int4")


class FusedExperts:
    """Packed experts of one layer, indexable as E experts (what page tables and `len` callers expect)."""

    def __init__(self, packed: PackedExperts, act: ActSpec) -> None:
        self.packed, self.act = packed, act

    def __len__(self) -> int:
        return self.packed.w13.shape[0]

    def fused_mix(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return expert_mix(x, experts, weights, self.packed, self.act)

    def nbytes(self) -> int:
        return self.packed.nbytes()


def fused_enabled(dtype: torch.dtype, quantize_method: str) -> bool:
    """Quantized experts always; bf16 unless MOELIGHT_EXPERTS=loop; float32 / float16 never."""
    if quantize_method != "none":
        return True
    return dtype == torch.bfloat16 and os.environ.get("MOELIGHT_EXPERTS", "fused").lower() != "loop"


def act_of(moe) -> ActSpec:
    """The MoE block's activation: GPT-OSS's clamped SwiGLU (it has `limit`) or SwiGLU."""
    limit = getattr(moe, "limit", 0.0)
    return ActSpec(1, float(limit), float(moe.alpha)) if limit else ActSpec()


def _matrix(w, method: str, group: int) -> QuantMatrix:
    if not isinstance(w, torch.Tensor):  # already quantized at load (models/quantized_experts.py)
        return w.matrix()
    return bf16_matrix(w.detach()) if method == "none" else quantize(w.detach(), method, group)


def expert_alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Where pack_moe puts the arrays the kernel keeps: on huge pages (host_memory.empty_huge), which a decode
    step at few rows streams whole, ~1.3-1.7x as fast as from 4 KiB pages on the AMX host. Arrays from a
    quarter of a huge page up get whole ones: a layer's int4 scales (bench-1b's 1.8 and 0.9 MB) are streamed
    beside its codes (4-8 points of read-bandwidth share at one row, benchmarks/results/expert_int4_t1_amx.md)."""
    return empty_huge(shape, dtype, min_bytes=HUGE_PAGE // 4)


def on_huge_pages(packed: PackedExperts) -> PackedExperts:
    """`packed` copied into expert_alloc's buffers, for benchmarks that compare the layouts (pack_moe packs
    straight into them)."""
    def moved(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else expert_alloc(tuple(t.shape), t.dtype).copy_(t)

    return dataclasses.replace(packed, **{name: moved(getattr(packed, name))
                                          for name in ("w13", "s13", "z13", "w2", "s2", "z2")})


def pack_moe(moe, method: str = "none", group: int = 128, alloc: Alloc = expert_alloc) -> FusedExperts:
    """Pack (and quantize with `method`) one MoE block's routed experts; frees the dense copies. The codes
    and scales are packed straight into `alloc`'s buffers (huge pages by default): no 4 KiB-page draft and
    no copy (README job: loading ~1.1 s shorter, benchmarks/results/huge_page_loading.md). Expert by expert,
    the loaded arrays' pages are handed back as they are packed where the model alone holds them
    (expert_sources.py): the load's peak is one expert, not one layer, above the weights it keeps."""
    arrays = sole_expert_arrays(moe)  # before this function takes references of its own
    release = ExpertSources(arrays) if arrays else None
    gate_up, down = moe.gate_up_proj, moe.down_proj
    if method == "int4" and isinstance(gate_up, torch.Tensor):
        group = int4_group_for(gate_up.shape[2], down.shape[2], preferred=group)
    bias = getattr(moe, "expert_bias", None)
    packed = pack_experts(_matrix(gate_up, method, group), _matrix(down, method, group),
                          None if bias is None else bias.gate_up.detach(),
                          None if bias is None else bias.down.detach(), alloc=alloc, packed_through=release)
    del arrays, release
    fused = FusedExperts(packed, act_of(moe))
    del moe.gate_up_proj, moe.down_proj
    moe.gate_up_proj = moe.down_proj = fused
    return fused
