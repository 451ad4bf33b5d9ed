"""OLMoE (OLMoE-1B-7B): 64 experts top-8 without renormalisation, RMSNorm over the whole q and k
projections (not per head) before rotary, optional clamping of q, k, v."""

from __future__ import annotations

import torch

from moelight.models.config import ModelConfig
from moelight.models.layers import Attention, DecoderLayerBase, RMSNorm, SparseMoE, apply_rotary
from moelight.models.qwen2_moe import qwen_config
from moelight.models.targets import Target, hf_style_targets


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.clip = cfg.clip_qkv
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.q_norm = RMSNorm(cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a = self.self_attn
        q, k, v = a.qkv(self.input_layernorm(x))
        q, k = a.q_norm(q), a.k_norm(k)  # over the whole projection
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = a.heads(q, k, v)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def tensor_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    return hf_style_targets(name, cfg)


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    clip = cfg.get("clip_qkv")
    return qwen_config(cfg, where, qkv_bias=bias, o_bias=bias, qk_norm="full",
                       clip_qkv=None if clip is None else float(clip))
