"""The sampling a request asks for beyond temperature / top-p / top-k / seed, in vLLM's names: read
from a jsonl record (vLLM's SamplingParams fields) or an OpenAI body (`n`, `stop`, `logprobs` /
`top_logprobs`, `response_format`, penalties, `logit_bias`, and the extra SamplingParams fields vLLM's
server takes in a body: `min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`, ...), each field checked
where it is read so a bad one is reported with its line before any model loads."""

from __future__ import annotations

from typing import Any

from .fields import RecordError, _type_name

UNSUPPORTED_KEYS = ("use_beam_search", "best_of", "length_penalty", "truncate_prompt_tokens", "guided_json",
                    "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")
MAX_LOGPROBS = 20  # top-k logprobs per token at most (vLLM's default max_logprobs)


def _number(obj: dict, key: str, lo: float, hi: float) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RecordError(f"field '{key}' must be a number, got {_type_name(v)}")
    if not lo <= v <= hi:
        raise RecordError(f"field '{key}' must be in [{lo:g}, {hi:g}], got {v}")
    return float(v)


def _integer(obj: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RecordError(f"field '{key}' must be an integer, got {_type_name(v)}")
    if v < lo or (hi is not None and v > hi):
        raise RecordError(f"field '{key}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _strings(obj: dict, key: str) -> list[str] | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise RecordError(f"field '{key}' must be a string or a list of non-empty strings, got {_type_name(v)}")
    return v


def _token_ids(obj: dict, key: str) -> list[int] | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        got = "an empty list" if isinstance(v, list) else f"{_type_name(v)} {v!r}"
        raise RecordError(f"field '{key}' must be a non-empty list of integer token ids (>= 0), got {got}")
    for i, t in enumerate(v):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise RecordError(f"field '{key}' must be a list of integer token ids (>= 0), got {t!r} at [{i}]")
    return v


def _logit_bias(obj: dict) -> dict | None:
    v = obj.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RecordError(f"field 'logit_bias' must map token ids to numbers, got {_type_name(v)}")
    try:
        bias = {int(k): float(b) for k, b in v.items()}
    except (TypeError, ValueError):
        raise RecordError("field 'logit_bias' must map token ids to numbers") from None
    if any(b != b for b in bias.values()):  # NaN would make every logit NaN
        raise RecordError(f"field 'logit_bias' must map token ids to numbers, got NaN in {v!r}")
    return bias


def _structured(v: Any, key: str) -> dict:
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""
    if not isinstance(v, dict):
        raise RecordError(f"field '{key}' must be an object, got {_type_name(v)}")
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if v.get(k) not in (None, False)]
    if len(given) != 1 or set(v) - {"json", "regex", "choice", "grammar", "json_object"}:
        raise RecordError(f"field '{key}' takes exactly one of json, regex, choice, grammar, json_object; got "
                          f"{', '.join(sorted(v)) or 'none'}")
    kind = given[0]
    if kind == "choice" and not (isinstance(v["choice"], list) and v["choice"]
                                 and all(isinstance(c, str) for c in v["choice"])):
        raise RecordError(f"field '{key}.choice' must be a non-empty list of strings")
    if kind in ("regex", "grammar") and not isinstance(v[kind], str):
        raise RecordError(f"field '{key}.{kind}' must be a string")
    if kind == "json" and not isinstance(v["json"], (dict, str)):
        raise RecordError(f"field '{key}.json' must be a JSON schema object")
    return {kind: v[kind]}


def _response_format(v: Any) -> dict | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {schema}."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RecordError(f"field 'response_format' must be an object, got {_type_name(v)}")
    kind = v.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RecordError("field 'response_format.json_schema.schema' must be a JSON schema object")
        return {"json": schema}
    raise RecordError(f"field 'response_format.type' must be text, json_object or json_schema, got {kind!r}")


def extra_sampling(obj: dict, openai: str | None = None) -> dict:
    """vLLM SamplingParams fields of a record (None / absent ones left out). `openai`: the body's url,
    whose `logprobs` means what OpenAI says (chat: a bool with `top_logprobs`; completions: the top-k).
    vLLM's own names are read from a body too, as vLLM's server takes them as extra parameters."""
    if openai == "/v1/chat/completions":
        lp = obj.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise RecordError(f"field 'logprobs' must be true or false for chat completions, got {_type_name(lp)}")
        top = _integer(obj, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not lp:  # OpenAI and vLLM answer 400: the field would do nothing
            raise RecordError("field 'top_logprobs' needs 'logprobs': true")
        logprobs = (top or 0) if lp else None
    else:
        logprobs = _integer(obj, "logprobs", 0, MAX_LOGPROBS)
    if obj.get("stream"):  # a batch output line holds the whole answer
        raise RecordError("field 'stream' must be false or absent: a batch job writes each answer whole")
    if obj.get("echo"):  # vLLM's completions echo: the prompt before the text
        raise RecordError("field 'echo' is not supported: the output record holds the prompt already")
    unsupported = [k for k in UNSUPPORTED_KEYS if obj.get(k) not in (None, False) and not (k == "best_of"
                                                                                       and obj[k] == 1)]
    if unsupported:  # vLLM's fields moelight does not honour: refused, never dropped
        raise RecordError(f"field(s) {', '.join(unsupported)} not supported (no beam search, best_of, prompt "
                          "truncation; guided_* are vLLM's old names: give 'structured_outputs' or "
                          "'response_format')")
    out: dict = {
        "n": _integer(obj, "n", 1),
        "stop": _strings(obj, "stop"),
        "presence_penalty": _number(obj, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(obj, "frequency_penalty", -2.0, 2.0),
        "logit_bias": _logit_bias(obj),
        "logprobs": logprobs,
        "structured_outputs": _response_format(obj.get("response_format")),
        "min_tokens": _integer(obj, "min_tokens", 0),
        "repetition_penalty": _number(obj, "repetition_penalty", 1e-6, 100.0),
        "min_p": _number(obj, "min_p", 0.0, 1.0),
        "prompt_logprobs": _integer(obj, "prompt_logprobs", 0, MAX_LOGPROBS),
        "bad_words": _strings(obj, "bad_words"),
        "allowed_token_ids": _token_ids(obj, "allowed_token_ids"),
        "stop_token_ids": _token_ids(obj, "stop_token_ids"),
        "include_stop_str_in_output": _flag(obj, "include_stop_str_in_output"),
        "skip_special_tokens": _flag(obj, "skip_special_tokens"),
        "spaces_between_special_tokens": _flag(obj, "spaces_between_special_tokens"),
        "detokenize": _flag(obj, "detokenize"),
        "ignore_eos": _flag(obj, "ignore_eos"),
    }
    if obj.get("structured_outputs") is not None:
        if out["structured_outputs"] is not None:
            raise RecordError("give either 'structured_outputs' or 'response_format', not both")
        out["structured_outputs"] = _structured(obj["structured_outputs"], "structured_outputs")
    return {k: v for k, v in out.items() if v is not None}


def _flag(obj: dict, key: str) -> bool | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, bool):
        raise RecordError(f"field '{key}' must be true or false, got {_type_name(v)}")
    return v


JSONL_KEYS = {"n", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "response_format",
              "min_tokens", "repetition_penalty", "min_p", "prompt_logprobs", "bad_words", "allowed_token_ids",
              "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "structured_outputs",
              "detokenize", "ignore_eos", "max_completion_tokens", "echo", "spaces_between_special_tokens"}
