"""Model configuration: the hyper-parameters the engine needs, for every supported family.

`ModelConfig` is family-neutral: the fields beyond Mixtral's (norm type, QKV bias, q/k norms,
shared experts, dense layers, ...) default to Mixtral's values. Each family file in
`moelight/models/` reads its Hugging Face config.json into one (`config_from_hf`, through
`moelight/loading/hf_config.py`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from moelight.errors import ConfigError
from moelight.models.context_length import context_length, context_origin
from moelight.models.expert_format import ExpertFormat, IntScheme
from moelight.models.grouped_routing import GroupRouting
from moelight.models.mla_config import LatentAttention


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
    norm: str = "rms"  # "rms" or "layernorm" (no bias; DBRX)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE)
    o_bias: bool = False  # bias on the output projection
    qk_norm: str = ""  # "" none, "head" RMSNorm per head (Qwen3-MoE), "full" over the projection (OLMoE)
    clip_qkv: float | None = None  # clamp q, k, v to +-clip (DBRX, OLMoE)
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum 1
    shared_expert_size: int = 0  # a shared SwiGLU expert with a sigmoid gate (Qwen2-MoE), 0: none
    dense_layers: tuple[int, ...] = ()  # layers with a dense SwiGLU MLP instead of experts
    dense_intermediate_size: int = 0  # that MLP's width
    rope_scaling: tuple = ()  # sorted (key, value) items of rope_parameters with its rope_type (rope.py); (): plain
    sliding_window: int = 0  # keys a sliding-window layer attends to (the query's own included)
    sliding_layers: tuple[int, ...] = ()  # layers that attend through that window
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (GPT-OSS)
    swiglu_limit: float = 0.0  # clamp of GPT-OSS's SwiGLU (gate <= limit, |up| <= limit); 0: plain SwiGLU
    swiglu_alpha: float = 1.702  # GPT-OSS's gate * sigmoid(alpha * gate)
    mla: LatentAttention | None = None  # multi-head latent attention (DeepSeek); None: GQA
    group_routing: GroupRouting | None = None  # DeepSeek's grouped router; None: softmax top-k (route())
    fp8_block: tuple[int, ...] = ()  # FP8 checkpoints: the weights' scale block, dequantised at load
    ignored_layers: int = 0  # checkpoint layers after the last that are not run (DeepSeek's MTP head)
    checkpoint_quant: str = ""  # the checkpoint's quant_method ('mxfp4', 'fp8', 'gptq', 'awq', ...); '': 16-bit
    checkpoint_scheme: IntScheme | None = None  # GPTQ / AWQ / compressed-tensors: how its weights are packed
    float_modules: tuple[str, ...] = ()  # quantization_config's modules_to_not_convert / ignore: kept in float
    float_expert: str = ""  # a routed-expert tensor the checkpoint stores in float ('': none, or not looked at)
    quantized_expert: str = ""  # a routed-expert tensor it stores quantized ('': none, or not looked at)
    expert_format: ExpertFormat | None = None  # the run holds the routed experts in this format (expert_format.py)

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
        d["dense_layers"] = list(self.dense_layers)
        d["sliding_layers"] = list(self.sliding_layers)
        d["rope_scaling"] = dict(self.rope_scaling)
        d["fp8_block"] = list(self.fp8_block)
        return d

    @property
    def context_length(self) -> int:
        """Prompt and answer together take at most this many positions: max_position_embeddings
        stretched by a linear or YaRN scaling, as vLLM derives max_model_len (context_length.py)."""
        return context_length(self.max_position_embeddings, self.rope_scaling)

    @property
    def context_origin(self) -> str:
        """How config.json gives `context_length`, for the errors that name it."""
        key = "max_seq_len" if self.model_type == "dbrx" else "max_position_embeddings"
        return context_origin(self.max_position_embeddings, self.rope_scaling, key)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q . k."""
        return self.mla.softmax_scale if self.mla else self.head_dim**-0.5

    @property
    def kv_elements_per_token(self) -> int:
        """What the KV cache keeps of one token in one layer: K and V of every KV head, or MLA's latent
        and RoPE key."""
        return self.mla.cache_width if self.mla else 2 * self.num_kv_heads * self.head_dim

    def decode_widths(self) -> tuple[int, int, int]:
        """Elements per token of decode's query, cache entry and attention output: what crosses between
        a device and CPU attention (MLA: the absorbed query over the latent rows, attention in latent space)."""
        if self.mla:
            m = self.mla
            return self.num_heads * m.cache_width, m.cache_width, self.num_heads * m.kv_lora_rank
        q = self.num_heads * self.head_dim
        return q, 2 * self.num_kv_heads * self.head_dim, q

    def listed_float(self, name: str) -> bool:
        """Whether quantization_config keeps module (or tensor) `name` in float: a `re:` pattern matched
        from the start of the name (compressed-tensors' `ignore`), else a run of whole dotted parts of it
        (modules_to_not_convert's 'lm_head', 'block_sparse_moe')."""
        for key in self.float_modules:
            if key.startswith("re:"):
                if re.match(key[3:], name):
                    return True
            elif f".{key}." in f".{name}.":
                return True
        return False

    @property
    def experts_all_float(self) -> bool:
        """A quantized checkpoint whose routed experts are all stored in float (plain 16-bit experts)."""
        return bool(self.float_expert) and not self.quantized_expert

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        return self.sliding_window if layer in self.sliding_layers else None

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
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
            (self.eos_token_ids[0] if self.eos_token_ids else None),  # a config may name none (the tokenizer may)
            "hidden_act": "silu",
            "sliding_window": self.sliding_window or None,
        } | self._family_fields()

    def _family_fields(self) -> dict:
        """What the Mixtral dict cannot say (for the HRM's model spec), in Qwen's config names."""
        if self.model_type == "mixtral":
            return {}
        return {"model_type": "moelight", "moe_intermediate_size": self.intermediate_size,
                "intermediate_size": self.dense_intermediate_size or self.intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_size,
                "mlp_only_layers": list(self.dense_layers), "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm,
                "o_bias": self.o_bias, "expert_bias": self.model_type == "gpt_oss",
                "attention_sinks": self.attention_sinks, "sliding_window": self.sliding_window,
                "sliding_layers": list(self.sliding_layers)} | self._latent_fields()

    def _latent_fields(self) -> dict:
        """MLA's shape under DeepSeek's config names (the HRM reads them from any config)."""
        if self.mla is None:
            return {}
        m = self.mla
        return {"kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
                "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
                "v_head_dim": m.v_head_dim, "shared_expert_gate": False,
                "score_bias": bool(self.group_routing and self.group_routing.score_bias)}


