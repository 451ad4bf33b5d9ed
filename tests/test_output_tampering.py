"""An output another process deletes, replaces or cuts while the job writes it: the job stops at its next
check with a clear error, never reports results written that the file no longer holds."""

from __future__ import annotations

import os

import pytest

from tests.test_workloads_writers import lines, result
from workloads import OutputWriteError, ResultWriter


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_output_cut_by_another_process_is_an_error_at_close(tmp_path, fmt):
    """`: > out.jsonl` mid-job: the job said 'written 300 of 300' over a file holding 236 results."""
    w = ResultWriter(tmp_path / f"out.{fmt}")
    w.write(result("a"))
    w.write(result("b"))
    os.truncate(w.stream_path, 0)
    with pytest.raises(OutputWriteError, match="changed by another process while the job ran") as e:
        w.close()
    assert "--resume" in str(e.value) and not (tmp_path / "out.parquet").exists()


def test_an_output_cut_mid_job_stops_the_next_write_and_resume_redoes_the_lost(tmp_path):
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out)
    w.check_every_s = 0.0
    w.write(result("a"))
    w.write(result("b"))
    os.truncate(out, 0)
    with pytest.raises(OutputWriteError, match="changed by another process"):
        w.write(result("c"))
    with pytest.raises(OutputWriteError):  # the close says it again: the job must not end as a success
        w.close()
    with ResultWriter(out, resume=True) as again:  # what --resume does: the file is whole, the lost run again
        again.write(result("a"))
    assert [r["id"] for r in lines(out)] == ["a"]


def test_an_output_deleted_mid_job_stops_the_next_write(tmp_path):
    """The deletion was seen only at close: a multi-hour job computed into a deleted file."""
    out = tmp_path / "out.jsonl"
    w = ResultWriter(out)
    w.check_every_s = 0.0
    w.write(result("a"))
    out.unlink()
    with pytest.raises(OutputWriteError, match="deleted or replaced while the job ran: the 1 result"):
        w.write(result("b"))


def test_writes_check_the_output_at_most_every_check_interval(tmp_path, monkeypatch):
    """The check is two stat calls, not on every result: a job writing thousands a second pays nothing."""
    calls = []
    w = ResultWriter(tmp_path / "out.jsonl")
    real = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: calls.append(fd) or real(fd))
    for i in range(50):
        w.write(result(f"r{i}"))
    assert len(calls) <= 1
    w.close()
