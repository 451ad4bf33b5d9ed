"""``read_dataset``: pick a reader by content/extension, collect every bad record, replicate.

All problems of a file are reported in one ``DatasetError`` (file:line each) so a user
fixes the file in one pass; ``skip_bad_lines`` trades that for going on without them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa

from .errors import DatasetError, Problem, format_problems
from .readers import (
    looks_like_mtbench,
    looks_like_openai_batch,
    looks_like_prompt_jsonl,
    parse_mtbench,
    parse_openai_record,
    parse_prompt_record,
    read_json_lines,
    read_parquet,
)
from .readers.field_names import misspelled_fields, unread_body_fields
from .readers.fields import RecordError
from .readers.json_values import check_strings
from .request import Request

log = logging.getLogger("workloads")

FORMATS = ("mtbench", "jsonl", "openai", "parquet")
UNREAD_SUFFIXES = (".csv", ".tsv", ".xlsx", ".xls")  # tables a user may hand over as they are
ALIASES = {"prompt": "jsonl", "json": "jsonl", "openai_batch": "openai", "batch": "openai",
           "mt-bench": "mtbench", "mt_bench": "mtbench", "pq": "parquet"}
PARSERS: dict[str, Callable[..., Request]] = {
    "mtbench": parse_mtbench,
    "jsonl": parse_prompt_record,
    "openai": parse_openai_record,
}
# how an error tells the user what to pass: the Python keyword, or the `moelight run` option
HINTS = {
    "python": {"skip": "skip_bad_lines=True", "format": "format=", "prompt_column": "prompt_column="},
    "cli": {"skip": "--skip-bad-lines", "format": "--format", "prompt_column": "--prompt-column"},
}
SKIP_HINT = "Fix these records, or pass skip_bad_lines=True (--skip-bad-lines) to go on without them."


def skip_hint(style: str = "python") -> str:
    return f"Fix these records, or pass {HINTS[style]['skip']} to go on without them."


@dataclass
class LoadedDataset:
    """Requests read plus the records skipped (only non-empty with ``skip_bad_lines``)."""

    requests: list[Request]
    format: str
    skipped: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # fields kept in meta that look like misspelled ones


def normalize_format(fmt: str | None) -> str | None:
    if fmt is None:
        return None
    key = fmt.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        raise DatasetError(f"unknown dataset format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return key


def _is_parquet(source: Path | bytes) -> bool:
    if isinstance(source, bytes):
        return source[:4] == b"PAR1"
    if source.suffix.lower() in (".parquet", ".pq"):
        return True
    with open(source, "rb") as f:
        return f.read(4) == b"PAR1"


def parse_dataset(source: Path | bytes, label: str, fmt: str | None = None, turn: int = 1,
                  prompt_column: str = "prompt", id_column: str = "id",
                  hint_style: str = "python", warnings: list[str] | None = None,
                  ) -> tuple[list[Request], list[Problem], str]:
    """(requests, problems, format) of one dataset, from its path or its bytes (a file Ray read):
    the one parse every reader of a dataset runs, so ids and messages are the same everywhere.
    Problems of single records are returned; a file that cannot be read at all raises DatasetError.
    `warnings`: given, gets the OpenAI body fields no reader reads (unread_body_fields)."""
    if fmt == "parquet" or (fmt is None and _is_parquet(source)):
        table = pa.BufferReader(source) if isinstance(source, bytes) else source
        requests, problems = read_parquet(table, label, prompt_column, id_column,
                                          hint=HINTS[hint_style]["prompt_column"])
        fmt = "parquet"
    else:
        records, problems = read_json_lines(source, label)
        if not records and not problems:
            raise DatasetError(f"{label}: file is empty (no records)")
        if not records:
            raise DatasetError.from_problems(label, problems, "No line could be read.")
        fmt = fmt or detect_jsonl_format(label, records, hint_style)
        if turn != 1 and fmt != "mtbench":
            raise DatasetError(f"turn={turn} applies to MT-Bench datasets only ({label} is {fmt})")
        parse = PARSERS[fmt]
        requests, bodies = [], []
        for lineno, obj in records:
            where = f"{label}:{lineno}"
            try:
                check_strings(obj)
                requests.append(parse(obj, where, lineno, turn))
            except RecordError as e:
                problems.append(Problem(where, str(e), refused_id(obj) if fmt == "openai" else None))
            else:
                if fmt == "openai":
                    bodies.append((where, obj["body"]))
        if warnings is not None:
            warnings += unread_body_fields(bodies)
    for r in requests:
        r.meta.setdefault("input_format", fmt)
    return requests, problems, fmt


def refused_id(obj: dict) -> str | None:
    """The custom_id of a refused OpenAI record, where it is one an output line can carry."""
    cid = obj.get("custom_id")
    if isinstance(cid, bool) or not isinstance(cid, (str, int)) or not str(cid).strip():
        return None
    try:
        str(cid).encode("utf-8")
    except UnicodeEncodeError:
        return None
    return str(cid)


def answerable(requests: list[Request], problems: list[Problem]) -> list[Problem]:
    """`problems`, the custom_id kept only on the first refusal of an id no request has: one output line an id."""
    seen = {r.id for r in requests}
    out = []
    for p in problems:
        if p.id is not None and p.id in seen:
            p = replace(p, id=None)
        seen.add(p.id)
        out.append(p)
    return out


def detect_jsonl_format(label: str, records: list[tuple[int, dict]], hint_style: str = "python") -> str:
    """The format of the first record that shows one, so a bad first record is reported as a bad record of
    the file (and skipped with skip_bad_lines) instead of stopping the job."""
    for _, obj in records:
        if looks_like_openai_batch(obj):
            return "openai"
        if looks_like_mtbench(obj):
            return "mtbench"
        if looks_like_prompt_jsonl(obj):
            return "jsonl"
    lineno, obj = records[0]
    keys = ", ".join(sorted(obj)) or "none"
    raise DatasetError(
        f"{label}:{lineno}: cannot tell the dataset format from this record (keys: {keys}); "
        f"expected 'prompt'/'messages' (jsonl), 'turns' (mtbench) or 'custom_id'+'body' (openai), "
        f"or pass {HINTS[hint_style]['format']} one of {', '.join(FORMATS)}"
    )


def duplicate_id(rid: str, first: str) -> str:
    """The problem of a second record with id `rid` (the first at `first`, ``file:line``); when that id is
    the first record's line number, that record may have had no id at all, and the message says so."""
    implicit = rid.isdigit() and line_of(Problem(first, "")) == int(rid)
    hint = "; a record without an id takes its line (or row) number as its id" if implicit else ""
    return f"duplicate id {rid!r} (first at {first}{hint})"


