"""Streaming result output: one record per finished request, flushed at once.

Each ``write`` appends a full line and flushes, so Ctrl-C or a kill keeps every result
already reported. Parquet cannot be appended safely, so it streams to a jsonl sidecar
and is converted on ``close`` (resume reads the parquet and the sidecar).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import TracebackType

from .errors import OutputExistsError, OutputPathError, OutputWriteError
from .parquet_io import read_parquet_records, write_parquet_atomic
from .results import check_result, to_openai_batch
from .resume import PARQUET_SUFFIXES, is_parquet_path, read_jsonl_results, repair_jsonl, sidecar_path

OUTPUT_FORMATS = ("jsonl", "openai", "parquet")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def output_format(path: str | Path, input_format: str | None = None) -> str:
    """The format an output path asks for: parquet or jsonl by extension (OpenAI Batch shape in
    jsonl for OpenAI Batch input). Any other extension is refused rather than written as jsonl."""
    if is_parquet_path(path):
        return "parquet"
    suffix = Path(path).suffix.lower()
    if suffix not in JSONL_SUFFIXES:
        valid = ", ".join((*JSONL_SUFFIXES, *PARQUET_SUFFIXES))
        raise OutputPathError(f"{path}: moelight writes no {suffix or 'extension-less'} files; "
                              f"name the output with one of: {valid}")
    return "openai" if input_format == "openai" else "jsonl"


class ResultWriter:
    """Context manager writing results as they finish.

    ``format``: jsonl | openai | parquet (None: ``output_format(path)``).
    ``resume``: append to an existing output (a cut last line is dropped first).
    ``overwrite``: replace an existing output. With neither, an existing output is refused.
    """

    def __init__(self, path: str | Path, format: str | None = None, *, resume: bool = False,
                 overwrite: bool = False, model_name: str = "moelight"):
        if resume and overwrite:
            raise ValueError("choose one of resume and overwrite, not both")
        self.path = Path(path)
        self.format = format or output_format(self.path)
        if self.format not in OUTPUT_FORMATS:
            raise ValueError(f"unknown output format {self.format!r}; "
                             f"choose one of {', '.join(OUTPUT_FORMATS)}")
        self.model_name = model_name
        self.resume = resume
        self.written = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stream_path = sidecar_path(self.path) if self.format == "parquet" else self.path

        existing = [p for p in {self.path, self.stream_path} if p.exists()]
        if existing and not (resume or overwrite):
            raise OutputExistsError(
                f"output {existing[0]} already exists; pass --resume to continue it "
                f"(finished requests are skipped) or --overwrite to replace it"
            )
        if overwrite:
            for p in existing:
                p.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume:
            repair_jsonl(self.stream_path)
        self._f = open(self.stream_path, "a", encoding="utf-8")

    def write(self, result: dict) -> None:
        """Append one finished request and flush it to the OS before returning."""
        check_result(result)
        record = to_openai_batch(result, self.model_name) if self.format == "openai" else result
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if self._closed:
                raise ValueError(f"write to closed ResultWriter ({self.path})")
            try:
                self._f.write(line)
                self._f.flush()
            except OSError as e:
                raise self._write_error(e) from None
            self.written += 1

    def _check_still_there(self) -> None:
        """The stream this run wrote is the file at its path: one deleted (or replaced) while the job ran took
        this run's results with it, and the job must not report them written."""
        try:
            gone = os.stat(self.stream_path).st_ino != os.fstat(self._f.fileno()).st_ino
        except FileNotFoundError:
            gone = True
        if gone and self.written:
            self._f.close()
            raise OutputWriteError(
                f"{self.stream_path} was deleted or replaced while the job ran: the {self.written} result(s) this "
                "run wrote went with it; rerun the job (with --resume if an output is there again)")

    def _write_error(self, e: OSError) -> OutputWriteError:
        return OutputWriteError(
            f"could not write to {self.stream_path}: {e.strerror or e}; the {self.written} result(s) this run "
            "wrote before are in it; make room (or fix the path) and rerun with --resume to continue")

    def close(self) -> None:
        """Close the stream; for parquet, merge what exists and write the parquet file."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._check_still_there()
            try:
                self._f.close()
                if self.format == "parquet":
                    records = read_parquet_records(self.path) if self.path.exists() else []
                    records += read_jsonl_results(self.stream_path)
                    write_parquet_atomic(self.path, _first_of_each_id(records))
                    self.stream_path.unlink()
            except OSError as e:
                raise self._write_error(e) from None

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # Convert even on an exception (Ctrl-C): every finished result still lands in the parquet.
        self.close()


def _first_of_each_id(records: list[dict]) -> list[dict]:
    """One row per id, in order: a run killed after its parquet was written but before its stream was
    removed left those rows in both."""
    seen: set[str] = set()
    return [r for r in records if not (r["id"] in seen or seen.add(r["id"]))]
