"""How a run stores its routed experts when they are not in the run's dtype.

The fused CPU expert kernel (cpu_kernels/expert_mix) multiplies every `QuantMatrix` format directly:
int8 (a scale per output row), 4-bit codes (a scale and an additive term per row and group of K:
`--quantize int4`, GPTQ / AWQ zero points), FP8 e4m3 (block scales) and MXFP4 (a power-of-two scale
per 32 values). An `ExpertFormat` on the model's config makes the model hold its experts in that
format from the start (models/quantized_experts.py), so a model whose 16-bit experts would not fit
in memory loads straight into the smaller form.
"""

from __future__ import annotations

from dataclasses import dataclass

# format -> bits per code; the kernels' names (cpu_kernels/expert_pack.FORMATS)
CODE_BITS = {"int8": 8, "fp8": 8, "uint4": 4, "mxfp4": 4}


@dataclass(frozen=True)
class ExpertFormat:
    fmt: str  # 'int8' | 'fp8' | 'uint4' | 'mxfp4'
    group: int = 0  # K elements sharing a scale; 0: the whole row (per output channel)
    zero: bool = False  # an additive term per (row, group): uint4's -8 s, GPTQ / AWQ zero points
    origin: str = ""  # what chose it, for messages: 'checkpoint mxfp4', '--quantize int4'

    def __post_init__(self) -> None:
        if self.fmt not in CODE_BITS:
            raise ValueError(f"expert format {self.fmt!r}: one of {', '.join(CODE_BITS)}")

    def group_of(self, k: int) -> int:
        """The group size along a matrix's input width `k`."""
        return k if self.group == 0 else self.group

    def matrix_bytes(self, n: int, k: int) -> int:
        """Bytes of one [n, k] matrix in this format: codes, float32 scales (and additive terms)."""
        groups = -(-k // self.group_of(k))
        per_group = 4 * (2 if self.zero else 1)
        return n * (k * CODE_BITS[self.fmt] // 8 + groups * per_group)

    def held_in(self, mspec):
        """The HRM's model (hrm.ModelSpec) with its routed experts held in this format: the bytes they
        read, page and hold, and the CPU kernel's rate for the format."""
        from dataclasses import replace

        bits = self.expert_bits(mspec.hidden_size, mspec.intermediate_size)
        return replace(mspec, expert_bits=bits, expert_format=self.fmt)

    def expert_bits(self, hidden: int, intermediate: int) -> float:
        """Bits per weight of one expert (gate_up [2f, h] and down [h, f]), scales included: what the
        HRM counts for the bytes a layer's experts read, page and hold (hrm.ModelSpec.expert_bits)."""
        h, f = hidden, intermediate
        return 8.0 * (self.matrix_bytes(2 * f, h) + self.matrix_bytes(h, f)) / (3 * h * f)


def rank_widths(hidden: int, intermediate: int, ranks: int = 1) -> tuple[int, int]:
    """The input widths (K) of one tensor-parallel rank's gate_up and down projections: a group along K
    must fit them. Where N does not divide the expert width, the whole one (the TP check names that)."""
    return hidden, intermediate // ranks if intermediate % ranks == 0 else intermediate


def quantize_format(method: str, widths: tuple[int, ...], group: int = 128) -> ExpertFormat:
    """`--quantize int8` (a scale per output channel) or `int4` (the largest group <= `group` that divides
    every expert width, a scale and an offset per group); ValueError naming what does not fit."""
    from cpu_kernels.expert_quant import int4_group_for  # here: importing cpu_kernels loads its library

    if method == "int8":
        return ExpertFormat("int8", 0, origin="--quantize int8")
    if method != "int4":
        raise ValueError(f"--quantize {method!r}: none, int8 or int4")
    try:
        g = int4_group_for(*widths, preferred=group)
    except ValueError:
        raise ValueError(f"no int4 group of 32, 64 or 128 (at most {group}) divides the experts' input widths "
                         f"{widths} (hidden size, expert width per rank): int4 needs multiples of 32; "
                         "--quantize int8 has no such limit") from None
    return ExpertFormat("uint4", g, zero=True, origin=f"--quantize int4 (group {g})")


@dataclass(frozen=True)
class IntScheme:
    """A GPTQ / AWQ / compressed-tensors checkpoint's weight quantization (loading/int_checkpoints.py)."""

    method: str  # 'gptq' | 'awq' | 'compressed-tensors' | 'fp8'
    layout: str  # 'gptq' | 'awq' | 'pack-quantized' | 'float-quantized' | 'fp8-block'
    bits: int  # 4 or 8
    group: int  # input columns per scale; -1: the whole row
    sym: bool = True
    act_order: bool = False  # groups named per column by g_idx
    zeros_minus_one: bool = False  # GPTQ's original checkpoint format stores each zero point less one
    block: tuple[int, ...] = ()  # FP8 block scales [rows, columns]
