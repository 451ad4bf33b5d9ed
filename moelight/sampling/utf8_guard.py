"""Only tokens that keep the text valid UTF-8, for constrained rows.

xgrammar matches bytes: its character classes ([^"], `.`) admit byte sequences that are no character
(UTF-8-encoded surrogates ED A0..BF, overlong forms E0 80..9F / F0 80..8F, a lead byte left without its
continuation). With byte-level or byte-fallback vocabularies a grammar then lets a model write text that
decodes to U+FFFD, breaks a schema's length or swallows the closing quote a byte-fallback decoder
merged into the bad run. This guard is UTF-8's own automaton run over every token's bytes from each
of its states once per tokenizer, so a step costs one row of a precomputed table.
"""

from __future__ import annotations

import numpy as np
import torch

READY, NEED1, NEED2, NEED2_E0, NEED2_ED, NEED3, NEED3_F0, NEED3_F4, BAD = range(9)
STATES = 8  # BAD is where a token leads that would break the text


def _byte_table() -> np.ndarray:
    """UTF-8's transitions (RFC 3629's table of well-formed byte sequences): [state, byte] -> state."""
    t = np.full((STATES + 1, 256), BAD, np.int8)
    t[READY, 0x00:0x80] = READY
    t[READY, 0xC2:0xE0] = NEED1
    t[READY, 0xE0] = NEED2_E0
    t[READY, 0xE1:0xED] = NEED2
    t[READY, 0xED] = NEED2_ED
    t[READY, 0xEE:0xF0] = NEED2
    t[READY, 0xF0] = NEED3_F0
    t[READY, 0xF1:0xF4] = NEED3
    t[READY, 0xF4] = NEED3_F4
    t[NEED1, 0x80:0xC0] = READY
    t[NEED2, 0x80:0xC0] = NEED1
    t[NEED2_E0, 0xA0:0xC0] = NEED1
    t[NEED2_ED, 0x80:0xA0] = NEED1
    t[NEED3, 0x80:0xC0] = NEED2
    t[NEED3_F0, 0x90:0xC0] = NEED2
    t[NEED3_F4, 0x80:0x90] = NEED2
    return t


def token_transitions(decoded_vocab: list[bytes]) -> np.ndarray:
    """[STATES, vocab]: the state after each token's bytes from each state (BAD: not allowed there).
    A token of no bytes (special, stop) leaves the state as it is."""
    table = _byte_table()
    lens = np.fromiter((len(b) for b in decoded_vocab), np.int64, len(decoded_vocab))
    width = int(lens.max(initial=0))
    data = np.zeros((len(decoded_vocab), max(width, 1)), np.uint8)
    for i, b in enumerate(decoded_vocab):
        if b:
            data[i, : len(b)] = np.frombuffer(b, np.uint8)
    state = np.repeat(np.arange(STATES, dtype=np.int8)[:, None], len(decoded_vocab), axis=1)
    for j in range(width):  # every token and every start state at once, one byte column at a time
        live = lens > j
        state[:, live] = table[state[:, live], data[live, j][None, :]]
    return state


class Utf8Guard:
    """One sequence's place in a UTF-8 character: which tokens may come next, as xgrammar's packed token
    bitmask (bit j of word i: token 32 i + j), so joining it to the grammar's costs a word per 32 tokens."""

    def __init__(self, transitions: np.ndarray, bits: torch.Tensor) -> None:
        self.transitions, self.bits, self.state = transitions, bits, READY

    def restrict(self, bitmask: torch.Tensor) -> None:
        """The grammar's allowed tokens less those that would break the text, unless none would be left
        (then the grammar's own mask stands: it outranks this guard)."""
        both = bitmask & self.bits[self.state]
        if bool(both.any()):
            bitmask.copy_(both)

    def accept(self, token: int) -> None:
        nxt = int(self.transitions[self.state, token]) if token < self.transitions.shape[1] else self.state
        self.state = READY if nxt == BAD else nxt


def allowed_bits(transitions: np.ndarray) -> torch.Tensor:
    """[STATES, words] int32: the tokens each state admits, packed 32 to a word as xgrammar packs them."""
    allowed = transitions != BAD
    words = -(-allowed.shape[1] // 32)
    padded = np.zeros((STATES, words * 32), np.uint32)
    padded[:, : allowed.shape[1]] = allowed
    packed = (padded.reshape(STATES, words, 32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return torch.from_numpy(packed.view(np.int32).copy())
