"""Plain jsonl: one object a line with ``prompt`` (or ``messages``), optional ``id``,
``max_tokens``/``max_new_tokens``, sampling overrides and ``followups``."""

from __future__ import annotations

from ..request import Request
from .chat_options import CHAT_OPTION_KEYS, chat_options
from .fields import RecordError, get_id, get_text, opt_int, parse_messages, parse_tools, sampling_fields
from .json_values import json_safe_meta
from .sampling_options import JSONL_KEYS, extra_sampling

KNOWN_KEYS = {"id", "prompt", "messages", "max_tokens", "max_new_tokens", "followups",
              "temperature", "top_p", "top_k", "seed", "tools", "tool_choice", *CHAT_OPTION_KEYS} | JSONL_KEYS


def looks_like_prompt_jsonl(obj: dict) -> bool:
    return "prompt" in obj or "messages" in obj


def parse_prompt_record(obj: dict, where: str, lineno: int, turn: int = 1, prompt_key: str = "prompt",
                        id_key: str = "id") -> Request:
    """Ids default to the line number so they stay stable when bad lines are skipped. `prompt_key` /
    `id_key`: a parquet file's own column names, which errors name; a `prompt` or `id` beside them is meta."""
    rid = get_id(obj, id_key, str(lineno))
    messages = None
    prompt = None
    if obj.get("messages") is not None:
        if obj.get(prompt_key) is not None:
            raise RecordError(f"give either '{prompt_key}' or 'messages', not both")
        messages = parse_messages(obj["messages"])
    elif prompt_key in obj:
        prompt = get_text(obj, prompt_key)
    else:
        raise RecordError(f"missing required field '{prompt_key}' (or 'messages')")
    followups = obj.get("followups") or []
    if not isinstance(followups, list) or not all(isinstance(t, str) for t in followups):
        raise RecordError("field 'followups' must be a list of strings (the later user turns)")
    if followups and messages is None:
        messages = [{"role": "user", "content": prompt}]
        prompt = None
    known = (KNOWN_KEYS - {"prompt", "id"}) | {prompt_key, id_key}
    meta = json_safe_meta({k: v for k, v in obj.items() if k not in known})
    tools = parse_tools(obj)
    if tools and messages is None:
        raise RecordError("field 'tools' needs 'messages' (the chat template renders the tools)")
    chat = chat_options(obj, messages is not None, bool(followups))
    sampling = extra_sampling(obj)
    if sampling.get("n", 1) > 1 and followups:
        raise RecordError("n > 1 with 'followups': each sample would be a conversation of its own; ask for one")
    return Request(
        sampling=sampling,
        tools=tools,
        chat_options=chat,
        id=rid,
        messages=messages,
        prompt=prompt,
        followups=list(followups),
        max_new_tokens=opt_int(obj, "max_new_tokens", "max_completion_tokens", "max_tokens", minimum=1),  # vLLM's
        source=where,
        meta=meta,
        **sampling_fields(obj),
    )
