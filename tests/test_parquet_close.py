"""A parquet output is written when the job closes it, from the jsonl stream it ran into: a close that fails
(a full disk) names the parquet file, keeps the stream, is in the report, and a --resume with nothing left
to generate still writes the parquet file."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import workloads.writer
from moelight.cli import app
from tests.test_workloads_writers import result
from workloads import OutputWriteError, ResultWriter, sidecar_path

N = 3


def _job(tmp_path: Path, *extra: str) -> tuple[list[str], Path]:
    data, out = tmp_path / "d.jsonl", tmp_path / "o.parquet"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(N)))
    return ["run", "--dataset", str(data), "--output", str(out), "--model", "tiny", "--load-format", "dummy",
            "--gen-len", "4", "--hardware", "cpu-server", "--no-progress", *extra], out


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_parquet_file_that_cannot_be_written_is_named_and_its_stream_kept(tmp_path, monkeypatch):
    """The error named the stream (`could not write to out.parquet.partial.jsonl`), which was written whole."""
    monkeypatch.setattr(workloads.writer, "write_parquet_atomic", _disk_full)
    out = tmp_path / "out.parquet"
    w = ResultWriter(out)
    w.write(result("a"))
    with pytest.raises(OutputWriteError) as e:
        w.close()
    said = str(e.value)
    assert said.startswith(f"could not write the parquet file {out}: No space left on device"), said
    assert f"in {sidecar_path(out)}" in said and "--resume" in said
    assert sidecar_path(out).read_text().count("\n") == 1 and not out.exists()


def test_a_parquet_file_that_cannot_be_written_is_the_reports_error(tmp_path, monkeypatch):
    """The report was saved before the output was closed: it said `error: null` over a failed job."""
    monkeypatch.setattr(workloads.writer, "write_parquet_atomic", _disk_full)
    args, out = _job(tmp_path)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "could not write the parquet file" in res.output, res.output
    report = json.loads((tmp_path / "o.parquet.report.json").read_text())
    assert report["error"].startswith("OutputWriteError: could not write the parquet file")
    assert report["written"] == N


def test_a_resume_with_nothing_left_writes_the_parquet_file_from_its_stream(tmp_path, monkeypatch):
    """The resume found every result in the stream, ran nothing, said `results: o.parquet` with exit 0 and
    never wrote o.parquet."""
    monkeypatch.setattr(workloads.writer, "write_parquet_atomic", _disk_full)
    args, out = _job(tmp_path)
    assert CliRunner().invoke(app, args).exit_code == 2
    monkeypatch.undo()
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    assert sorted(pq.read_table(out).column("id").to_pylist()) == [f"q{i}" for i in range(N)]
    assert not sidecar_path(out).exists()
