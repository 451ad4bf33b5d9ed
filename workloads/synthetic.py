"""Synthetic prompts with a chosen length distribution, for benchmarks without real data.

Text is plain ASCII words, so with the byte-level tokenizer of dummy models a prompt of
L characters is L tokens (plus BOS); with a real BPE tokenizer it is roughly L/4-5.
"""

from __future__ import annotations

import math
import random

from .request import Request

MTBENCH_MEAN_LEN = 77   # first-turn MT-Bench prompts with the Mixtral tokenizer (paper, data README)
MTBENCH_MAX_LEN = 418

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or have an are not but "
    "which one all were when we there can been has more if will their would about what so up out "
    "them into some time could these two may first then do any like other than now only its over "
    "also new after most where how well way even because good each those people through many "
    "before must back years much should system model expert layer memory batch token compute "
    "write explain describe compare travel city history science reason answer question story "
    "simple small large fast slow water light world market energy design student teacher number"
).split()


def synthetic_lengths(n: int, mean_len: float, max_len: int, seed: int = 0, min_len: int = 1) -> list[int]:
    """``n`` integer lengths in [min_len, max_len] with mean ~``mean_len`` and a long right tail.

    Lognormal draws are clipped and rescaled until the mean matches; for n >= 10 one
    sample is set to ``max_len`` so the maximum is exercised too (MT-Bench style).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not (1 <= min_len <= mean_len <= max_len):
        raise ValueError(f"need 1 <= min_len <= mean_len <= max_len, got {min_len}, {mean_len}, {max_len}")
    rng = random.Random(seed)
    sigma = 0.8
    mu = math.log(mean_len) - sigma * sigma / 2
    raw = [rng.lognormvariate(mu, sigma) for _ in range(n)]
    pinned = rng.randrange(n) if n >= 10 else -1
    scale = 1.0
    lengths: list[int] = []
    for _ in range(30):
        lengths = [min(max_len, max(min_len, round(x * scale))) for x in raw]
        if pinned >= 0:
            lengths[pinned] = max_len
        mean = sum(lengths) / n
        if abs(mean - mean_len) < 0.5:
            break
        scale *= mean_len / mean
    return lengths


def _text_of_length(rng: random.Random, length: int) -> str:
    words: list[str] = []
    size = -1
    while size < length:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    text = " ".join(words)[:length]
    if text.endswith(" "):
        text = text[:-1] + "s"
    return text[0].upper() + text[1:] if text else text


def synthetic_prompts(n: int, mean_len: float, max_len: int, seed: int = 0, min_len: int = 1) -> list[str]:
    """``n`` word-like ASCII prompts whose character lengths follow ``synthetic_lengths``."""
    rng = random.Random(seed + 1)
    lengths = synthetic_lengths(n, mean_len, max_len, seed, min_len)
    return [_text_of_length(rng, n_chars) for n_chars in lengths]


def mtbench_like_lengths(n: int, seed: int = 0) -> list[int]:
    """Prompt lengths with MT-Bench's statistics (mean 77, max 418) when the real file isn't wanted."""
    return synthetic_lengths(n, MTBENCH_MEAN_LEN, MTBENCH_MAX_LEN, seed, min_len=8)


def mtbench_like_prompts(n: int, seed: int = 0) -> list[str]:
    """Synthetic prompts with MT-Bench-like lengths (in byte-tokenizer tokens)."""
    return synthetic_prompts(n, MTBENCH_MEAN_LEN, MTBENCH_MAX_LEN, seed, min_len=8)


def synthetic_requests(n: int, mean_len: float, max_len: int, seed: int = 0,
                       max_new_tokens: int | None = None) -> list[Request]:
    """Synthetic prompts wrapped as requests (ids ``synthetic-0``...), ready for the engine."""
    return [
        Request(id=f"synthetic-{i}", prompt=p, max_new_tokens=max_new_tokens, source=f"synthetic:{i}",
                meta={"input_format": "synthetic"})
        for i, p in enumerate(synthetic_prompts(n, mean_len, max_len, seed))
    ]
