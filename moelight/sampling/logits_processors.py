"""What SamplingParams does to a row of logits before it is sampled, as vLLM defines each field.

Applied per row in place, in vLLM v1's order: allowed_token_ids, bad_words, min_tokens and
logit_bias, then the repetition, frequency and presence penalties, then a structured-output
grammar's mask. Where the others leave a grammar no token (min_tokens banning the EOS a finished
grammar needs; allowed_token_ids outside it), the grammar wins: the row is the grammar's mask over the
bias and penalties alone, so a constrained output always matches. Rows that ask for none of these are
never touched (the greedy README job pays nothing). `RowState` is what a sequence carries for them:
its prompt and output tokens, the tokenized bad words, its stop ids, and its grammar matcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moelight.sampling.params import SamplingParams

NEG_INF = float("-inf")


@dataclass
class RowState:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()  # EOS and stop_token_ids: banned until min_tokens is reached
    bad_word_ids: list[list[int]] = field(default_factory=list)
    constraint: object | None = None  # structured.Constraint


def apply_processors(logits: torch.Tensor, states: list[RowState]) -> None:
    """Every row's processors, in place on `logits` [B, V] (float32). The penalties of all rows are one
    batched pass between the per-row steps before them (restrictions, bias) and after (the grammar)."""
    rows = [row for row, st in enumerate(states) if st.params.has_processors]
    befores = {}
    for row in rows:
        st = states[row]
        if st.constraint is not None and _restricts(st):
            befores[row] = logits[row].clone()
        _process_row(logits[row], st, restrict=True, stage="before penalties")
    penalised = [row for row in rows if states[row].params.has_penalties]
    if penalised:
        penalties_rows(logits, penalised, [states[row] for row in penalised])
    for row in rows:
        x, st = logits[row], states[row]
        _process_row(x, st, restrict=True, stage="after penalties")
        if row in befores and bool(torch.isneginf(x).all()):
            x.copy_(befores[row])
            _process_row(x, st, restrict=False)


def penalties_rows(x: torch.Tensor, rows: list[int], states: list[RowState]) -> None:
    """vLLM's penalties of rows `rows` (ascending) of `x` [B, V] (contiguous) at once, in place: repetition
    over prompt and output tokens (a positive logit divided by the penalty, a negative one multiplied),
    frequency (minus penalty x count) and presence (minus penalty once) over the output tokens. Only the
    (row, token) pairs the rows have seen are touched: a per-row loop rebuilt a vocab-sized mask and a
    bincount for each row at every step."""
    vocab = x.shape[-1]
    flat = x.view(-1)
    ps = [st.params for st in states]
    rep = [(r, st) for r, p, st in zip(rows, ps, states, strict=True) if p.repetition_penalty != 1.0]
    if rep:
        at, _ = _seen([r for r, _ in rep], [st.prompt_ids + st.output_ids for _, st in rep], vocab)
        pen = torch.tensor([st.params.repetition_penalty for _, st in rep], dtype=x.dtype)
        pen = pen[torch.searchsorted(torch.tensor([r for r, _ in rep]), at // vocab)]
        v = flat[at]
        flat[at] = torch.where(v > 0, v / pen, v * pen)
    fp = [(r, st) for r, p, st in zip(rows, ps, states, strict=True) if p.frequency_penalty or p.presence_penalty]
    if fp:
        at, counts = _seen([r for r, _ in fp], [st.output_ids for _, st in fp], vocab)
        which = torch.searchsorted(torch.tensor([r for r, _ in fp]), at // vocab)
        freq = torch.tensor([st.params.frequency_penalty for _, st in fp], dtype=x.dtype)[which]
        pres = torch.tensor([st.params.presence_penalty for _, st in fp], dtype=x.dtype)[which]
        flat[at] = flat[at] - (freq * counts.to(x.dtype) + pres)


def _seen(rows: list[int], ids: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions row * vocab + token of each row's distinct token ids (ascending), with their
    counts; an id past the vocabulary counts nowhere (not in the next row)."""
    tok = torch.tensor([t for row in ids for t in row], dtype=torch.long)
    row = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                  torch.tensor([len(r) for r in ids], dtype=torch.long))
    ok = tok < vocab
    return torch.unique(row[ok] * vocab + tok[ok], return_counts=True)


def _process_row(x: torch.Tensor, st: RowState, restrict: bool, stage: str = "all") -> None:
    """One row's processors in vLLM's order; `restrict` False leaves out the ones that only remove tokens
    (allowed_token_ids, bad_words, min_tokens). `stage`: all, or those before / after the penalties."""
    p, vocab = st.params, x.shape[-1]
    if stage != "after penalties":
        if restrict:
            _restrict(x, st, vocab)
        if p.logit_bias:
            for token, bias in p.logit_bias.items():
                if 0 <= token < vocab:
                    x[token] += bias
    if stage == "all" and p.has_penalties:
        penalties_rows(x.unsqueeze(0), [0], [st])
    if stage != "before penalties" and st.constraint is not None:
        st.constraint.mask(x)


def _restricts(st: RowState) -> bool:
    """Whether `_restrict` removes any token this step (else the grammar's fallback is the same row)."""
    p = st.params
    return bool(p.allowed_token_ids or st.bad_word_ids or (len(st.output_ids) < p.min_tokens and st.stop_ids))


def _restrict(x: torch.Tensor, st: RowState, vocab: int) -> None:
    p = st.params
    if p.allowed_token_ids:
        keep = torch.full((vocab,), NEG_INF)
        ids = torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab], dtype=torch.long)
        keep[ids] = 0.0
        x += keep
    for banned in _bad_word_tokens(st):
        if 0 <= banned < vocab:
            x[banned] = NEG_INF
    if len(st.output_ids) < p.min_tokens and st.stop_ids:
        x[torch.tensor([t for t in st.stop_ids if 0 <= t < vocab], dtype=torch.long)] = NEG_INF


def _bad_word_tokens(st: RowState) -> list[int]:
    """vLLM's bad words: a word's last token is banned where the output so far ends with the rest of it
    (a one-token word is always banned)."""
    banned = []
    for ids in st.bad_word_ids:
        prefix = ids[:-1]
        if not prefix or st.output_ids[-len(prefix):] == prefix:
            banned.append(ids[-1])
    return banned


def bad_word_ids(words: list[str] | None, encode) -> list[list[int]]:
    """Each bad word as vLLM tokenizes it: as given and with a leading space (a word inside a text)."""
    out: list[list[int]] = []
    for w in words or []:
        for variant in (w, " " + w.lstrip()):
            ids = encode(variant)
            if ids and ids not in out:
                out.append(ids)
    return out
