"""The shape of multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): what a
`ModelConfig` carries beside the GQA fields when its layers attend through a latent."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatentAttention:
    """Keys and values come from a per-token latent of `kv_lora_rank` plus one RoPE key of
    `qk_rope_head_dim` shared by all heads; only those two are cached."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: a plain q projection (V2-Lite); else q_a_proj -> norm -> q_b_proj
    rope_interleave: bool = True  # RoPE rotates pairs (2i, 2i+1) (DeepSeek); False: halves (rotate_half)
    softmax_scale: float = 0.0  # qk_head_dim^-0.5 times YaRN's mscale(factor, mscale_all_dim)^2

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Elements one token keeps per layer: the latent, then the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim
