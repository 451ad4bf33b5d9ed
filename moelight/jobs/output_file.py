"""The job's output file: where its report goes, whether it may be written, and a writer that opens
it only when the first result is ready (a job that fails before one leaves an existing output as
it was)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import workloads
from moelight.jobs.job_record import REFUSED, JobRecord, check_resume, output_shape, record_path
from moelight.jobs.output_lock import hold
from workloads.resume import is_parquet_path, partial_tail_bytes


def report_path(output: Path) -> Path:
    return output.with_name(output.name + ".report.json")


def output_companions(output: Path) -> list[Path]:
    """The files a job writes beside its output: the report, the job record, a parquet output's stream, the
    lock."""
    return [report_path(output), record_path(output), workloads.sidecar_path(output),
            output.with_name(output.name + ".lock")]


def save_report(report, output: Path, failing: BaseException | None = None, log=None) -> None:
    """Save the report beside the output (its folder created if need be). While another error is on its
    way out, the report records it, a report that cannot be written is said in one line and never replaces
    that error, and a run that wrote nothing keeps the report already there (it describes the output)."""
    path = report_path(output)
    if failing is not None:
        first = (str(failing).strip().splitlines() or [""])[0]
        report.error = f"{type(failing).__name__}: {first}" if first else type(failing).__name__
        if not report.written and path.exists():  # the report of the results the output still holds
            (log or _stderr)(f"note: {path} was kept: this run stopped before writing any result")
            return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        report.save(path)
    except OSError as e:
        if failing is None:
            raise workloads.OutputWriteError(f"the report could not be saved to {path} ({e.strerror or e}); "
                                             f"the results are in {output}") from None
        message = f"note: the report could not be saved to {path} ({e.strerror or e})"
        (log or _stderr)(message)


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)


def output_present(output: Path) -> bool:
    """The output exists, or a parquet output's stream of a job that stopped before closing it."""
    return output.exists() or workloads.sidecar_path(output).exists()


def results_place(output: Path) -> str:
    """Where the results a stopped job finished are: a parquet output stopped before its stream was turned
    into it holds them in the stream, not in the parquet file the user named."""
    stream = workloads.sidecar_path(output)
    if is_parquet_path(output) and stream.exists():
        return f"{stream}, the stream of {output.name} that --resume turns into it"
    return str(output)


def output_bytes(output: Path) -> int:
    """The size of what the output holds now (its parquet stream too): whether a stopped job wrote to it."""
    return sum(p.stat().st_size for p in (output, workloads.sidecar_path(output)) if p.is_file())


@dataclass
class OutputState:
    """What the output holds before the job runs, and the record of the job it will belong to."""

    record: JobRecord
    done: set[str] = field(default_factory=set)  # ids already written (a resumed output)
    notes: list[str] = field(default_factory=list)  # warnings for the summary and the report


def prepare_output(opts, out_format: str, requests=None, refused: dict[str, str] | None = None) -> OutputState:
    """Before any model loads: an existing output needs --resume (continue it) or --overwrite (replace
    it); a resumed one must be this job's (job_record.check_resume), and its finished ids are read.
    `refused`: custom_ids of OpenAI records refused at read, recorded as such (their error lines are the job's)."""
    record = JobRecord.of_job(opts, out_format, requests)
    if refused and record.requests is not None:
        record.requests.update({cid: REFUSED for cid in refused})
    if not output_present(opts.output):
        return OutputState(record)
    if not (opts.resume or opts.overwrite):
        raise workloads.OutputExistsError(
            f"{opts.output}: output exists; pass --resume to continue it or --overwrite to replace it")
    if not opts.resume:
        return OutputState(record)
    done = workloads.finished_ids(opts.output)
    notes = check_resume(opts.output, record, done, output_shape(opts.output))
    stream = workloads.sidecar_path(opts.output) if workloads.output_format(opts.output) == "parquet" else opts.output
    cut = partial_tail_bytes(stream)
    if cut:  # repaired when the writer opens: said here, so the report tells what was dropped
        notes.append(f"{stream}: its last line was incomplete ({cut} bytes; a run killed while writing it): "
                     "it is dropped and its request runs again")
    return OutputState(record, done, notes)


class LazyResultWriter:
    """The output's ResultWriter, opened at the first finished result, just after the job's record is
    written beside it (merged with the record already there when the job resumes). An output replaced
    (--overwrite) loses the old job's report and record there: a run killed before saving its own report
    left the old one, which a resumed job then listed as an earlier run of this output."""

    def __init__(self, opts, out_format: str, record: JobRecord | None = None) -> None:
        self.opts, self.format, self.record, self.writer = opts, out_format, record, None
        self.written = 0

    def write(self, result: dict) -> None:
        if self.writer is None:
            self._open()
        self.writer.write(result)
        self.written += 1

    def _open(self) -> None:
        self._write_record()  # replaces a replaced job's record; its report goes with its results
        if self.opts.overwrite:
            report_path(self.opts.output).unlink(missing_ok=True)
        self.writer = workloads.ResultWriter(self.opts.output, self.format, resume=self.opts.resume,
                                             overwrite=self.opts.overwrite, model_name=self.opts.model)
        self.writer.__enter__()
        hold(self.opts.output, self.writer.stream_path)  # the file it made: a hard link to it is refused

    def close(self, finish: bool = True) -> None:
        """Close the output (a parquet one is written from its stream). `finish`: a resumed parquet output whose
        stream a stopped run left (its conversion failed: a full disk) is written even when this run has no
        result to add; a job that failed leaves it as it was."""
        if self.writer is None and finish and self.opts.resume and self.format == "parquet" \
                and workloads.sidecar_path(self.opts.output).exists():
            self._open()
        if self.writer is not None:
            self.writer.close()

    def _write_record(self) -> None:
        if self.record is None:
            return
        path = record_path(self.opts.output)
        record = self.record
        if self.opts.resume and path.exists():
            record = JobRecord.load(path).merged(record)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            record.save(path)
        except OSError as e:  # a full disk: said as when results cannot be written, not a traceback
            raise workloads.OutputWriteError(
                f"the job record could not be saved to {path} ({e.strerror or e}), so this run wrote no result "
                f"to {self.opts.output} (left as it was); make room (or fix the path) and rerun the job") from None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(finish=exc_type is None)
