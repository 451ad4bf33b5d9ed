"""The unit of work the engine receives from every reader."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

# free-form values: JSON text in a row, so a schema cannot bend them
JSON_FIELDS = ("messages", "tools", "meta", "sampling", "chat_options")


@dataclass
class Request:
    """One prompt (or conversation) to complete.

    ``messages`` holds chat turns ``{"role", "content"}`` and wins over ``prompt``
    (raw text, used for plain completion). ``followups`` are further user turns the
    engine asks after each answer (MT-Bench turn 2). Sampling fields left ``None``
    mean "use the run's defaults". ``source`` is ``file:line`` for error messages.
    """

    id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    followups: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    source: str = ""
    meta: dict = field(default_factory=dict)
    tools: list[dict] | None = None  # JSON-schema tools for the chat template (OpenAI `tools`)
    sampling: dict = field(default_factory=dict)  # more vLLM SamplingParams fields (n, stop, logprobs, ...)
    # the chat template's keyword arguments (add_generation_prompt, continue_final_message, enable_thinking, ...)
    chat_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.messages is None and self.prompt is None:
            raise ValueError(f"request {self.id!r} ({self.source}): needs messages or a prompt")

    @property
    def is_chat(self) -> bool:
        """True when the request should go through the chat template."""
        return self.messages is not None

    @property
    def text(self) -> str:
        """The raw text of a plain request, or the last user turn of a chat (for display)."""
        if self.messages is None:
            return self.prompt or ""
        for m in reversed(self.messages):
            if m.get("role") == "user":
                return m.get("content", "")
        return self.messages[-1].get("content", "")

    def to_row(self) -> dict:
        """The request as an Arrow-friendly row (Ray Data): typed scalars and lists, free-form nested
        fields (messages, tools, meta) as JSON text, so a batch of rows makes one columnar table."""
        row = asdict(self)
        for name in JSON_FIELDS:
            row[name] = None if row[name] is None else json.dumps(row[name])
        return row

    @classmethod
    def from_row(cls, row: dict) -> Request:
        """`to_row` undone, from a row of Python or numpy values (a Ray Data batch)."""
        values = {f.name: _plain(row.get(f.name)) for f in fields(cls)}
        for name in JSON_FIELDS:
            if values[name] is not None:
                values[name] = json.loads(values[name])
        values["meta"] = values["meta"] or {}
        values["sampling"] = values["sampling"] or {}
        values["chat_options"] = values["chat_options"] or {}
        values["followups"] = list(values["followups"] or [])
        return cls(**values)


def _plain(v):
    """numpy scalars and arrays (a Ray Data batch's values) as plain Python values."""
    return v.tolist() if hasattr(v, "tolist") else v
