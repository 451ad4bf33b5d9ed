"""Reading back what a (possibly killed) run already wrote, for ``--resume``.

A kill can cut the last jsonl line mid-write; that line is treated as not written
(the request simply runs again) and ``repair_jsonl`` cuts it off before appending.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import DatasetError, Problem
from .parquet_io import read_parquet_records

PARQUET_SUFFIXES = (".parquet", ".pq")


def sidecar_path(path: str | Path) -> Path:
    """Where a parquet output streams its rows until ``close`` converts them."""
    path = Path(path)
    return path.with_name(path.name + ".partial.jsonl")


def is_parquet_path(path: str | Path) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


def read_jsonl_results(path: str | Path) -> list[dict]:
    """Every complete record of a result jsonl; a cut last line is ignored, a bad middle line is an error."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    records, problems = [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        is_last = i == len(lines) - 1  # no newline after it: the write was cut
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if is_last:
                continue
            problems.append(Problem(f"{path}:{i + 1}", f"unreadable result line ({e})"))
            continue
        if not isinstance(obj, dict):
            if not is_last:
                problems.append(Problem(f"{path}:{i + 1}", "result line is not a JSON object"))
            continue
        records.append(obj)
    if problems:
        hint = "This does not look like a moelight output file."
        raise DatasetError.from_problems(str(path), problems, hint)
    return records


def _cut_tail(data: bytes) -> int | None:
    """Where an incomplete last line (no trailing newline, not a whole JSON object) begins; None if the
    data ends in a complete line, or in a whole object that only lacks its newline."""
    if not data or data.endswith(b"\n"):
        return None
    cut = data.rfind(b"\n") + 1
    try:
        if isinstance(json.loads(data[cut:].decode("utf-8")), dict):
            return None
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    return cut


def partial_tail_bytes(path: str | Path) -> int:
    """Bytes of an incomplete last line that `repair_jsonl` would cut (a run killed mid-write)."""
    path = Path(path)
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        size, block = f.seek(0, os.SEEK_END), 1 << 16
        while True:  # read back from the end until the last line's start is in view (outputs can be GBs)
            start = max(0, size - block)
            f.seek(start)
            data = f.read()
            if start == 0 or b"\n" in data[:-1]:
                break
            block *= 4
    if start:  # the first line read may be cut by the seek: only the lines after it count
        data = data[data.index(b"\n") + 1:]
    cut = _cut_tail(data)
    return 0 if cut is None else len(data) - cut


def repair_jsonl(path: str | Path) -> int:
    """Cut an incomplete last line (no trailing newline) off ``path``; return bytes dropped.

    A complete JSON object that only lacks its newline is kept and the newline added.
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        cut = _cut_tail(data)
        if cut is None:
            if data and not data.endswith(b"\n"):
                f.write(b"\n")
            return 0
        tail = data[cut:]
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
        return len(tail)


def record_id(obj: dict) -> str | None:
    # OpenAI Batch output: "id" is the batch line id, the request is "custom_id".
    if "custom_id" in obj and "response" in obj:
        return str(obj["custom_id"])
    rid = obj.get("id")
    return None if rid is None else str(rid)


def read_results(path: str | Path) -> list[dict]:
    """All records of an output (jsonl, OpenAI output, parquet plus its sidecar)."""
    path = Path(path)
    if is_parquet_path(path):
        records = read_parquet_records(path) if path.exists() else []
        return records + read_jsonl_results(sidecar_path(path))
    return read_jsonl_results(path)


def finished_ids(output_path: str | Path) -> set[str]:
    """Ids of the requests an output already holds (empty when it does not exist).

    Requests that ended in an error record count as finished: they would fail again.
    """
    ids = set()
    for obj in read_results(output_path):
        rid = record_id(obj)
        if rid is not None:
            ids.add(rid)
    return ids
