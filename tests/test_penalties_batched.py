"""The penalties of a batch in one pass give each row exactly what the per-row `apply_penalties` gave
(vLLM's: repetition over prompt and output, frequency and presence over the output)."""

from __future__ import annotations

import random

import torch

from moelight.sampling.logits_processors import RowState, apply_processors, penalties_rows
from moelight.sampling.params import SamplingParams

VOCAB = 500


def states(seed: int) -> list[RowState]:
    rng = random.Random(seed)
    kinds = [dict(repetition_penalty=1.3), dict(repetition_penalty=0.8), dict(frequency_penalty=0.7),
             dict(presence_penalty=-0.5), dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4),
             dict(logit_bias={5: 3.0, 7: -100.0}), dict(min_tokens=50, max_tokens=64), dict(temperature=0.0)]
    out = []
    for i in range(24):
        p = SamplingParams(**{"temperature": 1.0, **kinds[i % len(kinds)]})
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 3, 40]))]
        output = [rng.randrange(20) for _ in range(rng.choice([0, 1, 30]))]  # repeats: counts above 1
        out.append(RowState(p, prompt, output, frozenset({2})))
    return out


def logits(seed: int) -> torch.Tensor:
    x = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    x[::5, ::7] = float("-inf")  # banned tokens stay banned
    return x


def apply_penalties(x: torch.Tensor, prompt_ids: list[int], output_ids: list[int], p: SamplingParams) -> None:
    """The per-row penalties the batched pass replaced (vLLM's, on one row): the reference."""
    vocab = x.shape[-1]
    out = torch.tensor(output_ids, dtype=torch.long) if output_ids else torch.zeros(0, dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        if prompt_ids:
            seen[torch.tensor(prompt_ids, dtype=torch.long)] = True
        seen[out] = True
        pen = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        x.copy_(torch.where(seen, pen, x))
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(out, minlength=vocab).to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)


def old_apply_processors(x: torch.Tensor, sts: list[RowState]) -> None:
    """The per-row loop this replaces (no grammar rows here)."""
    for row, st in enumerate(sts):
        p = st.params
        if not p.has_processors:
            continue
        if len(st.output_ids) < p.min_tokens and st.stop_ids:
            x[row, torch.tensor(sorted(st.stop_ids))] = float("-inf")
        for token, bias in (p.logit_bias or {}).items():
            x[row, token] += bias
        if p.has_penalties:
            apply_penalties(x[row], st.prompt_ids, st.output_ids, p)


def test_penalties_rows_are_the_per_row_ones():
    for seed in range(3):
        sts, x = states(seed), logits(seed)
        want = x.clone()
        for row, st in enumerate(sts):
            if st.params.has_penalties:
                apply_penalties(want[row], st.prompt_ids, st.output_ids, st.params)
        rows = [row for row, st in enumerate(sts) if st.params.has_penalties]
        penalties_rows(x, rows, [sts[row] for row in rows])
        assert torch.equal(x, want)


def test_processors_of_a_mixed_batch_are_the_per_row_ones():
    for seed in range(3):
        sts, x = states(seed), logits(seed)
        want = x.clone()
        old_apply_processors(want, sts)
        apply_processors(x, sts)
        assert torch.equal(x, want)
