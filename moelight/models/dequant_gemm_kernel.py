"""The Triton kernel of the fused dequant-GEMM (models/fused_dequant.py launches it).

One program computes a [BLOCK_M, BLOCK_N] tile of y = x_e @ W_e^T for the rows of one expert e, where
W_e is held quantized: codes, a float32 scale per (row, group of K) and optionally an additive term,
w = value(code) * scale + offset. Each K tile of the weight is expanded in registers into the
activations' dtype (the same rounding as the expand path, runtime/expert_stacks.dequantize_stacks)
and fed to `tl.dot` with float32 accumulation; no dense copy of the weights exists anywhere.

Rows are the expert-sorted token rows of grouped_experts.py; `tile_expert` / `tile_row` / `tile_end`
(built on the device, no host sync) say which expert, first row and end row each M tile covers
(expert -1: a spare tile of the grid's upper bound, which exits at once). With GLU the matrix is a
gate_up [2N, K] and the epilogue writes silu(gate) * up [.., N]: one launch, no [rows, 2N] output.

This module imports triton: import it only where triton is installed (fused_dequant.py does so
lazily). `kernel(interpret)` gives the compiled kernel for CUDA tensors, or Triton's interpreter
(numpy, on CPU tensors) for the emulated device and the tests.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

FMT_INT8, FMT_UINT4, FMT_FP8, FMT_MXFP4 = 0, 1, 2, 3  # value(code): int8 as is, 4-bit as is, via the LUT


def _dequant_gemm(x_ptr, codes_ptr, scales_ptr, offsets_ptr, lut_ptr, out_ptr,
                  tile_expert_ptr, tile_row_ptr, tile_end_ptr,
                  N, K, group, stride_xm, stride_om, stride_ce, stride_cn, stride_se, stride_sn,
                  FMT: tl.constexpr, HAS_OFFSETS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                  GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + t)
    if e >= 0:
        row0 = tl.load(tile_row_ptr + t)
        row_end = tl.load(tile_end_ptr + t)
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        j = tl.arange(0, BLOCK_W)
        if GLU:  # output column c needs weight rows c (gate) and N + c (up): tile column 2c and 2c + 1
            cols = pid_n * BLOCK_N + j // 2
            wrows = cols + (j % 2) * N
        else:
            cols = pid_n * BLOCK_N + j
            wrows = cols
        cmask = cols < N
        e64 = e.to(tl.int64)
        code_cols = codes_ptr + e64 * stride_ce + wrows.to(tl.int64) * stride_cn  # [BLOCK_W]
        scale_cols = e64 * stride_se + wrows.to(tl.int64) * stride_sn
        x_rows = x_ptr + rows.to(tl.int64) * stride_xm
        acc = tl.full((BLOCK_M, BLOCK_W), 0.0, tl.float32)  # (tl.zeros is a jit function: not in the interpreter)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            a = tl.load(x_rows[:, None] + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & cmask[None, :]
            if FMT == 1 or FMT == 3:  # two 4-bit codes a byte, element k in the low nibble when k is even
                byte = tl.load(code_cols[None, :] + (ks // 2)[:, None], mask=wmask, other=0).to(tl.int32)
                code = (byte >> ((ks % 2) * 4)[:, None]) & 0xF
            else:
                code = tl.load(code_cols[None, :] + ks[:, None], mask=wmask, other=0).to(tl.int32)
            if FMT == 2 or FMT == 3:  # fp8 e4m3 / e2m1: the value of every code from a small table
                v = tl.load(lut_ptr + (code & 0xFF))
            else:
                v = code.to(tl.float32)
            g = k0 // group  # the tile lies in one group (group % BLOCK_K == 0, or one group a row)
            w = v * tl.load(scales_ptr + scale_cols + g, mask=cmask, other=0.0)[None, :]
            if HAS_OFFSETS:
                w = w + tl.load(offsets_ptr + scale_cols + g, mask=cmask, other=0.0)[None, :]
            w = w.to(x_ptr.dtype.element_ty)  # the weight as the expand path rounds it
            if UPCAST:  # the interpreter's bf16 tl.dot returns garbage (triton 3.9): products in float32 instead
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        dtype = out_ptr.dtype.element_ty
        if GLU:  # silu(gate) * up, each step rounded to the run's dtype as the unfused ops round it
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            gate = gate.to(dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            y = act * up.to(dtype).to(tl.float32)
            ocols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + ocols[None, :]
            tl.store(out, y.to(dtype), mask=rmask[:, None] & (ocols < N)[None, :])
        else:
            out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out, acc.to(dtype), mask=rmask[:, None] & cmask[None, :])


@functools.cache
def kernel(interpret: bool):
    """The launchable kernel: compiled by Triton for CUDA tensors, or run by its interpreter on CPU tensors."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(_dequant_gemm)
    return triton.jit(_dequant_gemm)
