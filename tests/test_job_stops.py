"""A job stopped from outside or by its disk keeps its work and says so: SIGTERM (what `timeout`, batch
schedulers and `docker stop` send) stops it as Ctrl-C does (results on disk, the report saved, exit
143); a full disk is one clear error (exit 2) with the results before it whole; a report never ends
half-written; and a resumed report counts the results that came from runs that saved no report."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import workloads.writer
from moelight.cli import app
from moelight.jobs.report import RunReport
from tests.test_durability import ROOT, _env

N = 40


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * (1 + i % 4)}) + "\n"
                            for i in range(N)))
    return path


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--dataset", str(data), "--output", str(out), "--model", "tiny", "--load-format", "dummy",
            "--gen-len", "24", "--batch-size", "2", "--hardware", "cpu-server", "--no-progress", *extra]


def _start_and_stop_after_results(data: Path, out: Path, sig: int, results: int = 2) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "moelight", *_args(data, out)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= results:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _ids(out: Path) -> list[str]:
    return [json.loads(line)["id"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_stops_the_job_as_ctrl_c_does(tmp_path, sig):
    """SIGTERM (schedulers, `timeout`) and SIGHUP (the terminal closed): exit 128 + the signal."""
    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    done = _start_and_stop_after_results(data, out, sig)
    assert done.returncode == 128 + sig, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "--resume" in done.stderr
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["interrupted"] and report["written"] == len(_ids(out)) < N
    resumed = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    assert sorted(_ids(out)) == sorted(f"q{i}" for i in range(N))
    final = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert [r["written"] for r in final["previous_runs"]] == [report["written"]] and not final["notes"]


def test_a_resumed_report_counts_results_from_runs_that_saved_none(tmp_path):
    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    _start_and_stop_after_results(data, out, signal.SIGKILL)
    held = len(_ids(out))
    resumed = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["already_in_output"] == held and report["previous_runs"] == []
    assert report["notes"] == [f"{held} of the {held} results already in the output came from runs that saved "
                               "no report (killed, or out of disk space)"]


class _FullDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.f.write(text[: self.room])  # what a full disk leaves: part of a line
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(text)
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_is_one_clear_error_and_resume_continues(tmp_path, monkeypatch):
    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    opened = workloads.writer.ResultWriter.__init__

    def small_disk(self, *args, **kwargs):
        opened(self, *args, **kwargs)
        self._f = _FullDisk(self._f, room=3000)

    monkeypatch.setattr(workloads.writer.ResultWriter, "__init__", small_disk)
    full = CliRunner().invoke(app, _args(data, out, "--overwrite"))
    assert full.exit_code == 2 and full.exception is not None and "Traceback" not in full.output
    assert "No space left on device" in full.output and "rerun with --resume" in full.output
    written = len(out.read_text().splitlines()) - 1  # the last line is cut
    assert 0 < written < N and f"the {written} result(s) this run wrote before" in full.output
    monkeypatch.setattr(workloads.writer.ResultWriter, "__init__", opened)
    resumed = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    assert sorted(_ids(out)) == sorted(f"q{i}" for i in range(N))


def test_device_memory_run_out_mid_job_is_one_clear_error_that_keeps_the_results(tmp_path, monkeypatch):
    """A DeviceOutOfMemory past the plan's check: one line naming it and what to change (exit 2), results kept."""
    from moelight.devices.device_base import DeviceOutOfMemory
    from moelight.runtime.plain_executor import PlainExecutor

    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    decode, calls = PlainExecutor.decode, []

    def runs_out(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 30:  # a batch in
            raise DeviceOutOfMemory("device memory exceeded allocating 64 B for aten::mul")
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(PlainExecutor, "decode", runs_out)
    failed = CliRunner().invoke(app, _args(data, out, "--overwrite"))
    assert failed.exit_code == 2 and "Traceback" not in failed.output
    assert "ran out of device memory: device memory exceeded allocating 64 B for aten::mul" in failed.output
    assert "smaller --batch-size, --micro-batch-size or --max-prefill-tokens and --resume" in failed.output
    assert 0 < len(_ids(out)) < N  # what --resume continues from (the full-disk test resumes)



def test_device_memory_run_out_before_any_result_says_nothing_was_written(tmp_path, monkeypatch):
    from moelight.devices.device_base import DeviceOutOfMemory
    from moelight.runtime.plain_executor import PlainExecutor

    def runs_out(self, *args, **kwargs):
        raise DeviceOutOfMemory("device memory exceeded allocating 64 B for aten::mul")

    monkeypatch.setattr(PlainExecutor, "decode", runs_out)
    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    failed = CliRunner().invoke(app, _args(data, out, "--overwrite"))
    assert failed.exit_code == 2 and "Traceback" not in failed.output
    assert "no result had finished: nothing was written" in failed.output and "kept in" not in failed.output
    assert not out.exists()

def test_a_report_that_cannot_be_written_leaves_the_one_before(tmp_path, monkeypatch):
    path = tmp_path / "o.jsonl.report.json"
    path.write_text('{"kept": true}\n')
    original = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        original(self, text[:10], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    try:
        RunReport("m", "bfloat16", 1, 1, 1).save(path)
    except OSError:
        pass
    monkeypatch.setattr(Path, "write_text", original)
    assert json.loads(path.read_text()) == {"kept": True}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_a_stop_while_the_report_is_saved_says_the_results_are_in_the_output(tmp_path, monkeypatch):
    """It said the output was not touched: a user told so may delete what the run finished."""
    import moelight.jobs.serving

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(moelight.jobs.serving, "save_report", stopped)
    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, _args(data, out))
    assert res.exit_code == 130 and "not touched" not in res.output, res.output
    assert "results finished before the stop are in" in res.output and len(_ids(out)) == N


def test_a_full_disk_while_the_job_record_is_saved_is_one_clear_error(tmp_path, monkeypatch):
    """The record (OUTPUT.job.json) is written just before the first result: a full disk there was a
    traceback; it is said as a full disk while writing results is, and the output is not started."""
    from moelight.jobs.job_record import JobRecord

    def full(self, path):
        raise OSError(errno.EFBIG, "File too large")

    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    monkeypatch.setattr(JobRecord, "save", full)
    res = CliRunner().invoke(app, _args(data, out))
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "the job record could not be saved" in res.output and "File too large" in res.output
    assert not out.exists() and not (tmp_path / "o.jsonl.job.json").exists()


def test_a_replacing_run_killed_before_its_report_leaves_none_of_the_job_it_replaced(tmp_path, monkeypatch):
    """--overwrite replaces the output, and the old job's report and record with it: a run killed before
    saving its own report left the replaced job's, which the resumed job listed as an earlier run."""
    import moelight.engine.generation
    import moelight.jobs.serving

    data, out = _data(tmp_path), tmp_path / "o.jsonl"
    assert CliRunner().invoke(app, _args(data, out)).exit_code == 0  # the job to be replaced, its report
    original = moelight.engine.generation.Engine.generate

    def killed_after_3(self, prompts, params, seeds, batch, micro, on_finish=None, stats=None):
        def finish(res):
            on_finish(res)
            if len(_ids(out)) == 3:
                raise KeyboardInterrupt

        return original(self, prompts, params, seeds, batch, micro, on_finish=finish, stats=stats)

    monkeypatch.setattr(moelight.engine.generation.Engine, "generate", killed_after_3)
    monkeypatch.setattr(moelight.jobs.serving, "save_report", lambda *a, **k: None)  # killed: no report
    CliRunner().invoke(app, _args(data, out, "--overwrite"))
    assert len(_ids(out)) == 3 and not (tmp_path / "o.jsonl.report.json").exists()
    monkeypatch.undo()
    resumed = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert resumed.exit_code == 0, resumed.output
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["already_in_output"] == 3 and report["previous_runs"] == []
    assert any("3 of the 3 results already in the output came from runs that saved no report" in n
               for n in report["notes"]), report["notes"]


def test_a_second_stop_before_the_parquet_is_written_names_the_stream_that_holds_the_results(tmp_path, monkeypatch):
    """A parquet output streams to OUTPUT.partial.jsonl until its close writes the parquet: a stop before that
    said the results were in the parquet file, which did not exist."""
    def stopped(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(workloads.writer.ResultWriter, "close", stopped)
    data, out = _data(tmp_path), tmp_path / "o.parquet"
    res = CliRunner().invoke(app, _args(data, out))
    assert res.exit_code == 130 and not out.exists(), res.output
    assert "results finished before the stop are in " + str(tmp_path / "o.parquet.partial.jsonl") in res.output


def test_a_stop_in_a_later_turn_loses_the_unfinished_conversations_and_resume_asks_them_again(tmp_path,
                                                                                              monkeypatch):
    """A conversation is written when its last turn ends (README): a job stopped in turn 2 keeps none of
    the turn-1 answers of the conversations still going, and --resume asks them again from turn 1, with
    the same seeds, so the records equal an uninterrupted run's."""
    from moelight.devices.device_base import DeviceOutOfMemory
    from moelight.jobs import serving

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "prompt": f"question {i}", "followups": ["and?"],
                                        "temperature": 0.8}) + "\n" for i in range(3)))
    whole, out = tmp_path / "whole.jsonl", tmp_path / "o.jsonl"
    assert CliRunner().invoke(app, _args(data, whole)).exit_code == 0
    planned, rounds = serving.generate_planned, []

    def stops_in_turn_two(*args, **kwargs):
        rounds.append(1)
        if len(rounds) == 2:
            raise DeviceOutOfMemory("device memory exceeded")
        return planned(*args, **kwargs)

    monkeypatch.setattr(serving, "generate_planned", stops_in_turn_two)
    failed = CliRunner().invoke(app, _args(data, out))
    assert failed.exit_code == 2 and not (out.exists() and out.read_text()), failed.output
    monkeypatch.setattr(serving, "generate_planned", planned)
    assert CliRunner().invoke(app, _args(data, out, "--resume")).exit_code == 0
    turns = lambda path: {json.loads(x)["id"]: json.loads(x)["turns"] for x in path.read_text().splitlines()}  # noqa: E731
    assert turns(out) == turns(whole) and len(turns(out)) == 3
