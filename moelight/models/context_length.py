"""The model's context: the positions a prompt and its answer may take together.

config.json's max_position_embeddings, stretched by its RoPE scaling as vLLM derives `max_model_len`:
`linear` (and `dynamic`) times `factor`, `yarn` its original_max_position_embeddings times `factor`
(even where max_position_embeddings says otherwise); `llama3` and `longrope` configs already give the
scaled context in max_position_embeddings. A YaRN config without original_max_position_embeddings
stretches max_position_embeddings, as transformers reads it (rope.py).
"""

from __future__ import annotations

_STRETCHED = ("linear", "dynamic", "yarn")


def context_length(max_position_embeddings: int, rope_scaling: tuple) -> int:
    """The context in tokens; `rope_scaling` as ModelConfig holds it (sorted items, () for plain RoPE)."""
    p = dict(rope_scaling)
    if p.get("rope_type") not in _STRETCHED:
        return max_position_embeddings
    return int(_base(max_position_embeddings, p) * float(p.get("factor", 1.0)))


def context_origin(max_position_embeddings: int, rope_scaling: tuple, key: str = "max_position_embeddings") -> str:
    """Where the context comes from, for an error that names it: `key` is config.json's field."""
    p = dict(rope_scaling)
    if p.get("rope_type") not in _STRETCHED:
        return f"config.json's {key}"
    base = ("original_max_position_embeddings" if p["rope_type"] == "yarn" and p.get("original_max_position_embeddings")
            else key)
    return (f"config.json's {base} {_base(max_position_embeddings, p)} x its {p['rope_type']} RoPE scaling factor "
            f"{float(p.get('factor', 1.0)):g}")


def _base(max_position_embeddings: int, p: dict) -> int:
    """The length the scaling stretches."""
    if p.get("rope_type") == "yarn" and p.get("original_max_position_embeddings"):
        return int(p["original_max_position_embeddings"])
    return max_position_embeddings
