"""`--resume` reads the output's job record (`OUTPUT.job.json`) before anything loads: a record of the
wrong shape (hand-edited, another tool's) is refused there, with what to do, and never after the job
has generated; options an older record does not hold are named as unchecked."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moelight.cli import app

ROWS = [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(4)]


def _args(data, out, *extra: str) -> list[str]:
    return ["run", "--dataset", str(data), "--output", str(out), "--model", "tiny", "--load-format", "dummy",
            "--gen-len", "3", "--hardware", "cpu-server", "--no-progress", *extra]


@pytest.fixture
def half_done(tmp_path):
    """A finished output cut to its first two results, with its record: a job to resume."""
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert CliRunner().invoke(app, _args(data, out)).exit_code == 0
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    return data, out


def _resumed_notes(data, out) -> list[str]:
    """Resume the half-done job to its end; the report's notes."""
    res = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == len(ROWS)
    return json.loads(out.with_name(out.name + ".report.json").read_text())["notes"]


@pytest.mark.parametrize("edit", [
    {"settings": "abc"},
    {"settings": {}},
    {"requests": [1, 2]},
    {"requests": {"q0": 5}},
    {"dataset": 3},
    {"extra": []},
])
def test_a_record_of_the_wrong_shape_is_refused_before_loading(half_done, monkeypatch, edit):
    import moelight.engine.session

    data, out = half_done
    record = out.with_name(out.name + ".job.json")
    record.write_text(json.dumps(json.loads(record.read_text()) | edit))
    monkeypatch.setattr(moelight.engine.session.EngineSession, "engine",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    res = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "not a moelight job record" in res.output and "--overwrite" in res.output
    assert len(out.read_text().splitlines()) == 2  # untouched


def test_options_an_older_record_does_not_hold_are_named_as_unchecked(half_done):
    data, out = half_done
    record = out.with_name(out.name + ".job.json")
    old = json.loads(record.read_text())
    del old["settings"]["quantize"]
    record.write_text(json.dumps(old))
    notes = _resumed_notes(data, out)
    assert any("does not record --quantize" in n for n in notes), notes


@pytest.mark.parametrize("suffix", [".report.json", ".job.json", ".partial.jsonl"])
def test_a_file_the_job_writes_beside_its_output_is_never_the_dataset(tmp_path, suffix):
    """The output is checked against the inputs, and so are its report, job record and parquet stream."""
    from workloads import sidecar_path

    out = tmp_path / ("o.parquet" if suffix == ".partial.jsonl" else "o.jsonl")
    data = sidecar_path(out) if suffix == ".partial.jsonl" else tmp_path / (out.name + suffix)
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    before = data.read_bytes()
    res = CliRunner().invoke(app, _args(data, out, "--format", "jsonl", "--overwrite"))
    assert res.exit_code == 2 and "which is the dataset" in res.output, res.output
    assert data.read_bytes() == before


def _schema(*fields: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {f: {"type": "string"} for f in fields}, "required": list(fields)}}}


@pytest.mark.parametrize("before, after, changed", [
    ({"stop": ["x"]}, {"stop": ["y"]}, True),
    ({"n": 1}, {"n": 2}, True),
    ({"response_format": _schema("reason", "answer")}, {"response_format": _schema("answer", "reason")}, True),
    ({"logprobs": 2, "stop": ["x"]}, {"stop": ["x"], "logprobs": 2}, False),  # where a key sits in the line
    ({"response_format": _schema("reason", "answer")},
     {"response_format": _schema("reason", "answer") | {"json_schema": {"name": "a", "schema": {
         **_schema("reason", "answer")["json_schema"]["schema"], "required": ["answer", "reason"]}}}}, False),
])
def test_a_request_whose_sampling_fields_changed_is_refused_on_resume(tmp_path, before, after, changed):
    """A finished request asked again with other stop strings, n or schema field order (the order the
    grammar writes) is another request; the same fields written in another order are not."""
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    rows = [dict(r) for r in ROWS]
    data.write_text("".join(json.dumps(r | before) + "\n" for r in rows))
    assert CliRunner().invoke(app, _args(data, out)).exit_code == 0
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    data.write_text("".join(json.dumps(r | after) + "\n" for r in rows))
    res = CliRunner().invoke(app, _args(data, out, "--resume"))
    if changed:
        assert res.exit_code == 2 and "changed under the same id" in res.output, res.output
        assert "q0" in res.output and len(out.read_text().splitlines()) == 2
    else:
        assert res.exit_code == 0, res.output
        assert len(out.read_text().splitlines()) == len(ROWS)


