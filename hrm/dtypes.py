"""Bytes per element of the data types the planner knows.

Kept in hrm (not taken from torch) so that planning never imports torch.
"""

from __future__ import annotations

DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "int8": 1.0,
    "int4": 0.5,
}

_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def canonical_dtype(name: str) -> str:
    """Normalise 'bf16' / 'torch.bfloat16' style names to the keys of DTYPE_BYTES."""
    key = name.lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPE_BYTES)}")
    return key


def dtype_bytes(name: str) -> float:
    """Bytes per element of `name` (int4 is half a byte)."""
    return DTYPE_BYTES[canonical_dtype(name)]
