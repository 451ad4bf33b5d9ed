"""A Composition-of-Experts job: several checkpoints behind a router in one `moelight run`, one
model on the device at a time, CoServe's grouped schedule against first-come-first-served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from moelight.jobs.coe_job import CoEError, CoESpec, schedule
from tests.cli_text import says
from tests.test_cli_run import read_jsonl, report_of, write_jsonl
from workloads.request import Request

CKPT = Path(__file__).parent / "data" / "stdlib-moe"


def _spec(tmp_path: Path, router: dict | None = None) -> Path:
    path = tmp_path / "coe.json"
    path.write_text(json.dumps({"models": {"code": str(CKPT), "chat": "tiny"},
                                "router": router or {"keywords": {"def ": "code"}, "default": "chat"}}))
    return path


def test_the_router_reads_the_request_then_the_keywords_then_the_default(tmp_path):
    spec = CoESpec.load(_spec(tmp_path))
    assert spec.route(Request("a", prompt="hello", meta={"model": "code"})) == "code"
    assert spec.route(Request("b", prompt="def f(): pass")) == "code"
    assert spec.route(Request("c", prompt="hello")) == "chat"
    with pytest.raises(CoEError, match="model 'gpt' is not one of code, chat"):
        spec.route(Request("d", prompt="x", meta={"model": "gpt"}))


def test_bad_specs_are_named(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(CoEError, match='needs "models"'):
        CoESpec.load(tmp_path / "a.json")
    with pytest.raises(CoEError, match="the router names unknown model\\(s\\) math"):
        CoESpec.load(_spec(tmp_path, {"keywords": {"+": "math"}}))
    with pytest.raises(CoEError, match="router keyword\\(s\\) '' would match every prompt"):
        CoESpec.load(_spec(tmp_path, {"keywords": {"": "code"}, "default": "chat"}))
    with pytest.raises(CoEError, match="unknown field\\(s\\) foo, router.keyword; a CoE spec holds"):
        (tmp_path / "b.json").write_text(json.dumps({"models": {"chat": "tiny"}, "foo": 1,
                                                     "router": {"keyword": {"x": "chat"}}}))
        CoESpec.load(tmp_path / "b.json")


def test_grouped_schedule_serves_each_model_once_by_usage():
    models = ["a", "b", "a", "c", "a", "b"]
    assert schedule(models, "grouped") == [("a", [0, 2, 4]), ("b", [1, 5]), ("c", [3])]
    assert [m for m, _ in schedule(models, "fcfs")] == ["a", "b", "a", "c", "a", "b"]


def test_a_coe_job_through_the_cli(tmp_path):
    spec = _spec(tmp_path)
    records = [{"id": f"r{i}", "prompt": ("def f(x):\n    return" if i % 2 else "Tell me a story") + " " * i}
               for i in range(6)]
    records.append({"id": "named", "prompt": "def g(): pass", "model": "chat"})
    data = write_jsonl(tmp_path / "req.jsonl", records)
    common = ["run", "--dataset", str(data), "--model", str(spec), "--gen-len", "4", "--ignore-eos", "--dtype",
              "float32", "--device", "cpu", "--hardware", "cpu-server", "--no-progress"]
    outs = {}
    for order in ("grouped", "fcfs"):
        res = CliRunner().invoke(app, [*common, "--output", str(tmp_path / f"{order}.jsonl"), "--coe-order", order])
        assert res.exit_code == 0, res.output
        outs[order] = {r["id"]: (r["model"], r["output_token_ids"]) for r in read_jsonl(tmp_path / f"{order}.jsonl")}
        coe = report_of(tmp_path / f"{order}.jsonl")["policy"]["coe"]
        assert coe["switches"] == (2 if order == "grouped" else 7)
        assert coe["models"]["chat"]["requests"] == 4 and coe["models"]["code"]["requests"] == 3
        assert says(res.output, f"a CoE of chat (4 requests), code (3 requests); {order} order")
        assert says(res.output, "(attention: cpp-") or says(res.output, "(attention: torch")
    assert outs["grouped"] == outs["fcfs"]  # the order changes the switches, not the results
    assert outs["grouped"]["named"][0] == "chat" and outs["grouped"]["r1"][0] == "code"
    alone = CliRunner().invoke(app, ["run", "--dataset", str(write_jsonl(tmp_path / "one.jsonl", records[1:2])),
                                     "--model", str(CKPT), "--output", str(tmp_path / "alone.jsonl"), *common[5:]])
    assert alone.exit_code == 0, alone.output
    assert read_jsonl(tmp_path / "alone.jsonl")[0]["output_token_ids"] == outs["grouped"]["r1"][1]


def test_a_coe_job_carries_the_sampling_fields(tmp_path):
    """n samples, stop strings, seeds and logprobs reach each routed model as a local job's do."""
    spec = _spec(tmp_path)
    extra = {"n": 2, "temperature": 0.9, "seed": 5, "stop": ["e"], "logprobs": 2, "max_tokens": 6}
    records = [{"id": "c", "prompt": "def f(x):\n    return", **extra}, {"id": "s", "prompt": "Tell me", **extra}]
    data = write_jsonl(tmp_path / "req.jsonl", records)
    common = ["--dtype", "float32", "--device", "cpu", "--hardware", "cpu-server", "--no-progress"]
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(spec), "--output",
                                   str(tmp_path / "coe.jsonl"), *common])
    assert res.exit_code == 0, res.output
    coe = {r["id"]: r for r in read_jsonl(tmp_path / "coe.jsonl")}
    assert coe["c"]["model"] == "code" and len(coe["c"]["outputs"]) == 2 and coe["c"]["outputs"][1]["logprobs"]
    alone = CliRunner().invoke(app, ["run", "--dataset", str(write_jsonl(tmp_path / "one.jsonl", records[:1])),
                                     "--model", str(CKPT), "--output", str(tmp_path / "alone.jsonl"), *common])
    assert alone.exit_code == 0, alone.output
    want = read_jsonl(tmp_path / "alone.jsonl")[0]
    assert {k: v for k, v in coe["c"].items() if k != "model"} == {k: v for k, v in want.items() if k != "model"}


