"""Streaming result output: one record per finished request, flushed at once.

Each ``write`` appends a full line and flushes, so Ctrl-C or a kill keeps every result
already reported. Parquet cannot be appended safely, so it streams to a jsonl sidecar
and is converted on ``close`` (resume reads the parquet and the sidecar).
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
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

    # how often (seconds) a write checks that the stream is still the whole file this run wrote: a file
    # deleted or cut by another process stops the job then, not hours later at close
    check_every_s = 1.0

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
        if overwrite:  # an output that is a symbolic link: its file is replaced, the link kept
            for p in existing:
                Path(os.path.realpath(p)).unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume:
            repair_jsonl(self.stream_path)
        self._f = open(self.stream_path, "a", encoding="utf-8")
        self._size: int | None = os.fstat(self._f.fileno()).st_size  # where this run's last result ends
        self._checked = time.monotonic()
        self._tampered: OutputWriteError | None = None

    def write(self, result: dict) -> None:
        """Append one finished request and flush it to the OS before returning."""
        check_result(result)
        record = to_openai_batch(result, self.model_name) if self.format == "openai" else result
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if self._closed:
                raise ValueError(f"write to closed ResultWriter ({self.path})")
            if time.monotonic() - self._checked >= self.check_every_s:
                self._check_intact()
            try:
                self._f.write(line)
                self._f.flush()
            except OSError as e:
                self._size = None  # part of the line may be there: the size check has nothing to go by
                raise self._write_error(e) from None
            if self._size is not None:
                self._size += len(line.encode("utf-8"))
            self.written += 1

    def _check_intact(self) -> None:
        """The stream this run wrote is the file at its path, whole: one deleted (or replaced) while the job
        ran took this run's results with it, one cut (or written to) by another process lost some, and the job
        must not report them written. Two stat calls; the first failure stays the writer's."""
        if self._tampered is not None:
            raise self._tampered
        self._checked = time.monotonic()
        own = os.fstat(self._f.fileno())
        try:
            here = os.stat(self.stream_path)
            gone = own.st_nlink == 0 or (here.st_ino, here.st_dev) != (own.st_ino, own.st_dev)
        except FileNotFoundError:
            gone = True
        if gone and self.written:
            self._tampered = OutputWriteError(
                f"{self.stream_path} was deleted or replaced while the job ran: the {self.written} result(s) this "
                "run wrote went with it; rerun the job (with --resume if an output is there again)")
        elif not gone and self._size is not None and stat.S_ISREG(own.st_mode) and own.st_size != self._size:
            self._tampered = OutputWriteError(
                f"{self.stream_path} was changed by another process while the job ran (it holds {own.st_size} "
                f"bytes where this run's results end at byte {self._size}): results written to it were lost, so "
                "the job stopped; rerun it with --resume, which keeps the whole results the file still holds and "
                "runs the lost ones again")
        if self._tampered is not None:
            self._f.close()
            raise self._tampered

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
            self._check_intact()
            try:
                self._f.close()
            except OSError as e:
                raise self._write_error(e) from None
            if self.format == "parquet":
                self._write_parquet()

    def _write_parquet(self) -> None:
        """The parquet file from what it held and the stream; the stream is removed only once it is written, so
        a failure here (a full disk) loses nothing: --resume writes it again."""
        try:
            records = read_parquet_records(self.path) if self.path.exists() else []
            records += read_jsonl_results(self.stream_path)
            write_parquet_atomic(self.path, _first_of_each_id(records))
        except OSError as e:
            raise OutputWriteError(
                f"could not write the parquet file {self.path}: {e.strerror or e}; no result is lost: this run's "
                f"are in {self.stream_path} (any earlier ones in {self.path.name}, as it was); make room (or fix the "
                f"path) and rerun with --resume, which writes {self.path.name} from them without generating them "
                "again") from None
        try:
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
