"""GPT-OSS's harmony format: an answer written as channels (`analysis`, `commentary`, `final`) between special
tokens. A later turn's history keeps the answer's `final` channel as the assistant message's content, as
openai-harmony and vLLM's server parse a harmony completion (the analysis channel is dropped from history,
as GPT-OSS's template drops a prior turn's reasoning); the text decoded without special tokens would run
the channel names into the answer ("analysis...assistantfinal...")."""

from __future__ import annotations

import re

CHANNEL, MESSAGE, START = "<|channel|>", "<|message|>", "<|start|>"
_ENDS = re.compile(r"<\|(?:end|return|call)\|>")
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def is_harmony(tokenizer) -> bool:
    """True for a tokenizer whose chat template writes harmony channels and that knows their tokens."""
    templates = getattr(tokenizer, "chat_templates", None)
    sources = templates.values() if isinstance(templates, dict) else [templates]
    token_id = getattr(getattr(tokenizer, "backend", None), "token_to_id", lambda _: None)
    return (any(isinstance(s, str) and CHANNEL in s for s in sources)
            and all(token_id(t) is not None for t in (CHANNEL, MESSAGE, START)))


def final_channel(text: str) -> tuple[str, bool]:
    """The answer a harmony completion (decoded with its special tokens) gives a later turn's history:
    (the last `final` channel's text, True); without one (cut by max_tokens, or a tool call), (what the
    model wrote after its last <|message|>, False)."""
    final = None
    for message in text.split(START):  # the first one follows the prompt's own <|start|>assistant
        header, sep, body = message.partition(MESSAGE)
        if not sep:
            continue
        channel = header.partition(CHANNEL)[2].split("<|")[0].split()
        if channel and channel[0] == "final":
            final = body
    if final is not None:
        return _body(final), True
    last = text.rpartition(MESSAGE)[2]
    return _body(last), False


def _body(text: str) -> str:
    """A message's text: up to its end token, other special tokens left out."""
    return _SPECIAL.sub("", _ENDS.split(text, maxsplit=1)[0])
