"""The Mixtral architecture, written to be read in one screen per block.

Tokens are packed: activations are [T, hidden] for T tokens of many sequences, with no
padding. A decoder layer is split where CGOPipe splits it: `pre_attention` (norm, QKV
projection, rotary) and `post_attention` (O projection, residual, norm, router, MoE FFN);
the attention itself runs outside the layer, next to the KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moelight.config import ModelConfig
from moelight.moe import moe_ffn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, head_dim] for the given absolute positions (computed in float32, as HF does)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d]; rotate-half convention of Mixtral/Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Projections of grouped-query attention; the softmax part lives in cpu_kernels."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)


class SparseMoE(nn.Module):
    """Router plus E SwiGLU experts, stored packed: gate_up_proj [E, 2f, h], down_proj [E, h, f]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size))
        self.linear = F.linear  # cpu_linear.pack_model swaps in pre-packed weights and their matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_ffn(x, self.gate.weight, self.gate_up_proj, self.down_proj, self.top_k, self.linear)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, h] -> q [T, Hq, d], k and v [T, Hkv, d], rotary applied to q and k."""
        a = self.self_attn
        h = self.input_layernorm(x)
        q = a.q_proj(h).view(-1, a.n_heads, a.head_dim)
        k = a.k_proj(h).view(-1, a.n_kv, a.head_dim)
        v = a.v_proj(h).view(-1, a.n_kv, a.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def post_attention(self, x: torch.Tensor, attn: torch.Tensor, moe=None) -> torch.Tensor:
        """x [T, h] residual stream, attn [T, Hq*d] -> next layer's input [T, h].

        `moe` lets a runtime pass the FFN (e.g. over paged weights); default: this layer's.
        """
        x = x + self.self_attn.o_proj(attn)
        h = self.post_attention_layernorm(x)
        return x + (moe or self.mlp)(h)


class MixtralModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype):
        return rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head, in float32 for sampling."""
        return self.lm_head(self.norm(x)).float()
