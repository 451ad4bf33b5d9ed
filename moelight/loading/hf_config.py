"""Reading a Hugging Face config.json through its family's adapter (moelight/models/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from moelight.errors import ConfigError
from moelight.loading.int_checkpoints import scheme_of
from moelight.models import family
from moelight.models.config import ModelConfig

# quantised checkpoints moelight reads: GPT-OSS's MXFP4 experts, DeepSeek's FP8 blocks; their experts are kept
# in that format where the fused CPU kernel runs them (loading/expert_storage.py), dequantised at load elsewhere
_FAMILY_FORMATS = {("mxfp4", "gpt_oss"), ("fp8", "deepseek_v2"), ("fp8", "deepseek_v3"), ("fp8", "kimi_k2")}
# GPTQ / AWQ / compressed-tensors (loading/int_checkpoints.py): families whose experts are per-expert linear layers
INT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
PER_EXPERT_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2")


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
    config = family(mtype, where).config_from_hf(cfg, where)
    return replace(config, checkpoint_quant=quant, checkpoint_scheme=scheme) if quant else config


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; --model takes a Hugging Face model folder or a preset name")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
    return config_from_hf_dict(cfg, where=str(path))
