"""Chooses the C++ kernels when they build, the batched torch path (varlen_attention.py) otherwise.

The extension is loaded (or, without a current install-time build, compiled) on the first
call, not at import, so importing moelight stays cheap. Set MOELIGHT_CPU_KERNELS=torch to
force the fallback.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable

import torch

from cpu_kernels import expert_pack
from cpu_kernels.expert_pack import FORMATS, Alloc, PackedExperts, QuantMatrix, torch_alloc
from cpu_kernels.expert_reference import ActSpec, expert_mix_torch
from cpu_kernels.expert_strips import pack_experts_native
from cpu_kernels.varlen_attention import SCORE_BUDGET, varlen_attention

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None, "warned": False}
_SUPPORTED_DIMS = (64, 80, 96, 128, 192, 256)  # 192: MLA's expanded prefill (128 + 64)
_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cpp_available() -> bool:
    """Builds/loads the extension once per process; warns exactly once when it cannot."""
    loaded = _state["loaded"]
    if loaded is not None:
        return bool(loaded)
    with _lock:
        if _state["loaded"] is None:
            ok, why = False, "disabled by MOELIGHT_CPU_KERNELS=torch"
            if os.environ.get("MOELIGHT_CPU_KERNELS", "").lower() != "torch":
                from cpu_kernels.build import load_kernels

                ok, why = load_kernels()
                if ok and torch.ops.moelight.kernel_isa() == "none":
                    ok, why = False, "CPU has neither AVX-512 nor AVX2"
            if not ok and not _state["warned"]:
                _state["warned"] = True
                warnings.warn(f"moelight C++ CPU kernels unavailable, using pure-torch attention ({why})",
                              RuntimeWarning, stacklevel=3)
            _state["loaded"] = ok
    return bool(_state["loaded"])


def kernel_backend() -> str:
    """'cpp-amx' / 'cpp-avx512bf16' / 'cpp-avx512' / 'cpp-avx2' when the C++ kernels run, 'torch' for the
    fallback ('amx': AVX512-BF16 attention, AMX-BF16 expert GEMMs)."""
    if _cpp_available():
        return f"cpp-{torch.ops.moelight.kernel_isa()}"
    return "torch"


def _cpp_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        _cpp_available()
        and q.device.type == "cpu"
        and k.device.type == "cpu"
        and k.dtype in _KV_DTYPES
        and v.dtype == k.dtype
        and q.shape[-1] in _SUPPORTED_DIMS
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    offsets: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, d] over the ragged cache [Hkv, T, d] -> [B, Hq, d] in q's dtype.

    `window`: attend to the last `window` keys only (a sliding-window layer), by narrowing each
    sequence's block, so the C++ kernels serve it unchanged. `sinks` [Hq] (GPT-OSS): a logit per
    query head added to every softmax's denominator.
    """
    if window is not None:
        skip = (lengths - window).clamp(min=0)
        offsets, lengths = offsets + skip, lengths - skip
    if _cpp_ok(q, k_cache, v_cache) and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride():
        return torch.ops.moelight.decode_attention(q, k_cache, v_cache, offsets, lengths, float(scale), sinks)
    return varlen_attention(q, k_cache, v_cache, lengths - 1, range(q.shape[0] + 1), scale, bases=offsets,
                            sinks=sinks)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    budget: int = SCORE_BUDGET,
) -> torch.Tensor:
    """Causal attention over packed prompts: q [T, Hq, d], k/v [T, Hkv, d] -> [T, Hq, d].
    `window`: each query sees itself and the window - 1 keys before it; `sinks` as in decode; `budget`:
    elements a torch group call may hold (a small device's share, hrm.attention_memory).
    V may be narrower than q and k (MLA's expanded prefill): it is zero-padded to their width, which
    keeps the kernels' (and torch's flash) equal-width path, and the output is cut back."""
    dv = v.shape[-1]
    if dv < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
        return prefill_attention(q, k, v, cu_seqlens, scale, window, sinks, budget)[..., :dv]
    if _cpp_ok(q, k, v) and v.shape[-1] == q.shape[-1]:
        return torch.ops.moelight.prefill_attention(q, k, v, cu_seqlens, float(scale), window or 0, sinks)
    return varlen_attention(q, k.transpose(0, 1), v.transpose(0, 1), [0] * (len(cu_seqlens) - 1), cu_seqlens, scale,
                            bases=cu_seqlens[:-1], window=window, sinks=sinks, budget=budget)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, d], one query per sequence over its `lengths[b]` keys in the pages of its block-table
    row (block_table [B, pages]) -> [B, Hq, d]. Windows and sinks take the torch path."""
    if window is None and sinks is None and _cpp_ok(q, k_cache, v_cache) and k_cache.stride(-1) == 1 \
            and k_cache.stride() == v_cache.stride():
        return torch.ops.moelight.paged_decode_attention(q, k_cache, v_cache, block_table, lengths, int(page_size),
                                                         float(scale))
    return varlen_attention(q, k_cache, v_cache, lengths - 1, range(q.shape[0] + 1), scale, block_table=block_table,
                            page_size=page_size, window=window, sinks=sinks)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    cu_seqlens: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new tokens of each sequence (q [T, Hq, d], rows cu_seqlens[b] .., at positions starts[b] ..,
    their K/V already in the cache) over a cached prefix and themselves, causal -> [T, Hq, dv]. V narrower
    than K (MLA's expanded prefix) is zero-padded for the kernel, as in prefill_attention."""
    dv = v_cache.shape[-1]
    if dv < k_cache.shape[-1] and _cpp_ok(q, k_cache, k_cache) and window is None and sinks is None:
        padded = torch.zeros_like(k_cache)  # K's strides (a transposed view stays one), so K is not copied
        padded[..., :dv] = v_cache
        return paged_prefill_attention(q, k_cache, padded, block_table, starts, cu_seqlens, page_size, scale)[..., :dv]
    if window is None and sinks is None and _cpp_ok(q, k_cache, v_cache) and k_cache.stride(-1) == 1 \
            and k_cache.stride() == v_cache.stride():
        return torch.ops.moelight.paged_prefill_attention(q, k_cache, v_cache, block_table, starts, cu_seqlens,
                                                          int(page_size), float(scale))
    return varlen_attention(q, k_cache, v_cache, starts, cu_seqlens, scale, block_table=block_table,
                            page_size=page_size, window=window, sinks=sinks)


