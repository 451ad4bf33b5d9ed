"""A model's generation_config.json: its end ids, which end generation whatever the tokenizer (as vLLM adds
them), and its sampling defaults, which vLLM's `generation_config="auto"` makes the defaults of requests
that do not set them (`"vllm"`: vLLM's own defaults; a folder: that folder's file)."""

from __future__ import annotations

import json
from pathlib import Path

from moelight.errors import ConfigError

# generation_config.json's fields vLLM takes as sampling defaults, by SamplingParams' name
SAMPLING_FIELDS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                   "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
_INTS = ("top_k", "max_new_tokens")


def read_generation_config(folder: Path | None) -> dict:
    """The folder's generation_config.json as a dict ({} where there is none)."""
    path = None if folder is None else Path(folder) / "generation_config.json"
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def generation_eos(folder: Path | None) -> tuple[int, ...]:
    """generation_config.json's eos_token_id: one id or a list (Llama 3 style); () where it names none."""
    eos = read_generation_config(folder).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def sampling_defaults(choice: str, model_dir: Path | None) -> dict:
    """SamplingParams fields from generation_config.json, as vLLM's `generation_config` option takes them:
    "auto" the model folder's file, "vllm" none, any other value a folder holding one."""
    if choice == "vllm":
        return {}
    if choice == "auto":
        folder = model_dir
    else:
        folder = Path(choice).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"generation_config {choice!r}: no generation_config.json there; give auto (the "
                              "model's own), vllm (no model defaults) or a folder holding one")
    data = read_generation_config(folder)
    found = {}
    for name, field in SAMPLING_FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        ok = isinstance(value, int) if name in _INTS else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok:
            raise ConfigError(f"{Path(folder) / 'generation_config.json'}: {name} must be a "
                              f"{'whole number' if name in _INTS else 'number'}, got {json.dumps(value)}")
        found[field] = float(value) if name not in _INTS else value
    return found


def described(defaults: dict) -> str:
    """The defaults taken, for a report line: 'temperature 0.6, top_p 0.95'."""
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in defaults.items())
