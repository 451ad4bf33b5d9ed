"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): many small experts (128, top-8), RMSNorm on each
head of q and k before rotary, no QKV bias, no shared expert."""

from __future__ import annotations

import torch

from moelight.models.config import ModelConfig
from moelight.models.layers import Attention, DecoderLayerBase, RMSNorm, SparseMoE, SwiGLU, apply_rotary
from moelight.models.qwen2_moe import qwen_config
from moelight.models.targets import Target, hf_style_targets


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.self_attn.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(index) else SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a = self.self_attn
        q, k, v = a.heads(*a.qkv(self.input_layernorm(x)))
        q, k = a.q_norm(q), a.k_norm(k)  # per head, over head_dim
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def tensor_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    return hf_style_targets(name, cfg)


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias", False))
    return qwen_config(cfg, where, qkv_bias=bias, o_bias=bias, qk_norm="head")
