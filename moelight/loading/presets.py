"""Named model shapes for `--load-format dummy` (random weights, no files), as vLLM does.

The shapes are config.json dicts kept with the HRM's presets (hrm/model_presets.py), read
through each family's adapter, so the engine and the planner cannot disagree about a preset.
"""

from __future__ import annotations

from hrm.model_presets import PRESET_CONFIGS
from moelight.errors import ConfigError
from moelight.loading.hf_config import config_from_hf_dict
from moelight.models.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {name: config_from_hf_dict(cfg, where=f"preset {name}")
                                   for name, cfg in PRESET_CONFIGS.items()}


def preset_config(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; presets: {', '.join(PRESETS)} (or pass a model folder)"
        ) from None
