"""oneDNN pre-packed weights for CPU matmuls.

On this class of CPU, aten's float32 `F.linear` (MKL) runs small-M matmuls at a fraction
of peak, and decode is all small M (a few to a few hundred tokens per expert). oneDNN
with weights reordered once into its blocked layout reaches several times the FLOP/s in
float32 and about 1.5x in bfloat16 (benchmarks/bench_linear.py). Packing replaces the
model's dense weights layer by layer, so peak memory grows by one layer at most.
"""

from __future__ import annotations

import torch
from torch import nn

from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.fused_experts import fused_enabled, pack_moe

_PACK_HINT = 64  # expected rows per matmul; oneDNN picks the blocking from it


def packing_supported(dtype: torch.dtype) -> bool:
    """float32 and bfloat16 on an x86 build of torch with oneDNN (float16 stays dense)."""
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


class PackedLinear(nn.Module):
    """Drop-in for an nn.Linear whose weight lives in oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


# routers stay dense: the MoE block's route() reads their weight, and an h -> 1 gate gains nothing from packing;
# MLA's kv_b_proj too: its absorbed decode reads the weight per head
_KEEP_DENSE = ("gate", "shared_expert_gate", "kv_b_proj")


def pack_model(model: MoECausalLM, quantize: str = "none", group: int = 128, fused_experts: bool | None = None) -> bool:
    """Repack every large matmul weight of `model` in place; False if this torch/CPU cannot. Routed
    experts go to the fused kernel (runtime/fused_experts.py) in bf16, or quantized with `quantize`
    ('int8', 'int4' with `group`), or as loaded when they are quantized already; `fused_experts`
    False keeps dense experts on the per-expert oneDNN loop (None: fused_enabled decides)."""
    dtype = model.embed_tokens.weight.dtype
    fused = fused_enabled(dtype, quantize) if fused_experts is None else fused_experts
    fused = fused or _has_quantized_experts(model)
    if not packing_supported(dtype):
        if fused:
            for layer in model.layers:
                if hasattr(layer.mlp, "gate_up_proj"):
                    pack_moe(layer.mlp, quantize, group)
        return False
    for layer in model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and name not in _KEEP_DENSE:
                    setattr(parent, name, PackedLinear(child))
        moe = layer.mlp
        if fused and hasattr(moe, "gate_up_proj"):
            pack_moe(moe, quantize, group)
        elif isinstance(getattr(moe, "gate_up_proj", None), torch.Tensor):
            gate_up = [pack_weight(w) for w in moe.gate_up_proj.detach()]
            down = [pack_weight(w) for w in moe.down_proj.detach()]
            del moe.gate_up_proj, moe.down_proj
            moe.gate_up_proj, moe.down_proj, moe.linear = gate_up, down, packed_linear
    if not model.config.tie_word_embeddings:
        model.lm_head = PackedLinear(model.lm_head)
    return True


def _has_quantized_experts(model: MoECausalLM) -> bool:
    return any(hasattr(getattr(layer.mlp, "gate_up_proj", None), "matrix") for layer in model.layers)
