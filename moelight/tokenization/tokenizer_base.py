"""The interface every tokenizer gives the engine (`tokenizer.HFTokenizer`, `byte_tokenizer.ByteTokenizer`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class Tokenizer(ABC):
    """What the engine needs from any tokenizer."""

    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]  # every id that ends generation (generation_config may list several)
    pad_id: int | None
    vocab_size: int

    @abstractmethod
    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the special tokens the model expects around a prompt."""

    @abstractmethod
    def decode(self, ids: list[int], skip_special_tokens: bool = True, context: Sequence[int] = ()) -> str:
        """Text of ``ids``, special tokens left out unless ``skip_special_tokens`` is False, read as it
        follows the tokens ``context`` (an output after its prompt)."""

    def piece(self, token: int) -> str:
        """One token's text as it reads inside a text (a logprob's decoded token)."""
        return self.decode([token], False)

    @abstractmethod
    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            **template_kwargs) -> list[int] | str:
        """Token ids of a conversation, ending with the prompt for the assistant's answer (its text
        with ``tokenize=False``, as vLLM scripts build prompt strings through transformers).

        `tools` (JSON-schema tool dicts) and `template_kwargs` (e.g. Qwen3's `enable_thinking`,
        GPT-OSS's `reasoning_effort` / `builtin_tools`, `documents`) reach the template as transformers
        passes them; `chat_template` (a template or a template's name) and `continue_final_message`
        mean what they mean in transformers' `apply_chat_template`."""

    def encode_request(self, request: Any) -> list[int]:
        """Prompt ids for a ``workloads.Request``: the chat template for messages (with the request's own
        template arguments, as LLM.chat passes them), else the raw prompt."""
        if getattr(request, "messages", None) is not None:
            return self.apply_chat_template(request.messages, tools=getattr(request, "tools", None),
                                            **getattr(request, "chat_options", {}))
        return self.encode(request.prompt)
