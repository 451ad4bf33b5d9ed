"""Model presets shared by the whole project (same names as the engine's presets)."""

from __future__ import annotations

from pathlib import Path

from hrm.model import ModelSpec, load_model_dir

MODEL_PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", 512, 64, 128, 2, 4, 2, 4, 2, 16, rope_theta=1e6, max_position=2048),
    "bench-1b": ModelSpec("bench-1b", 32000, 1024, 3584, 8, 8, 2, 16, 4, 64, max_position=4096),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32000, 4096, 14336, 32, 8, 2, 32, 8, 128,
                              rope_theta=1e6, max_position=32768),
    "mixtral-8x22b": ModelSpec("mixtral-8x22b", 32768, 6144, 16384, 56, 8, 2, 48, 8, 128,
                               rope_theta=1e6, max_position=65536),
    "dbrx": ModelSpec("dbrx", 100352, 6144, 10752, 40, 16, 4, 48, 8, 128, rope_theta=5e5,
                      max_position=32768, model_type="dbrx"),
}


def list_models() -> list[str]:
    return sorted(MODEL_PRESETS)


def get_model(name_or_dir: str | Path) -> ModelSpec:
    """A preset by name, else a directory holding config.json (or the config file itself)."""
    key = str(name_or_dir)
    if key.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[key.lower()]
    p = Path(key).expanduser()
    if p.exists():
        return load_model_dir(p)
    raise KeyError(f"unknown model {key!r}; valid presets: {', '.join(list_models())}, or a directory "
                   "with config.json")
