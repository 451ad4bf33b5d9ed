"""Parquet datasets: one row per request with a text prompt column.

A row is read as a jsonl record is (`prompt_jsonl.parse_prompt_record`): the prompt column, `id`,
`max_tokens`, sampling columns (`temperature`, `n`, `stop`, `logprobs`, ...), `messages`, and every
other column kept in the result's `meta`. Rows are reported as ``file:row N`` (1-based) in errors,
like lines in jsonl.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DatasetError, Problem
from ..request import Request
from .fields import RecordError
from .prompt_jsonl import parse_prompt_record


def _holds_strings(t: pa.DataType) -> bool:
    """Strings, also dictionary-encoded (an arrow `dictionary_encode()`, a pandas Categorical)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t)


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
    if not _holds_strings(ptype):
        raise DatasetError(f"{label}: column '{prompt_column}' must hold strings, has type {ptype}")
    requests: list[Request] = []
    problems: list[Problem] = []
    for i, row in enumerate(table.to_pylist(), start=1):
        where = f"{label}:row {i}"
        record = {k: v for k, v in row.items() if k not in (prompt_column, id_column)}
        record["prompt"] = row[prompt_column]
        if row.get(id_column) is not None:
            record["id"] = row[id_column]
        try:
            requests.append(parse_prompt_record(record, where, i))
        except RecordError as e:
            problems.append(Problem(where, str(e)))
    return requests, problems
