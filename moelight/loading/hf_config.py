"""Reading a Hugging Face config.json through its family's adapter (moelight/models/)."""

from __future__ import annotations

import json
from pathlib import Path

from moelight.errors import ConfigError
from moelight.models import family
from moelight.models.config import ModelConfig

# checkpoints whose quantised weights are dequantised at load: GPT-OSS's MXFP4 experts, DeepSeek's FP8 blocks
_DEQUANTISED_AT_LOAD = {("mxfp4", "gpt_oss"), ("fp8", "deepseek_v2"), ("fp8", "deepseek_v3"), ("fp8", "kimi_k2")}


def config_from_hf_dict(cfg: dict, where: str = "config.json") -> ModelConfig:
    """Read a Hugging Face config dict through its family's adapter, with errors that name the file."""
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant and (quant, cfg.get("model_type")) not in _DEQUANTISED_AT_LOAD:
        raise ConfigError(f"{where}: a {quant!r}-quantised checkpoint; moelight loads unquantised (float32, "
                          "bfloat16, float16) weights only: use the model's original checkpoint")
    return family(cfg.get("model_type"), where).config_from_hf(cfg, where)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; --model takes a Hugging Face model folder or a preset name")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from e
    return config_from_hf_dict(cfg, where=str(path))