def test_a_record_of_the_first_version_resumes_with_a_note_and_is_upgraded(half_done):
    """An older moelight's record hashed requests without their sampling fields: its requests are compared
    that way, the report says what could not be checked, and the rewritten record is of this version."""
    from moelight.jobs.job_record import VERSION, request_hash
    from workloads import read_dataset

    data, out = half_done
    record = out.with_name(out.name + ".job.json")
    old = json.loads(record.read_text())
    requests = read_dataset(data)
    old |= {"version": 1, "requests": {r.id: request_hash(r, version=1) for r in requests}}
    record.write_text(json.dumps(old))
    notes = _resumed_notes(data, out)
    assert any("predates the check of requests' sampling fields" in n for n in notes), notes
    new = json.loads(record.read_text())
    assert new["version"] == VERSION and new["requests"] == {r.id: request_hash(r) for r in requests}


def test_a_record_of_a_newer_version_is_refused(half_done):
    data, out = half_done
    record = out.with_name(out.name + ".job.json")
    record.write_text(json.dumps(json.loads(record.read_text()) | {"version": 99}))
    res = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert res.exit_code == 2 and "version 99" in res.output, res.output


def test_a_last_line_cut_by_a_kill_is_named_when_the_job_resumes(half_done):
    """The writer drops an incomplete last line before it appends; the report says so (it was silent)."""
    data, out = half_done
    with open(out, "a") as f:
        f.write('{"id": "q2", "output": "hal')
    notes = _resumed_notes(data, out)
    assert any("last line was incomplete (27 bytes" in n for n in notes), notes
    assert sorted(json.loads(line)["id"] for line in out.read_text().splitlines()) == [r["id"] for r in ROWS]