def check_duplicates(requests: list[Request], problems: list[Problem]) -> list[Request]:
    seen: dict[str, str] = {}
    kept = []
    for r in requests:
        if r.id in seen:
            problems.append(Problem(r.source, duplicate_id(r.id, seen[r.id])))
            continue
        seen[r.id] = r.source
        kept.append(r)
    return kept


def line_of(p: Problem) -> int:
    """Line (or row) number at the end of ``file:17`` / ``file:row 17``, to list problems in file order."""
    m = re.search(r"(\d+)$", p.where)
    return int(m.group(1)) if m else 0


def check_dataset_file(path: Path, label: str, fmt: str | None = None, hint_style: str = "python") -> None:
    """A dataset path that exists, is a file, is not empty (a pipe's size says nothing: it is read) and, with
    no `fmt` given, is not named as a format no reader takes (`check_readable_format`)."""
    if not path.exists():
        raise DatasetError(f"{label}: dataset file does not exist")
    if path.is_dir():
        raise DatasetError(f"{label}: is a directory, expected a dataset file")
    if path.is_file() and path.stat().st_size == 0:
        raise DatasetError(f"{label}: file is empty")
    check_readable_format(path, label, fmt, hint_style)


def check_readable_format(path: Path, label: str, fmt: str | None, hint_style: str = "python") -> None:
    """A table of another format (.csv, .tsv, a spreadsheet) is named as such, not as an invalid JSON line
    on every line; with a format given, or parquet bytes under that name, it is read as asked."""
    suffix = path.suffix.lower()
    if fmt is not None or suffix not in UNREAD_SUFFIXES or (path.is_file() and _is_parquet(path)):
        return
    raise DatasetError(
        f"{label}: moelight reads no {suffix} datasets; it reads {', '.join(FORMATS)} (jsonl: one JSON object a "
        f"line with a 'prompt' or 'messages'; parquet: a prompt column): convert the file to one of these, or "
        f"pass {HINTS[hint_style]['format']} if its content already is one")


