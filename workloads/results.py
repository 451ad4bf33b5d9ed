"""The result record the engine hands to ``ResultWriter`` and its OpenAI Batch rendering.

Keeping the shape in one place lets the engine build it with ``build_result`` and never
care which output format the user asked for.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from .request import Request

FINISH_REASONS = ("stop", "length")
REQUIRED_KEYS = ("id", "output", "output_token_ids", "finish_reason", "prompt_tokens", "completion_tokens")


@dataclass
class TurnOutput:
    """What the engine produced for one user turn."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    user: str | None = None  # the user turn that was answered (for multi-turn records)
    extra: dict = field(default_factory=dict)  # per sample: stop_reason, logprobs, cumulative_logprob (when asked)


def sample_record(index: int, t: TurnOutput) -> dict:
    """One of a request's `n` samples, as the output's `outputs` list holds it."""
    return {"index": index, "output": t.text, "output_token_ids": list(t.token_ids),
            "finish_reason": t.finish_reason, "completion_tokens": len(t.token_ids), **t.extra}


def build_result(request: Request, turns: list[TurnOutput], model: str | None = None,
                 samples: list[TurnOutput] | None = None, prompt_logprobs: list | None = None) -> dict:
    """The dict ``ResultWriter.write`` expects, from a request and its per-turn outputs.

    Top-level output fields describe the last turn (with `n` samples: the first); token counts are
    summed over turns and samples (each turn's prompt includes the conversation so far). ``turns``
    is present for every multi-turn request (with ``turns_cut``, the later turns that did not fit the
    context and did not run, where any), ``outputs`` (every sample) only for n > 1; a sample's
    logprobs, stop_reason and cumulative_logprob, and the prompt's logprobs, only when asked for.
    """
    if not turns:
        raise ValueError(f"request {request.id!r}: no outputs")
    last = turns[-1]
    result: dict = {
        "id": request.id,
        "prompt": request.prompt,
        "messages": request.messages,
        "output": last.text,
        "output_token_ids": list(last.token_ids),
        "finish_reason": last.finish_reason,
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "completion_tokens": sum(len(t.token_ids) for t in (samples or turns)),
        **last.extra,
    }
    if samples is not None and len(samples) > 1:
        result["outputs"] = [sample_record(k, t) for k, t in enumerate(samples)]
    if prompt_logprobs is not None:
        result["prompt_logprobs"] = prompt_logprobs
    asked = 1 + len(request.followups)
    if asked > 1:  # a conversation: its turns, and how many the context left out (the report says why)
        if len(turns) < asked:
            result["turns_cut"] = asked - len(turns)
        result["turns"] = [
            {"user": t.user, "output": t.text, "output_token_ids": list(t.token_ids),
             "finish_reason": t.finish_reason, "prompt_tokens": t.prompt_tokens,
             "completion_tokens": len(t.token_ids), **t.extra}
            for t in turns
        ]
    if model is not None:
        result["model"] = model
    result["meta"] = dict(request.meta)
    return result


def build_error_result(request: Request, message: str, code: str = "engine_error") -> dict:
    """A request the engine could not serve (e.g. prompt longer than the context)."""
    return {"id": request.id, "prompt": request.prompt, "messages": request.messages,
            "error": {"code": code, "message": message}, "meta": dict(request.meta)}


def check_result(result: dict) -> None:
    """Fail loudly on an engine bug rather than write a record resume cannot read."""
    if not isinstance(result, dict):
        raise TypeError(f"result must be a dict, got {type(result).__name__}")
    if not isinstance(result.get("id"), str):
        raise ValueError(f"result needs a string 'id', got {result.get('id')!r}")
    if result.get("error") is not None:
        return
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise ValueError(f"result {result['id']!r} is missing {', '.join(missing)}")
    if result["finish_reason"] not in FINISH_REASONS:
        raise ValueError(f"result {result['id']!r}: finish_reason must be one of {FINISH_REASONS}, "
                         f"got {result['finish_reason']!r}")


def to_openai_batch(result: dict, default_model: str = "moelight") -> dict:
    """Render a result as one line of OpenAI Batch output (chat.completion or text_completion), with vLLM's
    extra fields: each choice's stop_reason (the stop string or token id that ended it), prompt_logprobs."""
    meta = result.get("meta") or {}
    custom_id = result["id"]
    line_id = f"batch_req_{uuid.uuid4().hex[:24]}"
    if result.get("error") is not None:
        err = result["error"]
        return {"id": line_id, "custom_id": custom_id, "response": None,
                "error": {"code": err.get("code", "engine_error"), "message": err.get("message", "")}}
    model = result.get("model") or default_model  # the model that answered (the body's name stays in meta)
    created = int(result.get("created") or time.time())
    usage = {"prompt_tokens": result["prompt_tokens"], "completion_tokens": result["completion_tokens"],
             "total_tokens": result["prompt_tokens"] + result["completion_tokens"]}
    samples = result.get("outputs") or [{"index": 0, **result}]
    if meta.get("url") == "/v1/completions":
        body = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": created,
                "model": model,
                "choices": [{"index": o["index"], "text": o["output"], "logprobs": _completion_logprobs(o),
                             "finish_reason": o["finish_reason"], "stop_reason": o.get("stop_reason")}
                            for o in samples],
                "usage": usage}
    else:
        body = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": created,
                "model": model,
                "choices": [{"index": o["index"], "message": {"role": "assistant", "content": o["output"]},
                             "logprobs": _chat_logprobs(o), "finish_reason": o["finish_reason"],
                             "stop_reason": o.get("stop_reason")} for o in samples],
                "usage": usage}
    if result.get("prompt_logprobs") is not None:  # vLLM's extra field, when the request asked for it
        body["prompt_logprobs"] = result["prompt_logprobs"]
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
            "error": None}


def _chat_logprobs(sample: dict) -> dict | None:
    """OpenAI chat's `logprobs.content[]`: each token with its logprob, bytes and top_logprobs."""
    if sample.get("logprobs") is None:
        return None
    content = []
    for pos in sample["logprobs"]:
        token = pos["token"] or ""
        content.append({"token": token, "logprob": pos["logprob"], "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t["token"] or "", "logprob": t["logprob"],
                                          "bytes": list((t["token"] or "").encode())} for t in pos["top"]]})
    return {"content": content}


def _completion_logprobs(sample: dict) -> dict | None:
    """OpenAI completions' logprobs: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    if sample.get("logprobs") is None:
        return None
    tokens, offsets, at = [], [], 0
    for pos in sample["logprobs"]:
        tokens.append(pos["token"] or "")
        offsets.append(at)
        at += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [pos["logprob"] for pos in sample["logprobs"]],
            "top_logprobs": [{t["token"] or "": t["logprob"] for t in pos["top"]} for pos in sample["logprobs"]],
            "text_offset": offsets}


RESULT_COLUMNS = (*REQUIRED_KEYS, "details")


def result_to_row(result: dict) -> dict:
    """A result as an Arrow-friendly row: the required keys typed, everything else (prompt, messages,
    turns, model, meta) in `details`, JSON text that also keeps the record's key order."""
    row = {k: result[k] for k in REQUIRED_KEYS}
    row["details"] = json.dumps({k: (None if k in REQUIRED_KEYS else v) for k, v in result.items()})
    return row


def result_from_row(row: dict) -> dict:
    """`result_to_row` undone (row values may be numpy's, from a Ray Data batch)."""
    result = json.loads(row["details"])
    for k in REQUIRED_KEYS:
        v = row[k]
        result[k] = v.tolist() if hasattr(v, "tolist") else v
    return result
