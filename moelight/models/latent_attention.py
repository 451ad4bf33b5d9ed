"""Multi-head latent attention's projections (DeepSeek-V2/V3): queries through a low-rank path or a
plain projection; keys and values from a normalised per-token latent plus one RoPE key that all heads
share. The cache keeps one row per token: [latent, RoPE key].

Two forms, the same attention: prefill expands per-head K and V from the latent (`expand`, what
transformers computes); decode folds W_UK into the query (`absorb`) so attention is an MQA over the
cached rows, and W_UV into the output (`unabsorb`) — the form vLLM and SGLang decode with, which reads
only the latent.
"""

from __future__ import annotations

import torch
from torch import nn

from moelight.models.config import ModelConfig
from moelight.models.layers import RMSNorm, apply_rotary

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out; the rotated
    evens come first, then the odds (transformers' apply_rotary_pos_emb_interleave). x [T, H, d]."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = self.spec = cfg.mla
        h, heads = cfg.hidden_size, cfg.num_heads
        self.n_heads = heads
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.cache_width, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, h, bias=cfg.o_bias)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed input h [T, hidden] -> q_nope [T, H, nope], rotated q_pe [T, H, rope] and the cache
        row [T, 1, kv_lora_rank + rope] (normalised latent, rotated RoPE key)."""
        m, t = self.spec, h.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))) if m.q_lora_rank else self.q_proj(h)
        q_nope, q_pe = q.view(t, self.n_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        rotate = rotate_pairs if m.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe, cos, sin), rotate(k_pe.view(t, 1, m.qk_rope_head_dim), cos, sin)
        return q_nope, q_pe, torch.cat((self.kv_a_layernorm(latent).view(t, 1, m.kv_lora_rank), k_pe), -1)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj per head: W_UK [H, nope, rank] and W_UV [H, v, rank] (views, no copies)."""
        m = self.spec
        w = self.kv_b_proj.weight.view(self.n_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def expand(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [T, 1, rank + rope] -> per-head K [T, H, nope + rope] and V [T, H, v]."""
        m, t = self.spec, row.shape[0]
        latent, k_pe = row[:, 0].split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_nope, v = self.kv_b_proj(latent).view(t, self.n_heads, -1).split([m.qk_nope_head_dim, m.v_head_dim], -1)
        return torch.cat((k_nope, k_pe[:, None, :].expand(t, self.n_heads, m.qk_rope_head_dim)), -1), v

    def absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """Decode's query over the cache rows: [q_nope W_UK, q_pe] per head, [T, H, rank + rope]."""
        w_uk, _ = self._up()
        return torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe), -1)

    def unabsorb(self, attn: torch.Tensor) -> torch.Tensor:
        """Attention over the latent [T, H * rank] -> per-head values [T, H * v] (W_UV applied)."""
        m = self.spec
        _, w_uv = self._up()
        o = attn.reshape(-1, self.n_heads, m.kv_lora_rank).transpose(0, 1)
        return torch.bmm(o, w_uv.transpose(1, 2)).transpose(0, 1).reshape(-1, self.n_heads * m.v_head_dim)
