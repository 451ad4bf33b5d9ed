"""The job's output file: where its report goes, whether it may be written, and a writer that opens
it only when the first result is ready (a job that fails before one leaves an existing output as
it was)."""

from __future__ import annotations

from pathlib import Path

import workloads


def report_path(output: Path) -> Path:
    return output.with_name(output.name + ".report.json")


def check_output(opts) -> None:
    """An existing output needs --resume (continue it) or --overwrite (replace it)."""
    if opts.output.exists() and not (opts.resume or opts.overwrite):
        raise workloads.OutputExistsError(
            f"{opts.output}: output exists; pass --resume to continue it or --overwrite to replace it")


def finished_ids(opts) -> set[str]:
    """Ids a resumed output already holds (none unless --resume)."""
    return workloads.finished_ids(opts.output) if opts.resume and opts.output.exists() else set()


class LazyResultWriter:
    """The output's ResultWriter, opened at the first finished result."""

    def __init__(self, opts, out_format: str) -> None:
        self.opts, self.format, self.writer = opts, out_format, None

    def write(self, result: dict) -> None:
        if self.writer is None:
            self.writer = workloads.ResultWriter(self.opts.output, self.format, resume=self.opts.resume,
                                                 overwrite=self.opts.overwrite, model_name=self.opts.model)
            self.writer.__enter__()
        self.writer.write(result)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.__exit__(*exc)
