"""Reading a Hugging Face config.json through its family's adapter (moelight/models/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from moelight.errors import ConfigError, broken_download_link
from moelight.loading.checkpoint_experts import with_expert_storage
from moelight.loading.int_checkpoints import scheme_of
from moelight.models import family
from moelight.models.config import ModelConfig

# quantised checkpoints moelight reads: GPT-OSS's MXFP4 experts, DeepSeek's FP8 blocks; their experts are kept
# in that format where the fused CPU kernel runs them (loading/expert_storage.py), dequantised at load elsewhere
_FAMILY_FORMATS = {("mxfp4", "gpt_oss"), ("fp8", "deepseek_v2"), ("fp8", "deepseek_v3"), ("fp8", "kimi_k2")}
# GPTQ / AWQ / compressed-tensors (loading/int_checkpoints.py): families whose experts are per-expert linear layers
INT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
PER_EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2")
# shape fields of every family (DBRX's under ffn_config / attn_config): whole numbers where present
WHOLE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "num_local_experts",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "decoder_sparse_step", "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "n_group",
                "topk_group", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "num_nextn_predict_layers", "d_model", "n_heads", "n_layers", "max_seq_len", "moe_num_experts",
                "moe_top_k", "ffn_hidden_size", "kv_n_heads")
NUMBER_FIELDS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "routed_scaling_factor", "clip_qkv",
                 "swiglu_limit")


def check_field_types(cfg: dict, where: str) -> None:
    """ConfigError naming every shape field that is not a whole number and every rate that is not a number
    (a hand-edited "four" or 2.7 would otherwise fail deep in an adapter, or be rounded silently)."""
    bad = []
    for scope, d in (("", cfg), ("ffn_config.", cfg.get("ffn_config")), ("attn_config.", cfg.get("attn_config"))):
        if not isinstance(d, dict):
            continue
        for k in WHOLE_FIELDS:
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  and not (isinstance(v, float) and v.is_integer())):
                bad.append(f"{scope}{k} must be a whole number, got {json.dumps(v)}")
        for k in NUMBER_FIELDS:
            v = d.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                bad.append(f"{scope}{k} must be a number, got {json.dumps(v)}")
    if bad:
        raise ConfigError(f"{where}: " + "; ".join(bad))


def config_from_hf_dict(cfg: dict, where: str = "config.json") -> ModelConfig:
    """Read a Hugging Face config dict through its family's adapter, with errors that name the file."""
    quant_cfg = cfg.get("quantization_config") or {}
    quant, mtype = quant_cfg.get("quant_method"), cfg.get("model_type")
    generic = quant in INT_METHODS and mtype in PER_EXPERT_FAMILIES and (quant, mtype) not in _FAMILY_FORMATS
    scheme = scheme_of(quant_cfg, where) if generic else None
    if quant and scheme is None and (quant, mtype) not in _FAMILY_FORMATS:
        raise ConfigError(f"{where}: a {quant!r}-quantised {mtype} checkpoint; moelight reads GPTQ, AWQ, "
                          "compressed-tensors and block-scaled FP8 checkpoints of "
                          f"{', '.join(PER_EXPERT_FAMILIES)}, GPT-OSS's MXFP4, and unquantised weights: use the "
                          "model's original checkpoint")
    check_field_types(cfg, where)
    config = family(mtype, where).config_from_hf(cfg, where)
    if not quant:
        return config
    return replace(config, checkpoint_quant=quant, checkpoint_scheme=scheme,
                   float_modules=_float_modules(quant_cfg, where))


def _float_modules(quant: dict, where: str) -> tuple[str, ...]:
    """The modules a quantized checkpoint keeps in float: HF's modules_to_not_convert, compressed-tensors' ignore
    (transformers and vLLM load them as plain weights)."""
    keys = []
    for field in ("modules_to_not_convert", "ignore"):
        listed = quant.get(field) or []
        if not isinstance(listed, list) or not all(isinstance(k, str) and k for k in listed):
            raise ConfigError(f"{where}: quantization_config.{field} must be a list of module names, got "
                              f"{json.dumps(listed)}")
        keys += listed
    return tuple(keys)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if broken_download_link(path):
        raise ConfigError(broken_download_link(path))
    if not path.is_file():
        raise ConfigError(f"{path}: not found; --model takes a Hugging Face model folder or a preset name")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
    config = config_from_hf_dict(cfg, where=str(path))
    return with_expert_storage(config, path.parent) if config.checkpoint_quant else config
