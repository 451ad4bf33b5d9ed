"""Model spec: the shape numbers HRM needs, from a Hugging Face config.json or a preset.

Only shapes, never weights; read straight from the config dict so hrm stays torch-free.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer: GQA attention + top-k routed experts, optionally a shared
    expert per sparse layer and some dense layers. Costs are those of the average layer."""

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
    shared_expert_size: int = 0  # a shared SwiGLU expert in every sparse layer (Qwen2-MoE); 0: none
    num_dense_layers: int = 0  # layers with a dense SwiGLU MLP instead of experts (Qwen mlp_only_layers)
    dense_intermediate_size: int = 0  # that MLP's width
    qkv_bias: bool = False  # biases on q/k/v (Qwen2-MoE)
    qk_norm: str = ""  # "head": RMSNorm weights per head_dim (Qwen3-MoE); "full": over q and k (OLMoE)
    o_bias: bool = False  # bias on the output projection (GPT-OSS)
    expert_bias: bool = False  # biases on the router and on every expert's matmuls (GPT-OSS)
    attention_sinks: bool = False  # one learned logit per query head (GPT-OSS)
    sliding_window: int = 0  # keys a sliding-window layer attends to
    num_sliding_layers: int = 0  # layers that attend through that window
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (DeepSeek has none)
    score_bias: bool = False  # a per-expert bias on the routing scores (DeepSeek-V3's e_score_correction_bias)
    expert_bits: float = 0.0  # bits per routed-expert weight held quantized (codes and scales); 0: the dtype's
    # bytes the CPU engine holds beyond these weights (float32 copies of bf16 matmuls where the CPU's oneDNN
    # packs no bf16); host memory, counted where the weights stay on the host
    host_weight_extra_bytes: float = 0.0
    expert_format: str = ""  # their kernel format ('int8', 'uint4', ...): the CPU kernel's rate for it, if measured
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; hrm/latent_attention.py), 0: GQA
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def latent(self) -> bool:
        """Attention through a cached latent (MLA) instead of per-head K and V."""
        return self.kv_lora_rank > 0

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
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        norms = {"": 0, "head": 2 * self.head_dim, "full": self.q_dim + self.kv_dim}[self.qk_norm]
        extra = ((h if self.o_bias else 0) + (self.num_heads if self.attention_sinks else 0)
                 + (self.num_experts if self.expert_bias else 0))
        if self.latent:
            return self.latent_attention_params() + 2 * h + h * self.num_experts + extra
        return (h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 2 * h + h * self.num_experts + bias + norms
                + extra)

    def latent_query_params(self) -> int:
        """MLA's query path: q_a_proj, its norm and q_b_proj (or one q_proj), h -> H (nope + rope)."""
        h, q, qk = self.hidden_size, self.q_lora_rank, self.qk_nope_head_dim + self.qk_rope_head_dim
        return h * q + q + q * self.num_heads * qk if q else h * self.num_heads * qk

    def latent_attention_params(self) -> int:
        """MLA's attention weights of one layer: the query path, kv_a_proj_with_mqa and its norm, kv_b_proj
        (per head: W_UK and W_UV), o_proj."""
        h, r, e = self.hidden_size, self.kv_lora_rank, self.qk_rope_head_dim
        heads, n, v = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        return self.latent_query_params() + h * (r + e) + r + r * heads * (n + v) + heads * v * h

    def expert_weight_bytes(self, b: float) -> float:
        """Bytes per routed-expert weight: the quantized format's, else the dtype's `b`."""
        return self.expert_bits / 8.0 if self.expert_bits else b

    def expert_params(self) -> int:
        """One expert: w1, w3 (h x f) and w2 (f x h), and their biases where the family has them."""
        h, f = self.hidden_size, self.intermediate_size
        return 3 * h * f + (2 * f + h if self.expert_bias else 0)

    def attended_context(self, context):
        """Keys the average layer's decode attention reads at `context` tokens: a sliding-window
        layer reads at most its window."""
        if not self.num_sliding_layers:
            return context
        share = self.num_sliding_layers / self.num_layers
        return (1.0 - share) * context + share * np.minimum(context, self.sliding_window)

    @property
    def sparse_fraction(self) -> float:
        """Share of the layers whose FFN is routed experts (the rest are dense MLPs)."""
        return (self.num_layers - self.num_dense_layers) / self.num_layers

    def layer_expert_params(self) -> int:
        """Routed-expert parameters of the average layer (dense layers have none): what a layer pages."""
        return round(self.sparse_fraction * self.num_experts * self.expert_params())

    def moe_layer_expert_params(self) -> int:
        """Routed-expert parameters of one MoE layer: what a buffer that holds a layer's experts holds."""
        return self.num_experts * self.expert_params()

    def shared_expert_params(self) -> int:
        """The shared expert of one sparse layer and its h -> 1 sigmoid gate (where it has one)."""
        if not self.shared_expert_size:
            return 0
        return 3 * self.hidden_size * self.shared_expert_size + (self.hidden_size if self.shared_expert_gate else 0)

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.dense_intermediate_size

    def embedding_params(self) -> int:
        """Input embedding + lm_head (once if tied) + final norm."""
        n = self.vocab_size * self.hidden_size
        return (n if self.tie_word_embeddings else 2 * n) + self.hidden_size

    def non_expert_params(self) -> int:
        """Everything but the routed experts: attention, norms, routers (a dense layer has none; DeepSeek-V3's
        carry a score bias), shared experts, dense MLPs."""
        sparse = self.num_layers - self.num_dense_layers
        return (self.num_layers * self.attn_params_per_layer() + sparse * self.shared_expert_params()
                + self.num_dense_layers * self.dense_mlp_params() + self.embedding_params()
                + self._router_difference())

    def _router_difference(self) -> int:
        """What attn_params_per_layer's one router per layer misses: none in the dense layers, V3's score bias."""
        sparse = self.num_layers - self.num_dense_layers
        return sparse * (self.num_experts if self.score_bias else 0) - self.num_dense_layers * (
            self.hidden_size * self.num_experts + (self.num_experts if self.expert_bias else 0))

    def active_params(self) -> int:
        """Parameters one token uses: everything but the routed experts, plus top_k of them per sparse layer."""
        sparse = self.num_layers - self.num_dense_layers
        return self.non_expert_params() + sparse * self.top_k * self.expert_params()

    def total_params(self) -> int:
        sparse = self.num_layers - self.num_dense_layers
        return self.non_expert_params() + sparse * self.num_experts * self.expert_params()

    def replicated_params(self) -> int:
        """What every tensor-parallel rank holds whole: embeddings and LM head, the norms, the routers
        (and their bias) and per-head q/k norm weights. The rest (attention projections, expert,
        shared-expert and dense-MLP widths) is split between the ranks."""
        h = self.hidden_size
        per_layer = 2 * h + h * self.num_experts + (self.num_experts if self.expert_bias else 0)
        per_layer += 2 * self.head_dim if self.qk_norm == "head" else 0
        if self.latent:  # every rank computes the whole latent (see moelight/parallel/__init__.py): the
            h, r, e, q = self.hidden_size, self.kv_lora_rank, self.qk_rope_head_dim, self.q_lora_rank
            per_layer += h * (r + e) + r + (h * q + q if q else 0)  # latent's and low-rank query's first halves
        return self.embedding_params() + self.num_layers * per_layer + self._router_difference()

    def tensor_parallel_problems(self, t: int) -> list[str]:
        """Every count a t-way tensor-parallel split must divide and t does not (empty: t works).
        Heads and KV heads are split, and each expert's intermediate width (Megatron: column-
        parallel gate/up, row-parallel down); the number of experts is not, so it need not divide."""
        counts = [("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                  ("expert intermediate size", self.intermediate_size)]
        if self.shared_expert_size:
            counts.append(("shared-expert intermediate size", self.shared_expert_size))
        if self.num_dense_layers:
            counts.append(("dense-MLP intermediate size", self.dense_intermediate_size))
        return [f"{what} {value}" for what, value in counts if value % t]

    def check_tensor_parallel(self, t: int) -> None:
        """ValueError naming what t does not divide, and the GPU counts (up to 8) that work."""
        bad = self.tensor_parallel_problems(t) if t > 1 else []
        if bad:
            ok = [d for d in range(1, 9) if not self.tensor_parallel_problems(d)]
            raise ValueError(f"tensor parallelism over {t} devices needs {t} to divide the model's "
                             f"{', '.join(bad)}; use --gpus with one of {', '.join(map(str, ok))}")

    def to_dict(self) -> dict:
        return asdict(self)


def _need(cfg: dict, *keys: str):
    for k in keys:
        if k in cfg and cfg[k] is not None:
            return cfg[k]
    raise ValueError(f"config.json lacks {' / '.join(keys)}")


def model_from_hf_config(cfg: dict, name: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a Hugging Face config dict (Mixtral, Qwen2/3-MoE, OLMoE, DBRX, or
    moelight's own `ModelConfig.to_hf_dict()`)."""
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
    if mtype in DEEPSEEK_TYPES:
        return _deepseek(cfg, name or cfg.get("_name_or_path") or mtype)
    if mtype not in HF_MOE_TYPES:
        raise ValueError(f"unsupported model_type {mtype!r}; supported: dbrx, {', '.join(HF_MOE_TYPES)}")
    h = int(_need(cfg, "hidden_size"))
    heads = int(_need(cfg, "num_attention_heads"))
    layers = int(_need(cfg, "num_hidden_layers"))
    dense = _dense_layers(cfg, layers)
    sliding = _sliding_layers(cfg, layers, mtype)
    routed_width = cfg.get("moe_intermediate_size") or _need(cfg, "intermediate_size")
    return ModelSpec(
        name=name or cfg.get("_name_or_path") or mtype,
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=h,
        intermediate_size=int(routed_width),
        num_layers=layers,
        num_experts=int(_need(cfg, "num_local_experts", "num_experts")),
        top_k=int(_need(cfg, "num_experts_per_tok")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or h // heads),
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e6))),
        max_position=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        model_type=mtype,
        shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        num_dense_layers=len(dense),
        dense_intermediate_size=int(cfg.get("intermediate_size") or 0) if dense else 0,
        qkv_bias=bool(cfg.get("qkv_bias", mtype == "qwen2_moe") or cfg.get("attention_bias", mtype == "gpt_oss")),
        qk_norm=cfg.get("qk_norm") or {"qwen3_moe": "head", "olmoe": "full"}.get(mtype, ""),
        o_bias=bool(cfg.get("o_bias", mtype == "gpt_oss" and cfg.get("attention_bias", True))),
        expert_bias=bool(cfg.get("expert_bias", mtype == "gpt_oss")),
        attention_sinks=bool(cfg.get("attention_sinks", mtype == "gpt_oss")),
        sliding_window=int(cfg.get("sliding_window") or 0) if sliding else 0,
        num_sliding_layers=len(sliding),
        shared_expert_gate=bool(cfg.get("shared_expert_gate", True)),
        score_bias=bool(cfg.get("score_bias", False)),
        **_latent_fields(cfg),
    )


HF_MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "moelight")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def _latent_fields(cfg: dict) -> dict:
    """MLA's shape where a config has it (DeepSeek's names; moelight's own dict uses them too)."""
    if not cfg.get("kv_lora_rank"):
        return {}
    return {k: int(cfg.get(k) or 0) for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim")}


def _deepseek(cfg: dict, name: str) -> ModelSpec:
    """A DeepSeek-V2/V3 (or Kimi-K2) config.json: routed and shared experts of moe_intermediate_size, the
    first `first_k_dense_replace` layers dense, MLA (no KV heads: every head reads the latent)."""
    heads, layers = int(_need(cfg, "num_attention_heads")), int(_need(cfg, "num_hidden_layers"))
    f = int(_need(cfg, "moe_intermediate_size"))
    dense = min(int(cfg.get("first_k_dense_replace") or 0), layers)
    shared = cfg.get("n_shared_experts", 1 if cfg.get("model_type") != "deepseek_v2" else 2) or 0
    return ModelSpec(
        name=name,
        vocab_size=int(_need(cfg, "vocab_size")),
        hidden_size=int(_need(cfg, "hidden_size")),
        intermediate_size=f,
        num_layers=layers,
        num_experts=int(_need(cfg, "n_routed_experts", "num_local_experts", "num_experts")),
        top_k=int(_need(cfg, "num_experts_per_tok")),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=int(_need(cfg, "qk_rope_head_dim")),
        rope_theta=float(cfg.get("rope_theta", 1e4)),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        model_type=str(cfg["model_type"]),
        shared_expert_size=int(shared) * f,
        num_dense_layers=dense,
        dense_intermediate_size=int(_need(cfg, "intermediate_size")) if dense else 0,
        o_bias=bool(cfg.get("attention_bias", False)),
        shared_expert_gate=False,
        score_bias=cfg.get("topk_method", "greedy" if cfg["model_type"] == "deepseek_v2" else "noaux_tc") == "noaux_tc",
        **_latent_fields({**cfg, "q_lora_rank": cfg.get("q_lora_rank", 1536)}),
    )


def _sliding_layers(cfg: dict, layers: int, mtype: str) -> list[int]:
    """Layers attending through a sliding window: layer_types where given (GPT-OSS alternates by default,
    Mixtral's window holds on every layer)."""
    if cfg.get("sliding_layers") is not None:
        return list(cfg["sliding_layers"])
    types = cfg.get("layer_types")
    if types is None and mtype == "gpt_oss":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if types is None and mtype == "mixtral":  # a Mixtral window (when not null) holds on every layer
        types = ["sliding_attention"] * layers
    if not cfg.get("sliding_window") or types is None:
        return []
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def _dense_layers(cfg: dict, layers: int) -> list[int]:
    """Qwen-style dense layers: listed in mlp_only_layers or off the decoder_sparse_step grid."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return [i for i in range(layers) if i in only or (i + 1) % step]


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
