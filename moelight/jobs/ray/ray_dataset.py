"""A dataset file as a `ray.data.Dataset` of requests, checked the way a local run checks it.

Ray reads the bytes (`read_binary_files`: one task per file, files in parallel, on whichever node
holds them); our readers parse them inside those tasks, so ids (the line or row number where a
record has none), formats and every error message are those of a local run. The parse is
materialized and its problems raised in the driver before any replica is created: a bad record
costs no model load. Rows carry the request as JSON (`request`), its `id` and its `source`.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa

import workloads
from workloads.dataset import PARSERS, SKIP_HINT, _detect_jsonl_format, check_dataset_file, normalize_format
from workloads.errors import DatasetError, Problem
from workloads.readers import iter_json_lines, read_parquet
from workloads.readers.fields import RecordError
from workloads.request import Request

REQUEST_COLUMNS = ("id", "request", "source", "problem")


def request_to_json(r: Request) -> str:
    return json.dumps(asdict(r))


def request_from_json(text: str) -> Request:
    return Request(**json.loads(text))


def _row(r: Request | None, where: str = "", problem: str = "") -> dict:
    if r is None:
        return {"id": "", "request": "", "source": where, "problem": problem}
    return {"id": r.id, "request": request_to_json(r), "source": r.source, "problem": ""}


def parse_file(row: dict, fmt: str | None, turn: int, prompt_column: str) -> list[dict]:
    """One file's bytes -> one row per record (a request, or the problem that record has); a problem
    of the whole file is one row with no source, raised by the driver."""
    try:
        return _parse_file(row["path"], row["bytes"], fmt, turn, prompt_column)
    except DatasetError as e:
        return [_row(None, "", str(e))]


def _parse_file(label: str, data: bytes, fmt: str | None, turn: int, prompt_column: str) -> list[dict]:
    if fmt == "parquet" or (fmt is None and data[:4] == b"PAR1"):
        requests, problems = read_parquet(pa.BufferReader(data), label, prompt_column)
        fmt = "parquet"
    else:
        records, problems = iter_json_lines(data.splitlines(keepends=True), label)
        if not records:
            raise DatasetError.from_problems(label, problems, "No line could be read.") if problems else \
                DatasetError(f"{label}: file is empty (no records)")
        fmt = fmt or _detect_jsonl_format(label, records)
        if turn != 1 and fmt != "mtbench":
            raise DatasetError(f"turn={turn} applies to MT-Bench datasets only ({label} is {fmt})")
        requests = []
        for lineno, obj in records:
            where = f"{label}:{lineno}"
            try:
                requests.append(PARSERS[fmt](obj, where, lineno, turn))
            except RecordError as e:
                problems.append(Problem(where, str(e)))
    for r in requests:
        r.meta.setdefault("input_format", fmt)
    return [_row(r) for r in requests] + [_row(None, p.where, p.message) for p in problems]


def detect_format(path: Path, fmt: str | None) -> str:
    """The dataset's format from its first record, read in the driver (a few bytes) as a local run does."""
    fmt = normalize_format(fmt)
    if fmt is not None:
        return fmt
    with open(path, "rb") as f:
        head = f.read(4)
        if head == b"PAR1" or path.suffix.lower() in (".parquet", ".pq"):
            return "parquet"
        f.seek(0)
        lines = []
        for raw in f:
            lines.append(raw)
            if raw.strip():
                break
    records, _ = iter_json_lines(lines, str(path))
    if not records:
        return "jsonl"  # the parse reports what is wrong with the file
    return _detect_jsonl_format(str(path), records)


def _line_of(where: str) -> int:
    m = re.search(r"(\d+)$", where)
    return int(m.group(1)) if m else 0


def read_dataset(opts, finished: set[str], driver_max: int = 0):
    """(requests, input format, skipped problems, request count) for a RunOptions.

    The requests are a lazy `ray.data.Dataset` of rows {id, request}, or the rows themselves when the
    driver holds them anyway: with --num-requests (replication renames ids in request order) or when
    the file has no more than `driver_max` records (a take would only add a Ray Data execution).
    Raises DatasetError for bad records (all of them, in file order) unless opts.skip_bad_lines;
    duplicate ids are problems as in a local run; ids in `finished` (a resumed output) are dropped.
    """
    import ray

    path = Path(opts.dataset)
    label = str(opts.dataset)
    check_dataset_file(path, label)
    fmt = detect_format(path, opts.dataset_format)
    if opts.turn != 1 and fmt != "mtbench":
        raise DatasetError(f"turn={opts.turn} applies to MT-Bench datasets only ({label} is {fmt})")
    files = ray.data.read_binary_files(str(path.resolve()), include_paths=True)
    parsed = files.map(lambda row: row | {"path": label}).flat_map(
        parse_file, fn_kwargs={"fmt": fmt, "turn": opts.turn, "prompt_column": opts.prompt_column}).materialize()
    in_driver = opts.num_requests is not None or parsed.count() <= driver_max
    index = parsed.take_all() if in_driver else parsed.select_columns(["id", "source", "problem"]).take_all()
    fatal = [r["problem"] for r in index if r["problem"] and not r["source"]]
    if fatal:
        raise DatasetError(fatal[0])
    index.sort(key=lambda r: _line_of(r["source"]))
    problems = [Problem(r["source"], r["problem"]) for r in index if r["problem"]]
    seen: dict[str, str] = {}
    duplicates: set[str] = set()  # sources of the second and later records of an id
    for r in index:
        if r["problem"]:
            continue
        if r["id"] in seen:
            problems.append(Problem(r["source"], f"duplicate id {r['id']!r} (first at {seen[r['id']]})"))
            duplicates.add(r["source"])
        else:
            seen[r["id"]] = r["source"]
    problems.sort(key=lambda p: _line_of(p.where))
    if problems and not opts.skip_bad_lines:
        raise DatasetError.from_problems(label, problems, SKIP_HINT)
    if not seen:
        raise DatasetError(f"{label}: no usable requests" + (" (all were skipped)" if problems else ""))
    total = len(seen)
    if in_driver:
        rows = [r for r in index if not r["problem"] and r["source"] not in duplicates]
        if opts.num_requests is not None:
            requests = workloads.replicate([request_from_json(r["request"]) for r in rows], opts.num_requests)
            total = len(requests)
            rows = [_row(r) for r in requests]
        return [{"id": r["id"], "request": r["request"]} for r in rows if r["id"] not in finished], fmt, problems, total
    good = parsed.filter(lambda r: not r["problem"] and r["source"] not in duplicates)
    if finished:
        good = good.filter(lambda r: r["id"] not in finished)
    return good.select_columns(["id", "request"]), fmt, problems, total