def _source(path: Path) -> Path | bytes:
    """The dataset as the readers take it: a file by its path, a pipe (a named fifo, /dev/stdin) by its
    bytes, read once, since a pipe cannot be opened twice (the format sniff, then the read)."""
    return path if path.is_file() else path.read_bytes()


def load_dataset(path: str | Path, format: str | None = None, turn: int = 1,
                 num_requests: int | None = None, skip_bad_lines: bool = False,
                 prompt_column: str = "prompt", id_column: str = "id", hint_style: str = "python") -> LoadedDataset:
    """Like ``read_dataset`` but also returns the detected format and the skipped records.
    ``hint_style``: "python" (errors name keyword arguments) or "cli" (they name `moelight run` options)."""
    label = str(path)
    path = Path(path)
    fmt = normalize_format(format)
    if not isinstance(turn, int) or turn < 1:
        raise DatasetError(f"turn must be an integer >= 1, got {turn!r}")
    if num_requests is not None and (not isinstance(num_requests, int) or num_requests < 1):
        raise DatasetError(f"num_requests must be a positive integer, got {num_requests!r}")
    check_dataset_file(path, label, fmt, hint_style)

    body_warnings: list[str] = []
    requests, problems, fmt = parse_dataset(_source(path), label, fmt, turn, prompt_column, id_column, hint_style,
                                            body_warnings)
    if fmt != "parquet" and (prompt_column, id_column) != ("prompt", "id"):
        raise DatasetError(f"{label}: {HINTS[hint_style]['prompt_column']} and the id column name parquet columns; "
                           f"this dataset is {fmt}, whose records give `prompt` (or `messages`) and `id`: drop it")
    requests = check_duplicates(requests, problems)
    problems.sort(key=line_of)
    problems = answerable(requests, problems)

    if problems and not skip_bad_lines:
        raise DatasetError.from_problems(label, problems, skip_hint(hint_style))
    if problems:
        log.warning("%s: skipped %d bad record(s):\n%s", label, len(problems), format_problems(problems))
    if not requests:
        raise DatasetError(f"{label}: no usable requests" + (" (all were skipped)" if problems else ""))
    warnings = [f"{label}: {w}" for w in misspelled_fields(requests) + body_warnings]
    for w in warnings:
        log.warning("%s", w)
    if num_requests is not None:
        requests = replicate(requests, num_requests)
    return LoadedDataset(requests=requests, format=fmt, skipped=problems, warnings=warnings)


def read_dataset(path: str | Path, format: str | None = None, turn: int = 1,
                 num_requests: int | None = None, skip_bad_lines: bool = False,
                 prompt_column: str = "prompt", id_column: str = "id") -> list[Request]:
    """Read a dataset file into requests.

    ``format``: mtbench | jsonl | openai | parquet (None: detected from extension/content).
    ``turn``: MT-Bench only; k asks turns 1..k as one conversation.
    ``num_requests``: cycle (or truncate) to exactly this many requests.
    """
    return load_dataset(path, format, turn, num_requests, skip_bad_lines, prompt_column,
                        id_column).requests


def replicate(requests: list[Request], k: int) -> list[Request]:
    """Cycle through ``requests`` to exactly ``k`` (MoE-Lightning fills big batches this way).

    With k <= len the first k keep their ids; otherwise every copy gets ``"{id}#{r}"``
    (r = replica number, from 0) so ids stay unique for output and resume.
    """
    n = len(requests)
    if k <= n:
        return requests[:k]
    out = []
    for i in range(k):
        r, base = divmod(i, n)
        src = requests[base]
        meta = {**src.meta, "original_id": src.id, "replica": r}
        out.append(replace(src, id=f"{src.id}#{r}", meta=meta, messages=_copy_msgs(src.messages),
                           followups=list(src.followups)))
    return out


def _copy_msgs(messages: list[dict] | None) -> list[dict] | None:
    return None if messages is None else [dict(m) for m in messages]
