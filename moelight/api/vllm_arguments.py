"""vLLM's `LLM(...)` arguments that moelight's options spell another way, turned into moelight's values
before `EngineOptions` checks them, so a vLLM script's constructor call works unchanged."""

from __future__ import annotations

import warnings

import torch

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's dtype names beyond moelight's
# vLLM arguments at the value vLLM's examples pass, which asks for what moelight does anyway: quantization None
# reads the checkpoint as it ships (moelight's quantize "none"), tensor_parallel_size 1 runs one rank (moelight's
# unless gpus or a multi-GPU hardware preset asks for more)
VLLM_DEFAULTS = {"quantization": None, "tensor_parallel_size": 1}


def without_vllm_defaults(options: dict) -> dict:
    """`options` less the vLLM arguments given at their no-op value (VLLM_DEFAULTS); any other value of
    them is left for LLM() to refuse with moelight's name for it."""
    def no_op(name: str, value: object) -> bool:  # True is no tensor_parallel_size: the type must match too
        return name in VLLM_DEFAULTS and type(value) is type(VLLM_DEFAULTS[name]) and value == VLLM_DEFAULTS[name]

    return {k: v for k, v in options.items() if not no_op(k, v)}


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