# int8 / int4 experts multiply on int8 activations where the ISA has that path (AVX2: int4 at any row count, int8
# up to 16 rows; AVX512-VNNI: both at any row count; AMX: VNNI's, int8 and int4 up to 10 rows, the AMX-BF16
# tiles above): faster there (BENCHMARKS §16), at a relative error of the activation's 8-bit rounding.
# MOELIGHT_INT8_ACTIVATIONS=0 keeps the bf16 path's numbers (the GPU's and the torch fallback's).
INT8_ACTIVATIONS = os.environ.get("MOELIGHT_INT8_ACTIVATIONS", "1") != "0"


def expert_mix(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, packed: PackedExperts,
               act: ActSpec = ActSpec()) -> torch.Tensor:
    """All routed experts of a layer in one call: x [T, h], expert ids [T, k] and routing weights [T, k]
    -> sum over each token's experts of weight * down(act(gate_up(x))), [T, h] in x's dtype.
    Computes in bf16 with float32 accumulation whatever x's dtype (csrc/expert_mix.cpp); float32 engines run
    quantized experts dequantized on their float32 loop instead (moelight/runtime/cpu_linear.py)."""
    if not _cpp_available() or not x.is_cpu:
        return expert_mix_torch(x, ids, weights, packed, act)
    p = packed
    out = torch.ops.moelight.expert_mix(
        _as_op_takes(x, torch.bfloat16), _as_op_takes(ids, torch.int64), _as_op_takes(weights, torch.float32),
        p.w13, p.s13, p.z13, p.w2, p.s2, p.z2, p.bias13, p.bias2, FORMATS[p.fmt13], p.group13, FORMATS[p.fmt2],
        p.group2, act.kind, float(act.limit), float(act.alpha), INT8_ACTIVATIONS)
    return out if x.dtype is torch.bfloat16 else out.to(x.dtype)


