"""Parquet datasets: one row per request with a text prompt column, or a `messages` column (OpenAI
chat turns, as a list of structs or as JSON text, such as moelight's own parquet output writes them).

A row is read as a jsonl record is (`prompt_jsonl.parse_prompt_record`): the prompt column, `id`,
`max_tokens`, sampling columns (`temperature`, `n`, `stop`, `logprobs`, ...), `messages`, and every
other column kept in the result's `meta`. Rows are reported as ``file:row N`` (1-based) in errors,
like lines in jsonl.
"""

from __future__ import annotations

import json
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
    chat_only = prompt_column == "prompt" and prompt_column not in names and "messages" in names
    if prompt_column not in names and not chat_only:
        raise DatasetError(
            f"{label}: no column '{prompt_column}' (columns: {', '.join(names) or 'none'}); "
            f"pass the prompt column's name ({hint})"
        )
    if table.num_rows == 0:
        raise DatasetError(f"{label}: file is empty (0 rows)")
    ptype = None if chat_only else table.schema.field(prompt_column).type
    if ptype is not None and not _holds_strings(ptype):
        raise DatasetError(f"{label}: column '{prompt_column}' must hold strings, has type {ptype}")
    binary = [f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
              or pa.types.is_fixed_size_binary(f.type)]
    if binary:  # bytes kept in meta could not be written after the run: a column-wide fault, said once
        raise DatasetError(f"{label}: column(s) {', '.join(map(repr, binary))} hold bytes, which a JSON output cannot "
                           "hold (other columns are kept in each result's meta): drop them, or store them as text")
    requests: list[Request] = []
    problems: list[Problem] = []
    for i, row in enumerate(table.to_pylist(), start=1):
        where = f"{label}:row {i}"
        record = dict(row)
        if isinstance(record.get("messages"), str):  # JSON text, as a parquet output holds nested fields
            try:
                record["messages"] = json.loads(record["messages"])
            except json.JSONDecodeError as e:
                problems.append(Problem(where, f"column 'messages' is not JSON ({e.msg})"))
                continue
        try:
            requests.append(parse_prompt_record(record, where, i, prompt_key=prompt_column, id_key=id_column))
        except RecordError as e:
            problems.append(Problem(where, str(e)))
    return requests, problems
