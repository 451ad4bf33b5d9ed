"""An output's text grown one token at a time, for the stop-string search.

Decoding the whole output at every step cost O(length) a token (270 us/token at 4k tokens with stop
strings). Here the text is a committed head plus the text of the last few tokens, decoded as they read
after the tokens before them (vLLM's incremental detokenizer): decode(window + tail) less decode(window).
A head is committed only where its text is whole (it does not end in the U+FFFD of a character whose
bytes are still coming); the window is the tokens of the commit before, which begin a character.
Where the window's text is not a prefix of the longer one or not the committed text (a byte-fallback
decoder shows a run of byte tokens as U+FFFD each until its last character completes), the whole output
is decoded again, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int], bool, Sequence[int]], str]

_COMMIT = 8  # tail tokens decoded again each step before they are committed


class OutputText:
    """decode(ids, skip, context) of a growing `ids`, at a bounded cost per token."""

    def __init__(self, decode: Decode, skip_special_tokens: bool, context: Sequence[int]) -> None:
        self.decode, self.skip, self.context = decode, skip_special_tokens, list(context)
        self.head = 0  # ids[:head] are committed...
        self.head_text = ""  # ...with this text...
        self.window = 0  # ...and the tail reads after ids[window:head] (a commit before: a character's start)

    def text(self, ids: list[int]) -> str:
        """The text of `ids` (the same `ids` as before, grown)."""
        tail = self._tail(ids)
        if tail is None:  # the decoder reads these tokens otherwise after their window: the whole text
            self.window, self.head, self.head_text = 0, 0, ""
            tail = self.decode(ids, self.skip, self.context)
        if len(ids) - self.head >= _COMMIT and not tail.endswith("\ufffd"):
            self.window, self.head, self.head_text = self.head, len(ids), self.head_text + tail
            return self.head_text
        return self.head_text + tail

    def _tail(self, ids: list[int]) -> str | None:
        """The text of ids[head:] as it reads after the committed tokens; None where it cannot be cut off."""
        if self.head == 0:
            return self.decode(ids, self.skip, self.context)
        start = self.window
        before = ids[max(0, start - 24):start] if start else self.context  # a decoder reads <= 24 tokens back
        window = ids[start:self.head]
        head = self.decode(window, self.skip, before)
        full = self.decode(window + ids[self.head:], self.skip, before)
        if head.endswith("\ufffd") or not full.startswith(head) or not self.head_text.endswith(head):
            return None
        return full[len(head):]
