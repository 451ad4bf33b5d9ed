"""A record field kept in meta whose name is close to one moelight reads (`temprature`) is most likely a
typo that silently left the request on the run's defaults: said as a warning, with the name meant. An
OpenAI body's fields the reader does not read are said too (vLLM's server logs the fields it ignores)."""

from __future__ import annotations

import difflib

from ..request import Request
from .prompt_jsonl import KNOWN_KEYS
from .sampling_options import UNSUPPORTED_KEYS

IGNORED = {"input_format"}  # meta the reader adds itself
# what openai_batch.parse_openai_record reads of a body (a jsonl record's own id / followups are not body fields)
BODY_KEYS = (KNOWN_KEYS - {"id", "followups", "max_new_tokens"}) | {"model", "top_logprobs", "stream",
                                                                    "cache_salt", *UNSUPPORTED_KEYS}


def misspelled_fields(requests: list[Request]) -> list[str]:
    """One warning per meta field name close to a field a record is read for, with its count and first place."""
    out = []
    for key, (count, first) in _tally((r.source, key) for r in requests for key in r.meta).items():
        if key in IGNORED or key in KNOWN_KEYS or len(key) < 4:
            continue
        close = _close(key, KNOWN_KEYS)
        if close:
            out.append(f"field '{key}' ({count} record(s), first at {first}) is not one moelight reads and is kept "
                       f"in meta; did you mean '{close}'?")
    return out


def unread_body_fields(bodies: list[tuple[str, dict]]) -> list[str]:
    """One warning per field name of OpenAI bodies ((where, body) pairs) the reader does not read, with its
    count and first place: a close name is most likely a typo (did you mean), any other is ignored."""
    out = []
    unread = ((where, key) for where, body in bodies for key in body if key not in BODY_KEYS)
    for key, (count, first) in _tally(unread).items():
        close = _close(key, BODY_KEYS) if len(key) >= 4 else ""
        what = f"did you mean '{close}'?" if close else "moelight ignores it"
        out.append(f"field 'body.{key}' ({count} record(s), first at {first}) is not one moelight reads: {what}")
    return out


def _tally(places) -> dict[str, tuple[int, str]]:
    """(where, field name) pairs -> per name: how many, and the first place."""
    seen: dict[str, tuple[int, str]] = {}
    for where, key in places:
        count, first = seen.get(key, (0, where))
        seen[key] = (count + 1, first)
    return seen


def _close(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.85)
    return close[0] if close else ""
