"""A record field kept in meta whose name is close to one moelight reads (`temprature`) is most likely a
typo that silently left the request on the run's defaults: said as a warning, with the name meant."""

from __future__ import annotations

import difflib

from ..request import Request
from .prompt_jsonl import KNOWN_KEYS

IGNORED = {"input_format"}  # meta the reader adds itself


def misspelled_fields(requests: list[Request]) -> list[str]:
    """One warning per meta field name close to a field a record is read for, with its count and first place."""
    seen: dict[str, tuple[int, str]] = {}
    for r in requests:
        for key in r.meta:
            count, first = seen.get(key, (0, r.source))
            seen[key] = (count + 1, first)
    out = []
    for key, (count, first) in seen.items():
        if key in IGNORED or key in KNOWN_KEYS or len(key) < 4:
            continue
        close = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1, cutoff=0.85)
        if close:
            out.append(f"field '{key}' ({count} record(s), first at {first}) is not one moelight reads and is kept "
                       f"in meta; did you mean '{close[0]}'?")
    return out
