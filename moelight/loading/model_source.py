"""Resolving `--model DIR|PRESET`, `--load-format` and `--dtype` into a config and weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moelight.errors import ConfigError
from moelight.loading.hf_config import load_config
from moelight.loading.hub_cache import hub_snapshot, looks_like_hub_id
from moelight.loading.load_formats import LOAD_FORMATS
from moelight.loading.presets import PRESETS, preset_config
from moelight.loading.weights import build_model
from moelight.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    model_dir: Path | None  # None for presets
    load_format: str  # "safetensors" or "dummy"
    dtype: torch.dtype


def resolve_model(model: str, load_format: str = "auto", dtype: str = "auto") -> ModelSource:
    """Decide what to load without loading it, so memory can be checked first."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {load_format!r}: choose one of {', '.join(LOAD_FORMATS)}")
    path = Path(model)
    if path.is_dir():
        cfg = load_config(path)
        fmt = "safetensors" if load_format == "auto" else load_format
        return ModelSource(model, cfg, path, fmt, _dtype(dtype, path))
    if model in PRESETS:
        if load_format == "safetensors":
            raise ConfigError(f"--model {model} is a preset with no weight files; use --load-format dummy")
        return ModelSource(model, preset_config(model), None, "dummy", _dtype(dtype, None))
    if path.exists():
        raise ConfigError(f"--model {model}: not a folder; give a Hugging Face model folder or a preset")
    if looks_like_hub_id(model):  # org/name: its snapshot in the local Hub cache, or an error saying so
        return resolve_model(str(hub_snapshot(model)), load_format, dtype)
    raise ConfigError(
        f"--model {model}: no such folder and not a preset; presets: {', '.join(PRESETS)}"
    )


def _dtype(name: str, model_dir: Path | None) -> torch.dtype:
    if name == "auto":
        if model_dir is None:
            return torch.bfloat16  # dummy presets: the fast CPU dtype
        return _config_dtype(model_dir / "config.json")
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _config_dtype(path: Path) -> torch.dtype:
    """config.json's dtype (or torch_dtype) read as transformers reads it, a name in torch ("float" is
    float32, "half" float16); bfloat16 where it states none."""
    cfg = json.loads(path.read_text())
    field = "dtype" if cfg.get("dtype") else "torch_dtype"
    name = cfg.get(field) or "bfloat16"
    found = getattr(torch, name, None) if isinstance(name, str) else None
    if found in DTYPES.values():
        return found
    what = "a dtype moelight runs" if isinstance(found, torch.dtype) else "a torch dtype"
    raise ConfigError(f"{path}: {field} {json.dumps(name)} is not {what} (float32, bfloat16, float16, or "
                      "torch's aliases float, half); fix the field, or choose with --dtype float32|bfloat16|float16")


def load_model(src: ModelSource, seed: int = 0):
    return build_model(src.config, src.dtype, src.model_dir if src.load_format == "safetensors" else None, seed)
