"""Result records <-> parquet tables.

A result's own fields have one type in every file (`RESULT_TYPES`), whatever rows a run happens to
hold, so outputs of several runs (or a resumed one) read as one dataset; its nested or mixed fields
(messages, turns, meta, error, logprobs, stop_reason: a token id or a string) are JSON text, named in
the schema metadata. Other columns (a dataset's own) take the type their values share, or JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

JSON_COLUMNS_KEY = b"moelight.json_columns"


def _column_type(values: list) -> pa.DataType | None:
    """The arrow type for a column's non-null values, or None to store them as JSON."""
    vals = [v for v in values if v is not None]
    if not vals:
        return pa.string()
    if all(isinstance(v, str) for v in vals):
        return pa.string()
    if all(isinstance(v, bool) for v in vals):
        return pa.bool_()
    if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        return pa.int64()
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
        return pa.float64()
    if all(isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
           for v in vals):
        return pa.list_(pa.int64())
    if all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in vals):
        return pa.list_(pa.string())
    if all(isinstance(v, list) and all(isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in x) for x in v) for v in vals):
        return pa.list_(pa.list_(pa.int64()))
    return None


RESULT_TYPES = {
    "id": pa.string(), "prompt": pa.string(), "output": pa.string(), "finish_reason": pa.string(),
    "model": pa.string(), "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(),
    "output_token_ids": pa.list_(pa.int64()), "cumulative_logprob": pa.float64(), "turns_cut": pa.int64(),
    "outputs_text": pa.list_(pa.string()), "outputs_token_ids": pa.list_(pa.list_(pa.int64())),
    "outputs_finish_reason": pa.list_(pa.string()),
}
RESULT_JSON = {"messages", "turns", "meta", "error", "logprobs", "prompt_logprobs", "outputs", "stop_reason"}

SAMPLE_COLUMNS = {"output": "outputs_text", "output_token_ids": "outputs_token_ids",
                  "finish_reason": "outputs_finish_reason"}


def with_sample_columns(record: dict) -> dict:
    """A record with `n` samples gets each sample field as a list column too (outputs_text, ...), so a
    parquet reader sees every sample without parsing the `outputs` JSON."""
    samples = record.get("outputs")
    if not isinstance(samples, list):
        return record
    return record | {col: [o.get(key) for o in samples] for key, col in SAMPLE_COLUMNS.items()}


def records_to_table(records: list[dict]) -> pa.Table:
    records = [with_sample_columns(r) for r in records]
    keys: list[str] = []
    for r in records:
        keys.extend(k for k in r if k not in keys)
    # every result field a column in every file (null where no row has it): several runs' outputs read as
    # one dataset, whichever rows each happened to hold
    keys += [k for k in (*RESULT_TYPES, *sorted(RESULT_JSON)) if k not in keys]
    arrays, json_cols = {}, []
    for k in keys:
        values = [r.get(k) for r in records]
        typ = None if k in RESULT_JSON else RESULT_TYPES.get(k) or _column_type(values)
        if typ is not None:
            try:
                arrays[k] = pa.array(values, type=typ)
                continue
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):  # a value the type cannot hold
                pass
        json_cols.append(k)
        arrays[k] = pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values],
                             type=pa.string())
    table = pa.table(arrays)
    return table.replace_schema_metadata({JSON_COLUMNS_KEY: json.dumps(json_cols).encode()})


def table_to_records(table: pa.Table) -> list[dict]:
    meta = table.schema.metadata or {}
    json_cols = json.loads(meta.get(JSON_COLUMNS_KEY, b"[]"))
    rows = table.to_pylist()
    for row in rows:
        for k in json_cols:
            if row.get(k) is not None:
                row[k] = json.loads(row[k])
    return rows


def write_parquet_atomic(path: Path, records: list[dict]) -> None:
    """Write to a temp file and rename, so a crash never leaves a half-written parquet (nor a failed write
    its temp file). An output that is a symbolic link: its file is replaced, the link kept."""
    path = Path(os.path.realpath(path))
    tmp = path.with_name(path.name + ".tmp")
    table = records_to_table(records)
    try:
        # a file of our own, closed here: one pyarrow opened stays open (and its disk space taken) while the
        # error's traceback lives, so the report saved after a full disk found no room either
        with pa.OSFile(str(tmp), "wb") as sink:
            pq.write_table(table, sink)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def read_parquet_records(path: Path) -> list[dict]:
    return table_to_records(pq.read_table(path))
