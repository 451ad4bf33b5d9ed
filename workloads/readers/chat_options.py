"""vLLM's chat-request fields that change how the chat template renders a conversation:
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` (Qwen3's `enable_thinking`,
GPT-OSS's `reasoning_effort`, ...). A record's or an OpenAI body's are honoured per request, as vLLM's
server honours them, and checked where they are read so a bad one is reported with its line."""

from __future__ import annotations

from .fields import RecordError, _type_name

CHAT_OPTION_KEYS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")
# what a request may not set through chat_template_kwargs: its own fields, or what moelight does not take
_NOT_KWARGS = {"messages": "give the conversation as 'messages'", "tools": "give them as the request's 'tools'",
               "chat_template": "a request's own chat template is not supported (vLLM's server refuses one too "
                                "unless started with --trust-request-chat-template); the model's template renders it",
               "documents": "documents are not supported", "tokenize": "moelight always tokenizes the prompt"}


def _flag(obj: dict, key: str, where: str) -> bool | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise RecordError(f"field '{where}{key}' must be true or false, got {_type_name(v)} {v!r}")
    return v


def chat_options(obj: dict, is_chat: bool, followups: bool = False) -> dict:
    """The keyword arguments a record's chat fields give the chat template ({} when it sets none), merged
    as vLLM merges them: the two flags, then `chat_template_kwargs` over them. RecordError for a wrong
    type, a field without `messages` to render, or a combination vLLM and transformers refuse."""
    given = [k for k in CHAT_OPTION_KEYS if obj.get(k) is not None]
    if not given:
        return {}
    if not is_chat:
        raise RecordError(f"field(s) {', '.join(given)} need 'messages': they change how the chat template renders "
                          "a conversation, and a plain prompt is not one")
    options: dict = {}
    for key in ("add_generation_prompt", "continue_final_message"):
        if _flag(obj, key, "") is not None:
            options[key] = obj[key]
    kwargs = obj.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise RecordError(f"field 'chat_template_kwargs' must be an object of template variables, got "
                              f"{_type_name(kwargs)}")
        for key, why in _NOT_KWARGS.items():
            if key in kwargs:
                raise RecordError(f"field 'chat_template_kwargs.{key}' is not taken: {why}")
        for key in ("add_generation_prompt", "continue_final_message"):
            _flag(kwargs, key, "chat_template_kwargs.")
        options |= kwargs
    if options.get("continue_final_message") and options.get("add_generation_prompt", True):
        raise RecordError("continue_final_message needs add_generation_prompt false (vLLM and transformers refuse "
                          "both): add \"add_generation_prompt\": false to continue the final message")
    if followups and (options.get("continue_final_message") or options.get("add_generation_prompt") is False):
        raise RecordError("'followups' ask the model to answer each user turn: leave continue_final_message and "
                          "add_generation_prompt false out of a record with followups")
    return options
