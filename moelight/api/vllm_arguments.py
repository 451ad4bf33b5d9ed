"""vLLM's `LLM(...)` arguments that moelight's options spell another way, turned into moelight's values
before `EngineOptions` checks them, so a vLLM script's constructor call works unchanged."""

from __future__ import annotations

import warnings

import torch

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's dtype names beyond moelight's


def engine_option_values(options: dict) -> dict:
    """`options` with vLLM's spellings made moelight's: seed=None is seed=0, as vLLM's V1 engine takes it
    (it warns that None is deprecated; vLLM's random-seed None was V0's); dtype "half" / "float" or a
    torch dtype is its name."""
    options = dict(options)
    dtype = options.get("dtype")
    if isinstance(dtype, torch.dtype):  # torch.float16 -> "float16"; one moelight does not run is refused by name
        options["dtype"] = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        options["dtype"] = DTYPE_ALIASES.get(dtype, dtype)
    if "seed" in options and options["seed"] is None:
        warnings.warn("LLM(seed=None) is seed=0, as in vLLM's V1 engine: a request without its own seed samples "
                      "with 0 + crc32(its id); give an int seed for other draws", UserWarning, stacklevel=3)
        options["seed"] = 0
    return options
