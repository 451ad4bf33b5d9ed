"""A Hugging Face Hub id (`org/name`) found in the local Hub cache, as vLLM finds it offline: moelight
downloads nothing, but a model fetched with `hf download` or by transformers runs by its id."""

from __future__ import annotations

import os
import re
from pathlib import Path

from moelight.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_snapshot(model: str) -> Path:
    """The cached snapshot folder of Hub id `model` (refs/main's commit; the only snapshot where there is no
    refs/main); ConfigError saying where it looked and what to do when it is not there."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + model.replace("/", "--"))
    ref = repo / "refs" / "main"
    snapshots = repo / "snapshots"
    if ref.is_file():
        snap = snapshots / ref.read_text().strip()
        if snap.is_dir():
            return snap
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    why = (f"{snapshots} holds {len(found)} snapshots and no refs/main to choose one" if found
           else f"it is not in the Hugging Face cache ({repo} does not exist)" if not repo.exists()
           else f"{repo} holds no snapshot")
    raise ConfigError(f"--model {model}: no such folder and not a preset; as a Hub id, {why}. moelight downloads "
                      f"nothing: fetch it first (`hf download {model}`; the cache is HF_HUB_CACHE, else "
                      "HF_HOME/hub, else ~/.cache/huggingface/hub) or give the model's folder")


def cached_model_folder(model: str) -> Path:
    """`--model`'s folder: the path itself, or a Hub id's cached snapshot where there is one."""
    if looks_like_hub_id(model):
        try:
            return hub_snapshot(model)
        except ConfigError:
            pass
    return Path(model).expanduser()


def model_folder(model: str) -> str:
    """`--model` as plan / simulate take it: a preset or a folder as given, a Hub id as its cached
    snapshot (ConfigError when it is not cached)."""
    return str(hub_snapshot(model)) if looks_like_hub_id(model) else model