def _as_op_takes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` itself where it is contiguous `dtype` already (the engine's case), else a converted copy. No
    conversion call that would return `t` anyway: at one row each such dispatcher call (.to, .contiguous,
    .float) cost the op ~10-20 us, its code and data cold after the previous layer's experts streamed
    through the caches (benchmarks/results/expert_int4_t1_amx.md)."""
    return t if t.dtype is dtype and t.is_contiguous() else t.to(dtype).contiguous()


def pack_experts(gate_up: QuantMatrix, down: QuantMatrix, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, alloc: Alloc = torch_alloc,
                 packed_through: Callable[[int], None] | None = None) -> PackedExperts:
    """A layer's experts in the kernel's strips (expert_pack.pack_experts' bytes): by the C++ packer
    (expert_strips.py, one pass, no full-size temporaries, expert by expert) where the kernels load, else by
    the torch reference. `packed_through(i)`: called once experts 0..i are packed (by the C++ packer only:
    packs_expert_by_expert says whether it will be)."""
    if packs_expert_by_expert():
        return pack_experts_native(gate_up, down, gate_up_bias, down_bias, alloc, packed_through)
    return expert_pack.pack_experts(gate_up, down, gate_up_bias, down_bias, alloc)


def packs_expert_by_expert() -> bool:
    """Whether pack_experts runs the C++ packer, which packs one expert at a time (and calls packed_through)."""
    return _cpp_available() and hasattr(torch.ops.moelight, "pack_code_strips")


SMALL_LINEAR_ROWS = 4  # csrc/small_linear.cpp's kSmallLinearRows


def small_linear_available() -> bool:
    """torch.ops.moelight.small_linear can run here: the kernels are built (the CPU has AVX2, checked once at load).
    No per-call ISA query (a router call asked the extension for its ISA every time): under set_isa("none") the
    op itself computes the same float32 sums through torch."""
    return _cpp_available()


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (at most SMALL_LINEAR_ROWS rows) times a bf16 weight [N, K], float32 sums plus bias
    rounded to x's dtype: one read of the bf16 weight (csrc/small_linear.cpp)."""
    if _cpp_available() and x.device.type == "cpu":  # (loaded only where the CPU has AVX2 or newer)
        return torch.ops.moelight.small_linear(x, weight, bias)
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def route_topk(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
               normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """models.moe.route's steps for a few bf16 rows in one op call (csrc/route.cpp): small_linear's logits, float32
    softmax, top-k, renormalised with `normalize`; the caller has checked that small_linear takes x."""
    return torch.ops.moelight.route_topk(x, gate_weight, int(top_k), bool(normalize))


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (descending) and indices [B, k] of each row of float32 x [B, V]; k = 1 is argmax with
    torch.argmax's rule for ties (the first index). One read of each row, rows in parallel."""
    if _cpp_available() and x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.ops.moelight.topk_rows(x.contiguous(), int(k))
    if k == 1:
        idx = torch.argmax(x, dim=-1, keepdim=True)
        return x.gather(1, idx), idx
    vals, idx = torch.topk(x, k, dim=-1)
    return vals, idx


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, d] * cos + rotate_half(x) * sin (cos / sin [T, d] in x's dtype, float32 or bf16), rounded as
    torch's three ops round it, in one pass (csrc/norm_rotary.cpp); None where the kernels do not run
    (the caller's torch ops then)."""
    if not (x.device.type == "cpu" and x.dim() == 3 and x.stride(2) == 1 and not x.requires_grad
            and cos.shape == sin.shape == (x.shape[0], x.shape[2]) and cos.dtype == sin.dtype == x.dtype
            and x.dtype in (torch.float32, torch.bfloat16) and _cpp_available()):
        return None
    return torch.ops.moelight.rotary(x, cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMSNorm of 16-bit x [..., n] with a weight in x's dtype, in one pass (its float32 mean
    summed in another order than torch's); None where the kernels do not run or x is not 16-bit."""
    if not (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.shape == x.shape[-1:] and not x.requires_grad and _cpp_available()):
        return None
    return torch.ops.moelight.rms_norm(x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, rms_norm(x + delta)) for 16-bit x, in one call (csrc/norm_rotary.cpp): the sum rounded as torch's
    add rounds it, the norm as rms_norm's; None where the kernels do not run (the caller's two steps then)."""
    if not (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and delta.dtype == x.dtype
            and delta.shape == x.shape and weight.dtype == x.dtype and weight.shape == x.shape[-1:]
            and not x.requires_grad and not delta.requires_grad and _cpp_available()):
        return None
    return torch.ops.moelight.add_rms_norm(x, delta, weight, float(eps))


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> bool:
    """cache[:, slots[t]] = k[t] (and v) for caches [H, S, d] and rows [T, H, d] in the cache's dtype, in one call
    (csrc/norm_rotary.cpp) instead of two index_copy_; False (nothing written) where the kernels do not run."""
    if not (k_cache.device.type == "cpu" and k.device.type == "cpu" and v.device.type == "cpu"
            and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and slots.dtype == torch.int64
            and k.dim() == 3 and k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1
            and v_cache.stride(2) == 1 and not torch.is_grad_enabled() and _cpp_available()):
        return False
    torch.ops.moelight.kv_write(k_cache, v_cache, k, v, slots)
    return True
