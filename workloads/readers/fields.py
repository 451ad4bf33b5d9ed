"""Field validation shared by the record parsers.

Parsers raise ``RecordError`` with a short message; the dataset driver adds the file and
line, collects every bad record and reports them together.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class RecordError(Exception):
    """A record is unusable; the message says which field and why (no location)."""


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def get_id(obj: dict, key: str, default: str) -> str:
    """An id may be a string or an integer in the input; the engine always uses strings."""
    v = obj.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise RecordError(f"field '{key}' must be a string or integer, got {_type_name(v)}")
    s = str(v)
    if not s.strip():
        raise RecordError(f"field '{key}' is empty")
    return s


def get_text(obj: dict, key: str, *, required: bool = True) -> str | None:
    """A prompt-like text field: a string, blank ones too, as vLLM takes them (a prompt that tokenizes to no
    tokens is refused when it is tokenized, before the model loads)."""
    if key not in obj or obj[key] is None:
        if required:
            raise RecordError(f"missing required field '{key}'")
        return None
    v = obj[key]
    if not isinstance(v, str):
        raise RecordError(f"field '{key}' must be a string, got {_type_name(v)}")
    return check_text(v, f"field '{key}'")


def check_text(v: str, where: str) -> str:
    """`v`, if it is text: a JSON \\ud800-style escape can give a lone surrogate, which no tokenizer encodes."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError(f"{where} holds a lone surrogate ({v[e.start]!r} at character {e.start}), which is "
                          "not text: fix the escape that made it (a surrogate pair is two \\u escapes)") from None
    return v


def opt_int(obj: dict, *keys: str, minimum: int | None = None) -> int | None:
    """The first present of ``keys`` as an integer (aliases such as max_tokens/max_new_tokens)."""
    for key in keys:
        v = obj.get(key)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise RecordError(f"field '{key}' must be an integer, got {_type_name(v)} {v!r}")
        if minimum is not None and v < minimum:
            raise RecordError(f"field '{key}' must be >= {minimum}, got {v}")
        return v
    return None


def opt_float(obj: dict, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
    """An optional number within [lo, hi]."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecordError(f"field '{key}' must be a number, got {_type_name(v)} {v!r}")
    v = float(v)
    if v != v or (lo is not None and not lo <= v) or (hi is not None and not v <= hi):  # NaN fails every test
        raise RecordError(f"field '{key}' must be in [{lo}, {hi}], got {v}")
    return v


def _content_text(content: Any, where: str) -> str:
    """Chat content is a string, or OpenAI's list of parts of which only text is supported (joined by
    newlines, as vLLM's server joins them for a template that takes a string)."""
    if isinstance(content, str):
        return check_text(content, f"{where}: content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise RecordError(f"{where}: only text content parts are supported, got {kind!r}")
        return check_text("\n".join(texts), f"{where}: content")  # vLLM's "string" content format
    raise RecordError(f"{where}: content must be a string, got {_type_name(content)}")


def parse_messages(v: Any, key: str = "messages", need_user: bool = True) -> list[dict]:
    """Validate chat turns: each keeps its fields for the chat template (OpenAI's `tool_calls`,
    `tool_call_id`, `name`, reasoning), its content made a string (None only beside an assistant's
    tool calls); fields that are null are left out, as a message object would not have them.
    Blank content is content, as vLLM renders it (the template gives tokens; a conversation that renders to
    none is refused when it is tokenized, before the model loads).
    need_user: a dataset's conversation is a prompt, so it needs a user turn; LLM.chat, as vLLM's, also
    takes a system prompt alone or an assistant turn to continue."""
    if not isinstance(v, list):
        raise RecordError(f"field '{key}' must be a list of {{role, content}} objects, got {_type_name(v)}")
    if not v:
        raise RecordError(f"field '{key}' is empty")
    out = []
    for i, m in enumerate(v):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise RecordError(f"{where} must be an object with role and content, got {_type_name(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise RecordError(f"{where}: role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if "content" not in m:
            raise RecordError(f"{where}: missing 'content'")
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise RecordError(f"{where}: tool_calls must be a list of objects, got {_type_name(calls)}")
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None and not isinstance(m[name], str):
                raise RecordError(f"{where}: {name} must be a string, got {_type_name(m[name])}")
        if m["content"] is None and not (role == "assistant" and calls):
            raise RecordError(f"{where}: content may be null only in an assistant turn with tool_calls")
        content = None if m["content"] is None else _content_text(m["content"], where)
        turn = {**{k: x for k, x in m.items() if x is not None}, "role": role, "content": content}
        if calls:
            turn["tool_calls"] = _tool_calls(calls)
        out.append(turn)
    if need_user and not any(m["role"] == "user" for m in out):
        raise RecordError(f"field '{key}' has no user turn")
    return out


def parse_tools(obj: dict, key: str = "tools") -> list[dict] | None:
    """OpenAI-style tools: a list of objects (JSON schemas), handed to the chat template as given, or
    left out under `tool_choice` "none" (as vLLM leaves them out of the prompt). A choice that forces a
    call ("required", a named function) is refused: moelight writes the model's text, no forced calls."""
    v = obj.get(key)
    choice = obj.get("tool_choice")
    if choice not in (None, "auto", "none"):
        shown = choice if isinstance(choice, str) else "a named function"
        raise RecordError(f"field 'tool_choice' {shown!r} is not supported: moelight does not force tool calls "
                          "(the model's tool calls come back as its text); give 'auto', 'none' or leave it out")
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise RecordError(f"field '{key}' must be a list of tool objects, got {_type_name(v)}")
    return None if choice == "none" else v


def _tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI gives a call's arguments as JSON text; templates read them as an object (vLLM parses them
    before rendering, so a `tojson` template does not write them twice encoded)."""
    out = []
    for c in calls:
        fn = c.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = None
            if isinstance(args, dict):
                c = {**c, "function": {**fn, "arguments": args}}
        out.append(c)
    return out


def sampling_fields(obj: dict) -> dict:
    """temperature / top_p / top_k / seed overrides, each None when absent; a seed of -1 is none, as vLLM
    reads it (the request then draws with the job's seed + crc32(id), not one seed every -1 shares)."""
    seed = opt_int(obj, "seed")
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise RecordError(f"field 'seed' must be a 64-bit seed (-2^63 .. 2^64 - 1; -1: none), got {seed}")
    return {
        "temperature": opt_float(obj, "temperature", 0.0, 100.0),
        "top_p": opt_float(obj, "top_p", 0.0, 1.0),
        "top_k": opt_int(obj, "top_k", minimum=-1),
        "seed": None if seed == -1 else seed,
    }
