"""Mixtral (8x7B, 8x22B): RMSNorm, GQA with rotary, 8 SwiGLU experts top-2 renormalised."""

from __future__ import annotations

from moelight.errors import ConfigError
from moelight.models.config import ModelConfig, check_act, eos_ids_of, require, rope_scaling_of, rope_theta_of
from moelight.models.layers import Attention, DecoderLayerBase, RMSNorm, SparseMoE
from moelight.models.targets import Target, hf_style_targets


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    missing = [k for k in ("num_local_experts", "num_experts_per_tok") if cfg.get(k) is None]
    if missing:
        raise ConfigError(
            f"{where}: no MoE fields ({', '.join(missing)} missing); this is not a Mixture-of-Experts "
            "config. moelight needs num_local_experts and num_experts_per_tok"
        )
    require(cfg, where, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    check_act(cfg, where)
    window = int(cfg.get("sliding_window") or 0)  # Mixtral's own checkpoints say null; a derivative may set it
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        num_experts=int(cfg["num_local_experts"]),
        top_k=int(cfg["num_experts_per_tok"]),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta_of(cfg, 1e6),
        rope_scaling=rope_scaling_of(cfg, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id", 1),
        eos_token_ids=eos_ids_of(cfg),
        sliding_window=window,
        sliding_layers=tuple(range(int(cfg["num_hidden_layers"]))) if window else (),
    )


def tensor_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    """HF names (either expert layout: per-expert w1/w3/w2 or packed gate_up_proj/down_proj)."""
    return hf_style_targets(name, cfg)
