"""A dataset file as requests for a Ray job, checked the way a local run checks it.

A file of up to DRIVER_PARSE_MAX_BYTES (or any job with --num-requests, whose replication renames
ids in request order) is parsed by the driver with the local run's reader: the driver holds the
requests anyway, and a Ray Data execution would only add start-up. A larger file is read by Ray
(`read_binary_files`: one task per file, on whichever node holds it) and parsed inside those tasks
by the same parser (`workloads.parse_dataset`), so ids (the line or row number where a record has
none), formats and every error message are those of a local run. Either way every problem is
raised in the driver before any replica is created: a bad record costs no model load. Requests
travel as Arrow rows (`Request.to_row`): typed columns, free-form nested fields as JSON text.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import workloads
from workloads import DatasetError, Problem, Request

DRIVER_PARSE_MAX_BYTES = 64 << 20  # a dataset file this small is parsed by the driver itself
_EMPTY_ROW = {f.name: None for f in fields(Request)} | {"meta": "{}", "followups": []}


def _problem_row(where: str, message: str) -> dict:
    return _EMPTY_ROW | {"id": "", "source": where, "problem": message}


def parse_file(row: dict, fmt: str | None, turn: int, prompt_column: str) -> list[dict]:
    """One file's bytes (a Ray task) -> one row per record: a request, or the problem that record has;
    a problem of the whole file is one row with no source, raised by the driver."""
    try:
        requests, problems, _ = workloads.parse_dataset(row["bytes"], row["path"], fmt, turn, prompt_column,
                                                        hint_style="cli")
    except DatasetError as e:
        return [_problem_row("", str(e))]
    return [r.to_row() | {"problem": ""} for r in requests] + [_problem_row(p.where, p.message) for p in problems]


def read_dataset(opts, finished: set[str]):
    """(requests, input format, skipped problems, request count) for a RunOptions: the requests are
    Request objects when the driver parsed the file (all of them: the caller drops the finished ones
    after checking the output is this job's), else a lazy `ray.data.Dataset` of request rows.
    Raises DatasetError for bad records (all of them, in file order) unless opts.skip_bad_lines;
    duplicate ids are problems as in a local run; ids in `finished` (a resumed output) are dropped from a
    lazy dataset."""
    path = Path(opts.dataset)
    workloads.check_dataset_file(path, str(opts.dataset), opts.dataset_format, hint_style="cli")
    if opts.num_requests is not None or path.stat().st_size <= DRIVER_PARSE_MAX_BYTES:
        loaded = workloads.load_dataset(opts.dataset, opts.dataset_format, turn=opts.turn,
                                        num_requests=opts.num_requests, skip_bad_lines=opts.skip_bad_lines,
                                        prompt_column=opts.prompt_column, hint_style="cli")
        return loaded.requests, loaded.format, loaded.skipped, len(loaded.requests)
    return _read_with_ray(opts, path, finished)


def _read_with_ray(opts, path: Path, finished: set[str]):
    import ray

    label = str(opts.dataset)
    fmt = workloads.normalize_format(opts.dataset_format)
    files = ray.data.read_binary_files(str(path.resolve()), include_paths=True)
    parsed = files.map(lambda row: row | {"path": label}).flat_map(
        parse_file, fn_kwargs={"fmt": fmt, "turn": opts.turn, "prompt_column": opts.prompt_column}).materialize()
    index = parsed.select_columns(["id", "source", "problem", "meta"]).take_all()
    fatal = [r["problem"] for r in index if r["problem"] and not r["source"]]
    if fatal:
        raise DatasetError(fatal[0])
    index.sort(key=lambda r: workloads.line_of(Problem(r["source"], "")))
    problems = [Problem(r["source"], r["problem"]) for r in index if r["problem"]]
    seen: dict[str, str] = {}
    duplicates: set[str] = set()  # sources of the second and later records of an id
    for r in index:
        if r["problem"]:
            continue
        if r["id"] in seen:
            problems.append(Problem(r["source"], workloads.duplicate_id(r["id"], seen[r["id"]])))
            duplicates.add(r["source"])
        else:
            seen[r["id"]] = r["source"]
    problems.sort(key=workloads.line_of)
    if problems and not opts.skip_bad_lines:
        raise DatasetError.from_problems(label, problems, workloads.skip_hint("cli"))
    if not seen:
        raise DatasetError(f"{label}: no usable requests" + (" (all were skipped)" if problems else ""))
    first = next(r for r in index if not r["problem"])
    fmt = json.loads(first["meta"]).get("input_format", fmt or "jsonl")
    good = parsed.filter(lambda r: not r["problem"] and r["source"] not in duplicates and r["id"] not in finished)
    return good.drop_columns(["problem"]), fmt, problems, len(seen)