def test_a_second_job_on_an_output_in_use_is_refused_at_once(tmp_path, monkeypatch):
    """Two jobs on one output mixed, duplicated or lost results: the second (the same path, or the same
    file through a link) is refused before it reads anything, and the lock goes with the first job."""
    import moelight.engine.session
    from moelight.jobs.output_lock import output_lock

    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "link.jsonl").symlink_to(out)
    monkeypatch.setattr(moelight.engine.session.EngineSession, "engine",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    with output_lock(out):  # a job writing it
        for target in (out, tmp_path / "link.jsonl"):
            res = CliRunner().invoke(app, _args(data, target, "--resume"))
            assert res.exit_code == 2 and "another moelight job is writing it" in res.output, res.output
    monkeypatch.undo()
    assert CliRunner().invoke(app, _args(data, out)).exit_code == 0
    assert not (tmp_path / "o.jsonl.lock").exists() and len(out.read_text().splitlines()) == len(ROWS)


def test_the_same_checkpoint_at_another_path_resumes_and_a_fine_tune_of_it_does_not(tmp_path):
    """A node-local copy of the model folder (or a link) is the same job, said in a note; a folder with the
    same config.json but other weights is not; an older record (path and config.json) still resumes."""
    import shutil

    from tests.checkpoints import make_hf_model, save_checkpoint

    first = save_checkpoint(make_hf_model(seed=1), tmp_path / "model")
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    args = ["run", "--dataset", str(data), "--output", str(out), "--gen-len", "3", "--hardware", "cpu-server",
            "--no-progress", "--dtype", "float32"]
    assert CliRunner().invoke(app, [*args, "--model", str(first)]).exit_code == 0
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    copy = shutil.copytree(first, tmp_path / "node-local")
    res = CliRunner().invoke(app, [*args, "--model", str(copy), "--resume"])
    assert res.exit_code == 0, res.output
    notes = json.loads(out.with_name(out.name + ".report.json").read_text())["notes"]
    assert any("the model folder moved" in n for n in notes), notes
    out.write_text("".join(out.read_text().splitlines(keepends=True)[:2]))
    tuned = save_checkpoint(make_hf_model(seed=2), tmp_path / "tuned")
    res = CliRunner().invoke(app, [*args, "--model", str(tuned), "--resume"])
    assert res.exit_code == 2 and "--model: was" in res.output, res.output
    record = out.with_name(out.name + ".job.json")
    old = json.loads(record.read_text())
    old["settings"]["model"] = old["settings"]["model"].split(", weights")[0] + ")"  # an older record's form
    record.write_text(json.dumps(old))
    assert CliRunner().invoke(app, [*args, "--model", str(copy), "--resume"]).exit_code == 2  # moved: unknown
    assert CliRunner().invoke(app, [*args, "--model", str(first), "--resume"]).exit_code == 0


def test_a_second_job_on_the_same_file_through_a_hard_link_is_refused(tmp_path, monkeypatch):
    """A hard link names another lock file than the output's: the output file itself is locked too, by a
    job that starts on it and by one that creates it, so a job reaching it under another name is refused."""
    import moelight.engine.session
    from moelight.jobs.output_file import LazyResultWriter
    from moelight.jobs.output_lock import output_lock
    from moelight.jobs.run_options import RunOptions

    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.setattr(moelight.engine.session.EngineSession, "engine",
                        lambda *a, **k: pytest.fail("the model was loaded"))
    opts = RunOptions(dataset=str(data), output=out, model="tiny")
    with output_lock(out), LazyResultWriter(opts, "jsonl") as writer:  # a job that creates its output
        writer.write({"id": "q0", "output": "", "output_token_ids": [], "finish_reason": "length",
                      "prompt_tokens": 1, "completion_tokens": 0})
        (tmp_path / "hard.jsonl").hardlink_to(out)
        res = CliRunner().invoke(app, _args(data, tmp_path / "hard.jsonl", "--resume"))
        assert res.exit_code == 2 and "another moelight job is writing it" in res.output, res.output
    with output_lock(out):  # a job that started on it
        res = CliRunner().invoke(app, _args(data, tmp_path / "hard.jsonl", "--resume"))
        assert res.exit_code == 2 and "another moelight job is writing it" in res.output, res.output
    assert len(out.read_text().splitlines()) == 1
    monkeypatch.undo()
    assert CliRunner().invoke(app, _args(data, tmp_path / "hard.jsonl", "--resume")).exit_code == 0
    assert not list(tmp_path.glob("*.lock")) and len(out.read_text().splitlines()) == len(ROWS)


def test_dtype_auto_is_recorded_as_the_dtype_it_resolves_to(half_done):
    """The tiny preset runs in bfloat16 by --dtype auto: resuming it with --dtype bfloat16 is the same job (it
    was refused for the spelling), an older record's 'auto' too; float32 is another job."""
    data, out = half_done
    record = out.with_name(out.name + ".job.json")
    assert json.loads(record.read_text())["settings"]["dtype"] == "bfloat16"
    old = json.loads(record.read_text())
    old["settings"]["dtype"] = "auto"  # an older moelight's record
    record.write_text(json.dumps(old))
    refused = CliRunner().invoke(app, _args(data, out, "--resume", "--dtype", "float32"))
    assert refused.exit_code == 2 and "--dtype: was 'auto', now 'float32'" in refused.output, refused.output
    res = CliRunner().invoke(app, _args(data, out, "--resume", "--dtype", "bfloat16"))
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == len(ROWS)