def require(cfg: dict, where: str, *keys: str) -> None:
    """ConfigError naming every missing field."""
    absent = [k for k in keys if cfg.get(k) is None]
    if absent:
        raise ConfigError(f"{where}: missing required field(s) {', '.join(absent)}")


def rope_theta_of(cfg: dict, default: float) -> float:
    """rope_theta, from rope_parameters (transformers 5) or the top level (transformers 4)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def rope_dict(cfg: dict, where: str) -> dict:
    """The config's RoPE parameters: transformers 5's `rope_parameters` or transformers 4's
    `rope_scaling`. Both, saying different things (a model card's `rope_scaling` recipe added to a
    config transformers 5 saved), is refused: transformers would take `rope_scaling` and drop
    `rope_parameters`' rope_theta for its class default, so neither reading is safe to guess."""
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    if params and scaling:
        plain = lambda d: {k: v for k, v in d.items() if k not in ("rope_theta", "type")} | {  # noqa: E731
            "rope_type": d.get("rope_type", d.get("type", "default"))}
        if plain(params) != plain(scaling):
            raise ConfigError(f"{where}: both rope_parameters {json.dumps(params)} and rope_scaling "
                              f"{json.dumps(scaling)}; write the scaling into rope_parameters (keeping its "
                              "rope_theta) and remove rope_scaling")
    return dict(params or scaling or {})


SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")  # what rope.py computes as transformers does


def rope_scaling_of(cfg: dict, where: str, allow: tuple[str, ...] = SCALED_ROPE_TYPES) -> tuple:
    """The config's RoPE scaling as ModelConfig.rope_scaling items (with its rope_type), () for plain
    RoPE; a type rope.py does not compute is refused rather than run unscaled."""
    rope = rope_dict(cfg, where)
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("rope_theta", None)
    partial = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:  # RoPE over part of each head: no family here has it
        raise ConfigError(f"{where}: partial_rotary_factor {partial} is not supported")
    if rope_type == "default":
        return ()
    if rope_type not in allow:
        raise ConfigError(f"{where}: rope scaling {rope_type!r} is not supported (supported: "
                          f"{', '.join(allow)}); remove rope_scaling / rope_parameters from config.json "
                          "to run at the model's original context")
    need = {"linear": ("factor",), "yarn": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in need.get(rope_type, ()) if rope.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: rope scaling {rope_type!r} needs {', '.join(missing)}")
    return tuple(sorted({**rope, "rope_type": rope_type}.items()))


def eos_ids_of(cfg: dict, default: int | None = 2) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id", default)
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


def check_act(cfg: dict, where: str, key: str = "hidden_act") -> None:
    act = cfg.get(key, "silu")
    if act != "silu":
        raise ConfigError(f"{where}: {key} {act!r} is not supported (the experts are SwiGLU: 'silu')")
