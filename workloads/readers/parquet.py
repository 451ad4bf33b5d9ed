"""Parquet datasets: one row per request with a text prompt column.

Rows are reported as ``file:row N`` (1-based) in errors, like lines in jsonl.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DatasetError, Problem
from ..request import Request
from .fields import RecordError, get_id, get_text, opt_int, sampling_fields

OPTIONAL_COLUMNS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed")


def read_parquet(path: Path, label: str, prompt_column: str = "prompt", id_column: str = "id",
                 hint: str = "prompt_column=... / --prompt-column") -> tuple[list[Request], list[Problem]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{label}: not a readable parquet file ({e})") from None
    names = table.column_names
    if prompt_column not in names:
        raise DatasetError(
            f"{label}: no column '{prompt_column}' (columns: {', '.join(names) or 'none'}); "
            f"pass the prompt column's name ({hint})"
        )
    if table.num_rows == 0:
        raise DatasetError(f"{label}: file is empty (0 rows)")
    ptype = table.schema.field(prompt_column).type
    if not (pa.types.is_string(ptype) or pa.types.is_large_string(ptype)):
        raise DatasetError(f"{label}: column '{prompt_column}' must hold strings, has type {ptype}")
    keep = [c for c in (prompt_column, id_column, *OPTIONAL_COLUMNS) if c in names]
    rows = table.select(keep).to_pylist()
    requests: list[Request] = []
    problems: list[Problem] = []
    for i, row in enumerate(rows, start=1):
        where = f"{label}:row {i}"
        try:
            prompt = get_text(row, prompt_column)
            rid = get_id(row, id_column, str(i)) if id_column in row else str(i)
            requests.append(Request(
                id=rid, prompt=prompt, source=where,
                max_new_tokens=opt_int(row, "max_new_tokens", "max_tokens", minimum=1),
                **sampling_fields(row),
            ))
        except RecordError as e:
            problems.append(Problem(where, str(e)))
    return requests, problems
