"""OpenAI Batch API input: ``{"custom_id", "method", "url", "body": {...}}`` a line.

``body.messages`` (chat completions) or ``body.prompt`` (completions); the model name,
url and custom_id are kept in ``meta`` so the writer can answer in the Batch output shape.
"""

from __future__ import annotations

from ..request import Request
from .chat_options import chat_options
from .fields import RecordError, get_id, opt_int, parse_messages, parse_tools, sampling_fields
from .json_values import json_safe_meta
from .sampling_options import extra_sampling

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")


def looks_like_openai_batch(obj: dict) -> bool:
    """A `body` makes a batch request; a `custom_id` beside a `prompt` is a prompt record's extra field."""
    return "body" in obj and ("custom_id" in obj or "url" in obj or not ("prompt" in obj or "messages" in obj))


def parse_openai_record(obj: dict, where: str, lineno: int, turn: int = 1) -> Request:
    if obj.get("custom_id") is None:
        raise RecordError("missing required field 'custom_id'")
    cid = get_id(obj, "custom_id", "")
    method = obj.get("method", "POST")
    if method != "POST":
        raise RecordError(f"field 'method' must be 'POST', got {method!r}")
    url = obj.get("url", "/v1/chat/completions")
    if url not in SUPPORTED_URLS:
        raise RecordError(f"field 'url' must be one of {', '.join(SUPPORTED_URLS)}, got {url!r}")
    body = obj.get("body")
    if body is None:
        raise RecordError("missing required field 'body'")
    if not isinstance(body, dict):
        raise RecordError(f"field 'body' must be an object, got {type(body).__name__}")
    messages = None
    prompt = None
    if body.get("messages") is not None:
        messages = parse_messages(body["messages"], "body.messages")
    elif body.get("prompt") is not None:
        p = body["prompt"]
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if not isinstance(p, str):
            raise RecordError(f"body.prompt must be a string, got {type(p).__name__}")
        prompt = p  # blank text too, as vLLM's server takes it; one of no tokens is refused when tokenized
    else:
        raise RecordError("missing required field 'body.messages' (or 'body.prompt')")
    salt = body.get("cache_salt")  # vLLM's prefix-cache isolation key: nothing to isolate, the cache lives one job
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RecordError(f"body.cache_salt must be a non-empty string (as in vLLM), got {salt!r}")
    try:
        sampling = sampling_fields(body)
        max_new = opt_int(body, "max_completion_tokens", "max_tokens", minimum=1)
        extra = extra_sampling(body, openai=url)
    except RecordError as e:
        raise RecordError(f"body: {e}") from None
    try:
        tools = parse_tools(body)
        chat = chat_options(body, messages is not None)
    except RecordError as e:
        raise RecordError(f"body: {e}") from None
    meta = json_safe_meta({"custom_id": obj["custom_id"], "url": url, "model": body.get("model")})
    return Request(id=cid, messages=messages, prompt=prompt, max_new_tokens=max_new,
                   source=where, meta=meta, tools=tools, chat_options=chat, sampling=extra, **sampling)
