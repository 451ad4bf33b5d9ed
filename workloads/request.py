"""The unit of work the engine receives from every reader."""

from __future__ import annotations

from dataclasses import dataclass, field


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
