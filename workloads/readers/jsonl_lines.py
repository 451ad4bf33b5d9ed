"""Reading a jsonl file line by line without stopping at the first bad line."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ..errors import Problem


def read_json_lines(path: Path, label: str) -> tuple[list[tuple[int, dict]], list[Problem]]:
    """Return ``(lineno, object)`` for every good line and a Problem for every bad one.

    Blank lines are skipped silently; a line must hold one JSON object. Bytes are decoded
    per line so one bad UTF-8 sequence costs one line, not the file.
    """
    with open(path, "rb") as f:
        return iter_json_lines(f, label)


def iter_json_lines(lines: Iterable[bytes], label: str) -> tuple[list[tuple[int, dict]], list[Problem]]:
    """read_json_lines over raw lines already in hand (a file's bytes read by Ray)."""
    records: list[tuple[int, dict]] = []
    problems: list[Problem] = []
    for lineno, raw in enumerate(lines, start=1):
        where = f"{label}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            problems.append(Problem(where, f"not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        if lineno == 1:
            line = line.lstrip("\ufeff")  # tolerate a BOM written by some editors
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(Problem(where, f"invalid JSON ({e.msg} at column {e.colno})"))
            continue
        if not isinstance(obj, dict):
            problems.append(Problem(where, f"expected a JSON object, got {type(obj).__name__}"))
            continue
        records.append((lineno, obj))
    return records, problems
