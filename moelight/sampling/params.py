"""Sampling parameters in vLLM's names, and the per-request seed rule both front ends share."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """temperature 0 means greedy; top_k 0 or -1 disables top-k; seed makes a request reproducible."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("temperature", self.temperature, float)
        _check_type("top_p", self.top_p, float)
        _check_type("top_k", self.top_k, int)
        _check_type("ignore_eos", self.ignore_eos, bool)
        if self.seed is not None:
            _check_type("seed", self.seed, int)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_type(name: str, value, kind: type) -> None:
    """TypeError in vLLM's manner for a field of the wrong type (a float field takes an int too)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif isinstance(value, bool):  # True is an int in Python, not a token count
        ok = False
    else:
        ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok:
        raise TypeError(f"{name} must be {'a' if kind is not int else 'an'} {kind.__name__}, got "
                        f"{type(value).__name__} {value!r}")


def request_seed(base_seed: int, request_id: str) -> int:
    """The seed of a request that sets none: base + crc32(id), so a request's draws do not depend
    on which other requests share its batch, nor on the front end that started the job."""
    return base_seed + zlib.crc32(request_id.encode())
