"""Building blocks the architecture files share: norms, rotary, attention projections, SwiGLU
MLPs and the routed-experts block. Tokens are packed: activations are [T, hidden].

Each block computes what transformers' classes compute, in the same order, so float32 results
match them bit for bit in practice (see tests/test_model_families.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels import dispatch
from moelight.models.config import ModelConfig
from moelight.models.moe import expert_mix, route, swiglu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 and (fused := dispatch.rms_norm(x, self.weight, self.eps)) is not None:
            return fused  # 16-bit activations on the CPU: the same steps in one pass
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def residual(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm, one pass on the CPU for 16-bit activations
        (where forward is this class's: a subclass that norms otherwise keeps its own)."""
        if type(self).forward is RMSNorm.forward and (
                fused := dispatch.add_rms_norm(x, delta, self.weight, self.eps)) is not None:
            return fused
        x = x + delta
        return x, self(x)


class LayerNorm(nn.Module):
    """LayerNorm without bias (DBRX), in the activation dtype as torch's nn.LayerNorm runs it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


def add_and_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)): the norm's fused residual where it has one (RMSNorm.residual)."""
    if (residual := getattr(norm, "residual", None)) is not None:
        return residual(x, delta)
    x = x + delta
    return x, norm(x)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.hidden_size
    return LayerNorm(dim, cfg.rms_norm_eps) if cfg.norm == "layernorm" else RMSNorm(dim, cfg.rms_norm_eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; rotate-half convention of Mixtral/Llama checkpoints (on the CPU one pass of
    cpu_kernels, rounded as these three ops round)."""
    if (fused := dispatch.rotary(x, cos, sin)) is not None:
        return fused
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Projections of grouped-query attention; the softmax part lives in cpu_kernels."""

    fused_qkv = None  # a runtime's one matmul for q, k and v at a decode step's few rows (runtime/fused_qkv.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv, bias = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)

    def qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat projections [T, Hq*d], [T, Hkv*d], [T, Hkv*d]."""
        if self.fused_qkv is not None and (fused := self.fused_qkv(h)) is not None:
            return fused
        return self.q_proj(h), self.k_proj(h), self.v_proj(h)

    def heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        return (q.view(-1, self.n_heads, self.head_dim), k.view(-1, self.n_kv, self.head_dim),
                v.view(-1, self.n_kv, self.head_dim))


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP (Qwen's dense layers and shared expert): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Router plus E SwiGLU experts, stored packed: gate_up_proj [E, 2f, h], down_proj [E, h, f];
    with cfg.shared_expert_size, a shared SwiGLU expert scaled by a sigmoid gate (Qwen2-MoE)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.top_k, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size))
        self.linear = F.linear  # cpu_linear.pack_model swaps in pre-packed weights and their matmul
        # None, not absent: hasattr on an nn.Module raises and catches inside __getattr__ each layer
        shared = cfg.shared_expert_size
        self.shared_expert = SwiGLU(cfg.hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(x, self.gate_up_proj, self.down_proj, self.linear)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and expert ids [T, k] of x [T, h]."""
        return route(x, self.gate.weight, self.top_k, self.normalize)

    def expert_terms(self):
        """(activation, gate_up bias, down bias) of the routed experts, for a runtime that runs some elsewhere."""
        return swiglu, None, None

    def forward_with(self, x: torch.Tensor, gate_up_proj, down_proj, linear, routing=None,
                     compute_order=None, counts=None, ready=None) -> torch.Tensor:
        """The block over routed-expert weights a runtime supplies (a page table of device buffers),
        with the routing it already computed (`route`) if it needed it first (and its tokens per
        expert, if on the host), and the order it wants the experts computed in (the sum is the same)."""
        weights, experts = self.route(x) if routing is None else routing
        out = expert_mix(x, weights, experts, gate_up_proj, down_proj, linear, compute_order=compute_order,
                         counts=counts, ready=ready)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class DecoderLayerBase(nn.Module):
    """The split every family shares: pre-attention (norm, q/k/v, rotary) and post-attention
    (O projection and residual, norm, FFN and residual). A family file builds the submodules
    (input_layernorm, self_attn, post_attention_layernorm, mlp) and overrides what differs."""

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, h] -> q [T, Hq, d], k and v [T, Hkv, d], rotary applied to q and k."""
        a = self.self_attn
        q, k, v = a.heads(*a.qkv(self.input_layernorm(x)))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    # What the executors call, so one runtime serves GQA and latent attention (DeepSeek overrides these):
    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, decode: bool = False):
        """(q, cache entry): the query and what the KV cache keeps of each token, here (k, v)."""
        q, k, v = self.pre_attention(x, cos, sin)
        return q, (k, v)

    def prefill_kv(self, *entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's K and V for its causal attention, from its cache entries."""
        return entry  # type: ignore[return-value]

    def decode_output(self, attn: torch.Tensor) -> torch.Tensor:
        """Decode attention's output [T, ...] as the O projection takes it."""
        return attn

    @staticmethod
    def tp_reduce(partial: torch.Tensor) -> torch.Tensor:
        """Sum of a row-parallel output over tensor-parallel ranks (moelight/parallel swaps in an
        all-reduce); on one device the output is already whole."""
        return partial

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor, moe=None) -> torch.Tensor:
        """x [T, h] residual stream, attn [T, Hq*d] -> next layer's input [T, h].

        `moe` lets a runtime pass the FFN (e.g. over paged weights); default: this layer's.
        """
        x, h = add_and_norm(self.post_attention_layernorm, x, self.tp_reduce(self.self_attn.o_proj(attn)))
        return x + self.tp_reduce((moe or self.mlp)(h))
