"""`--load-format`'s choices, torch-free: the engine's option check reads them before anything loads."""

from __future__ import annotations

LOAD_FORMATS = ("auto", "safetensors", "dummy")  # dummy: random weights of the config's shapes
