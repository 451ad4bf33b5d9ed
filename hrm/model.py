"""Model spec: the shape numbers HRM needs, from a Hugging Face config.json or a preset.

Only shapes, never weights; read straight from the config dict so hrm stays torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer (Mixtral / DBRX shape): GQA attention + top-k experts."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # one expert's FFN width
    num_layers: int
    num_experts: int
    top_k: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    max_position: int = 32768
    tie_word_embeddings: bool = False
    model_type: str = "mixtral"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    # ---- parameter counts (elements) ----
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attn_params_per_layer(self) -> int:
        """QKV + O projections, two RMSNorm weights and the router of one layer."""
        h = self.hidden_size
        return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 2 * h + h * self.num_experts

    def expert_params(self) -> int:
        """One expert: w1, w3 (h x f) and w2 (f x h)."""
        return 3 * self.hidden_size * self.intermediate_size

    def layer_expert_params(self) -> int:
        return self.num_experts * self.expert_params()

    def embedding_params(self) -> int:
        """Input embedding + lm_head (once if tied) + final norm."""
        n = self.vocab_size * self.hidden_size
        return (n if self.tie_word_embeddings else 2 * n) + self.hidden_size

    def non_expert_params(self) -> int:
        return self.num_layers * self.attn_params_per_layer() + self.embedding_params()

    def total_params(self) -> int:
        return self.non_expert_params() + self.num_layers * self.layer_expert_params()

    def to_dict(self) -> dict:
        return asdict(self)


def _need(cfg: dict, *keys: str):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise ValueError(f"config.json lacks {' / '.join(keys)}")


def model_from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict (model_type mixtral or dbrx)."""
    mtype = cfg.get("model_type", "mixtral")
    if mtype == "dbrx":
        attn = cfg.get("attn_config", {}) or {}
        ffn = cfg.get("ffn_config", {}) or {}
        h = int(_need(cfg, "d_model", "hidden_size"))
        heads = int(_need(cfg, "n_heads", "num_attention_heads"))
        return ModelSpec(
            name=name or cfg.get("_name_or_path") or "dbrx",
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=h,
            intermediate_size=int(_need(ffn, "ffn_hidden_size")),
            num_layers=int(_need(cfg, "n_layers", "num_hidden_layers")),
            num_experts=int(_need(ffn, "moe_num_experts")),
            top_k=int(_need(ffn, "moe_top_k")),
            num_heads=heads,
            num_kv_heads=int(attn.get("kv_n_heads", heads)),
            head_dim=h // heads,
            rope_theta=float(attn.get("rope_theta", 5e5)),
            max_position=int(cfg.get("max_seq_len", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            model_type="dbrx",
        )
    if mtype not in ("mixtral", "qwen2_moe", "moelight"):
        raise ValueError(f"unsupported model_type {mtype!r}; supported: mixtral, dbrx")
    h = int(_need(cfg, "hidden_size"))
    heads = int(_need(cfg, "num_attention_heads"))
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or mtype,
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=h,
        intermediate_size=int(_need(cfg, "intermediate_size")),
        num_layers=int(_need(cfg, "num_hidden_layers")),
        num_experts=int(_need(cfg, "num_local_experts", "num_experts")),
        top_k=int(_need(cfg, "num_experts_per_tok")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or h // heads),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
        max_position=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        model_type="mixtral",
    )


def load_model_dir(path: str | Path) -> ModelSpec:
    """Read DIR/config.json (or a config file path directly)."""
    p = Path(path).expanduser()
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json at {cfg_path}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    return model_from_hf_config(cfg, name=p.name if p.is_dir() else p.stem)
