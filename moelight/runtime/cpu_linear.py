"""oneDNN pre-packed weights for CPU matmuls.

On this class of CPU, aten's float32 `F.linear` (MKL) runs small-M matmuls at a fraction
of peak, and decode is all small M (a few to a few hundred tokens per expert). oneDNN
with weights reordered once into its blocked layout reaches several times the FLOP/s in
float32 and about 1.5x in bfloat16. Packing replaces the
model's dense weights layer by layer, so peak memory grows by one layer at most.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from cpu_kernels import dispatch
from cpu_kernels.expert_pack import torch_alloc
from cpu_kernels.strip_linear import pack_linear_strips, strip_linear, strip_linear_available, strips_fit
from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.fused_experts import expert_alloc, fused_enabled, pack_moe
from moelight.runtime.fused_qkv import fuse_qkv
from moelight.runtime.host_memory import huge_copy, release_free_heap

_PACK_HINT = 64  # expected rows per matmul; oneDNN picks the blocking from it


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """float32 and bfloat16 on an x86 build of torch with oneDNN (float16 stays dense). Asked once per dtype: the
    memory check asks per input width of a model's matmuls, and each probe packs and multiplies a weight."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), _PACK_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 8, dtype=dtype), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, k] @ W^T (+ bias) with W pre-packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def upcast_bf16_linears() -> bool:
    """This CPU's oneDNN packs no bf16 weights (no AVX512-BF16) but float32 ones: its bf16 matmuls outside the
    routed experts run on bf16 strips (strip_linear) or packed float32 copies (linear_form), not on aten's
    unpacked bf16 GEMM, which runs at a fraction of either's rate (an LM head of 32k rows over 256 tokens:
    ~1.0 against ~0.13 s on two AVX2 cores)."""
    return not packing_supported(torch.bfloat16) and packing_supported(torch.float32)


def linear_form(dtype: torch.dtype, in_features: int) -> str:
    """How the CPU engine holds a packed matmul's weight: 'packed' (oneDNN's layout, in `dtype`); where oneDNN
    packs no bf16 (upcast_bf16_linears) 'strips' (the bf16 weight in the expert kernel's strips, strip_linear:
    half a float32 copy's bytes, 1.04-3.3x its speed up to 64 rows and 0.92-1.17x at 256, BENCHMARKS §16) where
    the kernels run it and the input width is whole strips, else 'float32' (oneDNN on a float32 copy); 'dense'
    where oneDNN packs neither (float16; nn.Linear as it is)."""
    if packing_supported(dtype):
        return "packed"
    if dtype != torch.bfloat16 or not upcast_bf16_linears():
        return "dense"
    return "strips" if strips_fit(in_features) and strip_linear_available() else "float32"


def plain_bf16_rows(form: str) -> int:
    """Rows up to which a packed bf16 linear of `form` (linear_form) runs small_linear on a plain copy of its bf16
    weight (0: it keeps none). On a CPU whose oneDNN packs no bf16, up to 4: at 4 rows small_linear runs
    1.15-1.4x the strips' speed, and a float32 copy moves twice the bytes. Where oneDNN packs bf16, one row: a
    decode row reads the plain weight 1.4-1.6x as fast as oneDNN's packed one at one row, and slower at four
    (BENCHMARKS §18)."""
    if not dispatch.small_linear_available() or form == "dense":
        return 0
    return 1 if form == "packed" else dispatch.SMALL_LINEAR_ROWS


def keeps_plain_weights(batch_size: int | None) -> bool:
    """Whether a job's packed bf16 linears keep their plain copy (plain_bf16_rows) beside the packed one: for
    jobs of up to SMALL_LINEAR_ROWS sequences a step (None: unknown, yes), whose steps it makes faster. A
    larger batch reaches one row only at its tail, and the copies would cost it memory it may not have
    (Qwen3-30B-A3B's attention and LM head: 2.27 GiB)."""
    return batch_size is None or batch_size <= dispatch.SMALL_LINEAR_ROWS


