"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): QKV biases, a shared expert behind a sigmoid
gate beside the routed ones, optional top-k renormalisation, and dense layers where
`mlp_only_layers` / `decoder_sparse_step` say so."""

from __future__ import annotations

from moelight.errors import ConfigError
from moelight.models.config import ModelConfig, check_act, eos_ids_of, require, rope_scaling_of, rope_theta_of
from moelight.models.layers import Attention, DecoderLayerBase, RMSNorm, SparseMoE, SwiGLU
from moelight.models.targets import Target, hf_style_targets


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(index) else SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size)


def tensor_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    return hf_style_targets(name, cfg)


def dense_layers(cfg: dict, n_layers: int) -> tuple[int, ...]:
    """Layers whose MLP is dense: listed in mlp_only_layers, or off the decoder_sparse_step grid."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(n_layers) if i in only or (i + 1) % step)


def qwen_config(cfg: dict, where: str, **family_fields) -> ModelConfig:
    """The fields Qwen2-MoE, Qwen3-MoE and OLMoE configs share."""
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # hub configs / transformers 5's name
    if experts is None:
        raise ConfigError(f"{where}: missing required field(s) num_experts")
    require(cfg, where, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok")
    check_act(cfg, where)
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window is set; sliding-window attention is not supported for "
                          f"{cfg.get('model_type')} yet")
    n_layers = int(cfg["num_hidden_layers"])
    dense = dense_layers(cfg, n_layers)
    expert_f = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if expert_f is None:
        raise ConfigError(f"{where}: missing required field(s) moe_intermediate_size")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(expert_f),
        num_layers=n_layers,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(cfg, 10000.0),
        rope_scaling=rope_scaling_of(cfg, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids_of(cfg, None),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=dense,
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0) if dense else 0,
        model_type=str(cfg["model_type"]),
        **family_fields,
    )


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    return qwen_config(cfg, where, qkv_bias=bool(cfg.get("qkv_bias", True)),
                      shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0))
