"""Architecture registry: one file per model family, as vLLM's `model_executor/models/`.

A family module provides
- `config_from_hf(cfg: dict, where: str) -> ModelConfig`: its config.json adapter;
- `DecoderLayer`: the layer, split where CGOPipe splits it (`pre_attention` -> q, k, v;
  `post_attention` -> next layer's input), readable in one screen;
- `tensor_targets(name, cfg) -> list[Target] | None`: where one checkpoint tensor goes in
  moelight's parameters (packed experts `[E, 2f, h]` / `[E, h, f]`), None for tensors to skip.
Adding a family is adding its file and a line here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from moelight.errors import ConfigError

FAMILIES = {
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
    "dbrx": "dbrx",
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "kimi_k2": "deepseek",  # Kimi-K2 ships DeepSeek-V3's architecture under its own model_type
}


def family(model_type: str | None, where: str = "config.json") -> ModuleType:
    """The family module of a config.json's model_type, or a ConfigError listing the supported ones."""
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; moelight runs these Mixture-of-Experts "
            f"families: {', '.join(FAMILIES)}"
        )
    return importlib.import_module(f"moelight.models.{FAMILIES[model_type]}")
