"""Model configuration: the Mixtral-family hyper-parameters the engine needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moelight.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("mixtral",)
_MOE_FIELDS = ("num_local_experts", "num_experts_per_tok")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int
    top_k: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))
    model_type: str = "mixtral"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) must be in 1..{self.num_experts}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    def to_hf_dict(self) -> dict:
        """The Hugging Face config.json a checkpoint of this shape would carry."""
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
            "sliding_window": None,
        }


def config_from_hf_dict(cfg: dict, where: str = "config.json") -> ModelConfig:
    """Read a Hugging Face Mixtral config dict, with errors that name the file."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; moelight runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} models (Mixture-of-Experts, Mixtral layout)"
        )
    missing = [k for k in _MOE_FIELDS if k not in cfg]
    if missing:
        raise ConfigError(
            f"{where}: no MoE fields ({', '.join(missing)} missing); this is not a Mixture-of-Experts "
            "config. moelight needs num_local_experts and num_experts_per_tok"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    absent = [k for k in required if k not in cfg]
    if absent:
        raise ConfigError(f"{where}: missing required field(s) {', '.join(absent)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (Mixtral experts use 'silu')")
    rope = cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default" or cfg.get("rope_scaling"):
        raise ConfigError(f"{where}: rope scaling ({rope_type or cfg.get('rope_scaling')}) is not supported")
    rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 1e6))
    eos = cfg.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
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
        rope_theta=float(rope_theta),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id", 1),
        eos_token_ids=eos_ids,
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; --model takes a Hugging Face model folder or a preset name")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
    return config_from_hf_dict(cfg, where=str(path))
