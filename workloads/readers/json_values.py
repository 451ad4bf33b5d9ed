"""Record values the output's JSON must hold, checked when the record is read: a value that cannot be
written (a lone surrogate, bytes) found after generation would cost the whole run, so it is refused
by its line before any model loads, and a value that has a JSON form is given it here."""

from __future__ import annotations

import datetime
import decimal
import math
from typing import Any

from .fields import RecordError, check_text


def check_strings(value: Any, where: str = "") -> None:
    """Every string of a JSON record (keys too) is text: a \\udc00-style escape outside the prompt (an
    id, a turn's `name`, an extra field) would fail at write time, after the run."""
    if isinstance(value, str):
        check_text(value, f"field '{where}'")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, f"a key in field '{where}'" if where else "a field name")
            check_strings(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_strings(v, f"{where}[{i}]")


def json_safe(value: Any, where: str) -> Any:
    """`value` (a meta field, `where` its name) as JSON holds it: a date or time as ISO 8601 text, a
    decimal as its exact text, NaN and infinities as null (strict JSON has neither); bytes and other
    types without a JSON form are refused."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    kind = "bytes" if isinstance(value, (bytes, bytearray, memoryview)) else type(value).__name__
    raise RecordError(f"field '{where}' holds {kind}, which a JSON output cannot hold (it would be kept in the "
                      "result's meta): drop that column or field, or give it as text")


def json_safe_meta(meta: dict) -> dict:
    """json_safe over every meta field."""
    return {k: json_safe(v, k) for k, v in meta.items()}