def extra_linear_bytes(dtype: torch.dtype, in_features: int, plain: bool = True) -> int:
    """Bytes a packed linear's weight holds a parameter beyond its value in `dtype` (planning.memory_check): a
    float32 copy's 2 more, and with `plain` the plain bf16 weight beside a bf16 layer that keeps one
    (plain_bf16_rows, keeps_plain_weights). Strips hold the bf16 values (the columns padded to a whole strip
    aside)."""
    if dtype != torch.bfloat16:
        return 0
    form = linear_form(dtype, in_features)
    return (2 if form == "float32" else 0) + (2 if plain and plain_bf16_rows(form) else 0)


def load_transient_per_param(dtype: torch.dtype, in_features: int, plain: bool = True) -> int:
    """Bytes a parameter of one packed linear adds to the load's peak while it is packed, beyond the loaded
    model's count (tests/test_memory_estimate.py measures them): a float32 copy is packed from a float32
    tensor (4) beside its bf16 source (2 more, unless that is the plain copy the layer keeps: `plain`); strips
    are written beside their source (2, or none where the source is the plain copy kept); oneDNN's packed
    weight beside its source (the dtype's bytes)."""
    form = linear_form(dtype, in_features)
    if form == "float32":
        return 4 if plain and plain_bf16_rows(form) else 6
    if form == "strips":
        return 0 if plain and plain_bf16_rows(form) else 2
    return torch.finfo(dtype).bits // 8 if form == "packed" else 0


