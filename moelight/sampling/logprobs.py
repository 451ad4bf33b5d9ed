"""Log-probabilities in vLLM's shape: per position a dict {token_id: Logprob(logprob, rank, decoded_token)}
holding the top-k tokens and the chosen one (a generated token, or the prompt's next token).

They are the model's own: float32 log-softmax of the raw logits, before penalties, biases, grammar
masks or temperature (vLLM's default `logprobs_mode`). `rank` is the token's place by logprob among
the whole vocabulary (1 = most likely).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_ROWS = 512  # rows of log-softmax at a time over a long prompt: [rows, vocab] float32 at once


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def position_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int,
                      decode=None) -> tuple[list[dict[int, Logprob]], list[float]]:
    """For logits [R, V] and the token chosen at each row [R]: the chosen + top-k dict per row, and
    the chosen tokens' logprobs (for cumulative_logprob)."""
    dicts: list[dict[int, Logprob]] = []
    chosen_lp: list[float] = []
    for start in range(0, logits.shape[0], CHUNK_ROWS):
        lp = torch.log_softmax(logits[start:start + CHUNK_ROWS].float(), dim=-1)
        pick = chosen[start:start + CHUNK_ROWS].long()
        mine = lp.gather(1, pick[:, None])[:, 0]
        ranks = (lp > mine[:, None]).sum(-1) + 1
        top_v, top_i = torch.topk(lp, k, dim=-1) if k else (lp[:, :0], pick[:, None][:, :0])
        for r in range(lp.shape[0]):
            token = int(pick[r])
            # the chosen token first, with its own rank (ties), then the top-k: vLLM's order
            entry = {token: Logprob(float(mine[r]), int(ranks[r]))}
            for i, (t, v) in enumerate(zip(top_i[r].tolist(), top_v[r].tolist(), strict=True)):
                if t != token:
                    entry[t] = Logprob(float(v), i + 1)
            if decode is not None:
                for t, v in entry.items():
                    v.decoded_token = decode(t)
            dicts.append(entry)
            chosen_lp.append(float(mine[r]))
    return dicts, chosen_lp


def prompt_logprobs(logits: torch.Tensor, prompt: list[int], k: int, decode=None) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs: None for the first token (nothing predicts it), then for each later prompt
    token its logprob given the tokens before it, with the top-k there. `logits` are the prompt's
    positions [len(prompt), V] (the last row predicts the first generated token and is not used)."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    dicts, _ = position_logprobs(logits[:-1], torch.tensor(prompt[1:]), k, decode)
    return [None, *dicts]