def test_unroutable_requests_are_all_reported_before_any_model_loads(tmp_path):
    spec = _spec(tmp_path, {"keywords": {"def ": "code"}})  # no default
    data = write_jsonl(tmp_path / "req.jsonl", [{"id": "x", "prompt": "hi"}, {"id": "y", "prompt": "yo"},
                                                {"id": "z", "prompt": "q", "model": "nope"}])
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(spec), "--output",
                                   str(tmp_path / "o.jsonl"), "--device", "cpu", "--no-progress"])
    assert res.exit_code == 2
    assert says(res.output, "3 request(s) cannot be routed") and says(res.output, "model 'nope' is not one of")
    assert not (tmp_path / "o.jsonl").exists()


def test_skipped_requests_are_counted_once_and_loads_as_done(tmp_path):
    """--skip-bad-lines goes on without a request that cannot be routed and one too long for its model;
    the report's requests, skipped and written add up, and the switches count the loads that ran."""
    spec = _spec(tmp_path, {"keywords": {"def ": "code"}, "default": "chat"})
    data = write_jsonl(tmp_path / "req.jsonl", [{"id": "a", "prompt": "def f(): pass"}, {"id": "b", "prompt": "hi"},
                                                {"id": "c", "prompt": "q", "model": "nope"},
                                                {"id": "d", "prompt": "def " + "x " * 5000}])
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(spec), "--output",
                                   str(tmp_path / "o.jsonl"), "--device", "cpu", "--no-progress", "--gen-len", "2",
                                   "--hardware", "cpu-server", "--skip-bad-lines"])
    assert res.exit_code == 0, res.output
    report = report_of(tmp_path / "o.jsonl")
    assert (report["requests"], report["skipped_requests"], report["written"]) == (2, 2, 2)
    assert [s.split(": ")[0] for s in report["skipped"]] == [f"{data}:3", f"{data}:4"]
    assert report["policy"]["coe"]["switches"] == 2


def test_a_prompt_one_model_cannot_take_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The chat model serves first (more requests), the code model's context is shorter: its too-long
    prompt is named before the chat model loads, not after its results are written."""
    import moelight.engine.session

    spec = _spec(tmp_path)
    data = write_jsonl(tmp_path / "req.jsonl", [{"id": f"c{i}", "prompt": "hello"} for i in range(3)]
                       + [{"id": "long", "prompt": "def " + "x " * 5000}])
    monkeypatch.setattr(moelight.engine.session.EngineSession, "load",
                        lambda self, *a: pytest.fail("a model loaded before every prompt was checked"))
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(spec), "--output",
                                   str(tmp_path / "o.jsonl"), "--device", "cpu", "--no-progress", "--gen-len", "2",
                                   "--hardware", "cpu-server"])
    assert res.exit_code == 2 and says(res.output, f"{data}:4: prompt has") and says(res.output, "--skip-bad-lines")
    assert not (tmp_path / "o.jsonl").exists()