def upcast_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """packed_linear over a float32 copy of a bf16 weight (linear_form 'float32'), rounded back to x's dtype."""
    return packed_linear(x.float(), packed, bias).to(x.dtype)


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear whose weight the CPU engine holds in `form` (linear_form): oneDNN's layout, a
    float32 copy of a bf16 weight in it (the input upcast, the output rounded back to the input's dtype), or
    bf16 strips. A bf16 layer keeps its plain weight too where small_linear reads it faster for a decode step's
    few rows (plain_bf16_rows; memory_check counts both). `consume`: the layer is being replaced, so its weight
    is dropped once the plain copy exists and packed from that copy: two copies alive at once, not three
    (Qwen3-30B-A3B's LM head: 0.58 GiB less at the load's peak). `plain` False: no plain copy (a large
    batch's job, keeps_plain_weights)."""

    def __init__(self, linear: nn.Linear, form: str = "packed", huge_pages: bool = True,
                 consume: bool = False, plain: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        self.form = form
        self.bias = None if b is None else (b.float() if form in ("float32", "strips") else b)
        self.plain_rows = plain_bf16_rows(form) if plain and w.dtype == torch.bfloat16 else 0
        plain = w.contiguous() if self.plain_rows else None  # streamed whole per decode step
        self.weight_bf16 = huge_copy(plain) if huge_pages else plain
        del plain
        if consume and self.weight_bf16 is not None and self.weight_bf16.data_ptr() != w.data_ptr():
            linear.weight.data = torch.empty(0, dtype=w.dtype)
            w = self.weight_bf16
        if form == "strips":
            self.packed = pack_linear_strips(w, expert_alloc if huge_pages else torch_alloc)
        else:
            self.packed = pack_weight(w.float() if form == "float32" else w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_bf16 is not None and x.numel() <= self.plain_rows * self.in_features:
            return dispatch.small_linear(x, self.weight_bf16, self.bias)
        if self.form == "strips":
            return strip_linear(x, self.packed, self.bias, self.out_features)
        return (upcast_packed_linear if self.form == "float32" else packed_linear)(x, self.packed, self.bias)


# routers stay dense: the MoE block's route() reads their weight, and an h -> 1 gate gains nothing from packing;
# MLA's kv_b_proj too: its absorbed decode reads the weight per head
_KEEP_DENSE = ("gate", "shared_expert_gate", "kv_b_proj")


def packed_linears(model: MoECausalLM):
    """(parent, name, linear) of every nn.Linear that pack_model packs: all but the routers and
    MLA's kv_b_proj, and the LM head unless it is the embedding's."""
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and name not in _KEEP_DENSE:
                    yield parent, name, child
    if not model.config.tie_word_embeddings:
        yield model, "lm_head", model.lm_head


HUGE_PAGE_ROWS_PER_EXPERT = 16


def weights_on_huge_pages(batch_size: int | None, top_k: int, num_experts: int) -> bool:
    """Whether the weights a decode step streams go on huge pages (host_memory) for a job whose decode steps
    take up to `batch_size` rows (None: unknown, yes). Below ~16 rows per expert a step streams its weights
    and 2 MiB pages make it faster; at the README job's 64 (bench-1b, batch 256) decode ran no faster on
    them, while on a VM whose host takes free memory back the fresh 2 MiB pages made loading ~1.7 s longer
    (benchmarks/results/huge_page_loading.md)."""
    return batch_size is None or batch_size * top_k <= HUGE_PAGE_ROWS_PER_EXPERT * num_experts


def pack_model(model: MoECausalLM, quantize: str = "none", group: int = 128, fused_experts: bool | None = None,
               huge_pages: bool = True, plain_weights: bool = True) -> bool:
    """Repack every large matmul weight of `model` in place; False if this torch/CPU cannot. Routed
    experts go to the fused kernel (runtime/fused_experts.py) in bf16, or quantized with `quantize`
    ('int8', 'int4' with `group`), or as loaded when they are quantized already; `fused_experts`
    False keeps dense experts on the per-expert oneDNN loop (None: fused_enabled decides). bf16 on a
    CPU whose oneDNN packs no bf16: the other matmuls run on bf16 strips or float32 copies (linear_form).
    `huge_pages`: the weights a decode step streams whole on 2 MiB pages (weights_on_huge_pages);
    `plain_weights`: bf16 linears keep a plain copy for few-row steps (keeps_plain_weights)."""
    alloc = expert_alloc if huge_pages else torch_alloc
    dtype = model.embed_tokens.weight.dtype
    if dtype != torch.bfloat16 and _has_quantized_experts(model):
        _expand_quantized_experts(model, dtype)
        quantize = "none"
    fused = fused_enabled(dtype, quantize) if fused_experts is None else fused_experts
    fused = fused or _has_quantized_experts(model)
    upcast = dtype == torch.bfloat16 and upcast_bf16_linears()
    if not packing_supported(dtype) and not upcast:
        if fused:
            for layer in model.layers:
                if hasattr(layer.mlp, "gate_up_proj"):
                    pack_moe(layer.mlp, quantize, group, alloc)
        return False
    for parent, name, child in list(packed_linears(model)):
        form = linear_form(dtype, child.in_features)
        setattr(parent, name, PackedLinear(child, form, huge_pages, consume=True, plain=plain_weights))
        # the list holds the replaced layer: drop its weight now, not after the loop (all of them at once)
        child.weight.data = torch.empty(0, dtype=child.weight.dtype)
        release_free_heap()  # and the heap hole it leaves, which glibc would keep resident (host_memory)
    for layer in model.layers:
        fuse_qkv(layer.self_attn, huge_pages)
        moe = layer.mlp
        if fused and hasattr(moe, "gate_up_proj"):
            pack_moe(moe, quantize, group, alloc)
        elif isinstance(getattr(moe, "gate_up_proj", None), torch.Tensor):
            cast = (lambda w: w.float()) if upcast else (lambda w: w)  # noqa: E731
            gate_up = [pack_weight(cast(w)) for w in moe.gate_up_proj.detach()]
            down = [pack_weight(cast(w)) for w in moe.down_proj.detach()]
            del moe.gate_up_proj, moe.down_proj
            moe.gate_up_proj, moe.down_proj = gate_up, down
            moe.linear = upcast_packed_linear if upcast else packed_linear
        release_free_heap()
    return True


def _expand_quantized_experts(model: MoECausalLM, dtype: torch.dtype) -> None:
    """float32 with quantized experts: a dense copy of their dequantized values, run by the float32 loop, so
    the CPU engine computes dequantize-then-matmul as the device paths do (the fused kernel computes in
    bf16, with int8 activations on VNNI / AVX2 hosts) and greedy float32 tokens are the same on every path."""
    from cpu_kernels.expert_pack import dequantize

    for layer in model.layers:
        moe = layer.mlp
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(moe, name, None)
            if hasattr(w, "matrix"):
                delattr(moe, name)
                setattr(moe, name, dequantize(w.matrix()).to(dtype))


def _has_quantized_experts(model: MoECausalLM) -> bool:
    return any(hasattr(getattr(layer.mlp, "gate_up_proj", None), "matrix") for layer in model.layers)
