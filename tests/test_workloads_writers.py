"""Streaming result writers, OpenAI Batch output shape, parquet, and resume after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workloads import (
    OutputExistsError,
    Request,
    ResultWriter,
    TurnOutput,
    build_error_result,
    build_result,
    finished_ids,
    output_format,
    read_results,
    sidecar_path,
)


def result(rid: str, text: str = "out", **kw) -> dict:
    req = Request(id=rid, prompt=f"prompt {rid}", meta=kw.pop("meta", {}))
    return build_result(req, [TurnOutput(text, [5, 6, 7], "stop", prompt_tokens=4)], **kw)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_build_result_shape_multi_turn():
    req = Request(id="q1", messages=[{"role": "user", "content": "A?"}], followups=["B?"],
                  meta={"category": "x"})
    r = build_result(req, [TurnOutput("a", [1, 2], "stop", 10, user="A?"),
                           TurnOutput("b", [3, 4, 5], "length", 20, user="B?")], model="m")
    assert r["id"] == "q1" and r["output"] == "b" and r["output_token_ids"] == [3, 4, 5]
    assert r["finish_reason"] == "length" and r["prompt_tokens"] == 30 and r["completion_tokens"] == 5
    assert [t["output"] for t in r["turns"]] == ["a", "b"] and r["turns"][0]["user"] == "A?"
    assert r["messages"] == req.messages and r["meta"] == {"category": "x"} and r["model"] == "m"
    assert "turns" not in result("x")


def test_jsonl_streaming_visible_before_close(tmp_path):
    out = tmp_path / "sub" / "out.jsonl"
    with ResultWriter(out) as w:
        w.write(result("a", "hello"))
        got = lines(out)  # on disk right after write(), before close
        assert [g["id"] for g in got] == ["a"] and got[0]["output"] == "hello"
        assert got[0]["output_token_ids"] == [5, 6, 7] and got[0]["finish_reason"] == "stop"
        assert got[0]["prompt"] == "prompt a"
        w.write(result("b"))
        assert len(lines(out)) == 2 and w.written == 2
    assert finished_ids(out) == {"a", "b"}
    with pytest.raises(ValueError, match="closed"):
        w.write(result("c"))


def test_refuses_existing_output(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultWriter(out) as w:
        w.write(result("a"))
    with pytest.raises(OutputExistsError, match="--resume.*--overwrite"):
        ResultWriter(out)
    with pytest.raises(ValueError, match="not both"):
        ResultWriter(out, resume=True, overwrite=True)
    with ResultWriter(out, overwrite=True) as w:
        w.write(result("z"))
    assert finished_ids(out) == {"z"}


def test_bad_results_rejected(tmp_path):
    with ResultWriter(tmp_path / "o.jsonl") as w:
        with pytest.raises(ValueError, match="missing"):
            w.write({"id": "a", "output": "x"})
        with pytest.raises(ValueError, match="finish_reason"):
            w.write({**result("a"), "finish_reason": "eos"})
        with pytest.raises(ValueError, match="string 'id'"):
            w.write({**result("a"), "id": 3})
    assert (tmp_path / "o.jsonl").read_text() == ""


def test_resume_with_truncated_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    with ResultWriter(out) as w:
        for rid in ("a", "b", "c"):
            w.write(result(rid))
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 25])  # a kill in the middle of writing "c"
    assert finished_ids(out) == {"a", "b"}
    with ResultWriter(out, resume=True) as w:
        w.write(result("c"))
        w.write(result("d"))
    assert [r["id"] for r in lines(out)] == ["a", "b", "c", "d"]
    assert finished_ids(out) == {"a", "b", "c", "d"}


def test_resume_keeps_complete_line_without_newline(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(result("a")))  # complete record, newline lost
    assert finished_ids(out) == {"a"}
    with ResultWriter(out, resume=True) as w:
        w.write(result("b"))
    assert [r["id"] for r in lines(out)] == ["a", "b"]


def test_finished_ids_missing_and_corrupt_middle(tmp_path):
    assert finished_ids(tmp_path / "none.jsonl") == set()
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(result("a")) + "\n{garbage\n" + json.dumps(result("b")) + "\n")
    with pytest.raises(ValueError, match=r"out.jsonl:2"):
        finished_ids(out)


def test_openai_output_shape(tmp_path):
    out = tmp_path / "out.jsonl"
    assert output_format(out, "openai") == "openai" and output_format(out) == "jsonl"
    chat = result("req-1", "Hi!", model="/models/served", meta={"custom_id": "req-1", "model": "mixtral-8x7b",
                                                                "url": "/v1/chat/completions"})  # the body's name
    comp = result("req-2", "text", meta={"custom_id": "req-2", "url": "/v1/completions"})
    with ResultWriter(out, format="openai", model_name="moelight-default") as w:
        w.write(chat)
        w.write(comp)
        w.write(build_error_result(Request(id="req-3", prompt="x" * 10), "prompt too long", "context_length"))
    a, b, c = lines(out)
    assert set(a) == {"id", "custom_id", "response", "error"} and a["error"] is None
    assert a["id"].startswith("batch_req_") and a["custom_id"] == "req-1"
    resp = a["response"]
    assert resp["status_code"] == 200 and isinstance(resp["request_id"], str)
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["model"] == "/models/served"  # what answered, not the body's
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["choices"][0]["index"] == 0
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    bb = b["response"]["body"]
    assert bb["object"] == "text_completion" and bb["choices"][0]["text"] == "text"
    assert bb["model"] == "moelight-default"
    assert c["response"] is None and c["error"] == {"code": "context_length", "message": "prompt too long"}
    assert finished_ids(out) == {"req-1", "req-2", "req-3"}
    assert body["choices"][0]["stop_reason"] is None and "prompt_logprobs" not in body


def test_openai_output_carries_vllms_stop_reason_and_prompt_logprobs(tmp_path):
    """Which stop string or stop token ended a choice, and the prompt's logprobs asked for: computed, they
    were left out of the OpenAI-shaped line."""
    out = tmp_path / "out.jsonl"
    prompt_lps = [None, {"token": "b", "logprob": -1.5, "rank": 2, "top": []}]
    stopped = result("r", "x", meta={"custom_id": "r", "url": "/v1/completions"}, prompt_logprobs=prompt_lps)
    stopped["stop_reason"] = 277
    with ResultWriter(out, format="openai") as w:
        w.write(stopped)
    body = lines(out)[0]["response"]["body"]
    assert body["choices"][0]["stop_reason"] == 277 and body["prompt_logprobs"] == prompt_lps


def test_parquet_round_trip(tmp_path):
    out = tmp_path / "out.parquet"
    req = Request(id="m", messages=[{"role": "user", "content": "A?"}], followups=["B?"],
                  meta={"k": [1, "x"]})
    multi = build_result(req, [TurnOutput("a", [1], "stop", 3, user="A?"), TurnOutput("b", [2], "length", 5)])
    records = [result("a", "héllo"), multi]
    with ResultWriter(out) as w:
        assert w.format == "parquet"
        w.write(records[0])
        assert not out.exists() and lines(sidecar_path(out))[0]["id"] == "a"  # streamed to the sidecar
        w.write(records[1])
    assert out.exists() and not sidecar_path(out).exists()
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["a", "m"]
    assert table.column("output_token_ids").to_pylist() == [[5, 6, 7], [2]]
    assert read_results(out) == [{k: r.get(k) for k in table.column_names} for r in records]
    assert finished_ids(out) == {"a", "m"}


def test_parquet_resume_after_crash(tmp_path):
    out = tmp_path / "out.parquet"
    with ResultWriter(out) as w:
        w.write(result("a"))
    # second run killed: sidecar holds b and half of c, parquet not rewritten
    w = ResultWriter(out, resume=True)
    w.write(result("b"))
    w._f.write(json.dumps(result("c"))[:30])
    w._f.close()  # the process dies here: no close(), no conversion
    assert finished_ids(out) == {"a", "b"}
    with pytest.raises(OutputExistsError):
        ResultWriter(out)
    with ResultWriter(out, resume=True) as w2:
        w2.write(result("c"))
    assert pq.read_table(out).column("id").to_pylist() == ["a", "b", "c"]
    assert not sidecar_path(out).exists()


def test_parquet_columns_have_one_type_whatever_the_rows(tmp_path):
    """stop_reason is a token id or a string; output_token_ids of error rows only is empty: each result
    field has one type in every file, so two runs' outputs read as one dataset."""
    import pyarrow.dataset as ds

    token_stop = result("t") | {"stop_reason": 277}
    string_stop = result("s") | {"stop_reason": "e"}
    for name, rows in (("a", [token_stop]), ("b", [string_stop]), ("c", [token_stop, string_stop])):
        with ResultWriter(tmp_path / f"{name}.parquet") as w:
            for r in rows:
                w.write(r)
    table = ds.dataset([tmp_path / f"{n}.parquet" for n in "bac"]).to_table()
    assert table.schema.field("stop_reason").type == pa.string()
    with ResultWriter(tmp_path / "d.parquet") as w:  # no stop_reason, no logprobs in any row
        w.write(result("plain"))
    first = ds.dataset([tmp_path / f"{n}.parquet" for n in "dac"]).to_table()  # the first file's schema rules
    assert sorted(first.column("stop_reason").to_pylist(), key=str) == sorted([None, "277", "277", '"e"'], key=str)
    assert [r["stop_reason"] for r in read_results(tmp_path / "c.parquet")] == [277, "e"]
    assert read_results(tmp_path / "a.parquet")[0]["stop_reason"] == 277


def test_parquet_rows_in_both_the_file_and_its_stream_are_written_once(tmp_path):
    """A run killed after its parquet was rewritten but before its stream was removed: resume keeps one
    row per id."""
    out = tmp_path / "out.parquet"
    with ResultWriter(out) as w:
        w.write(result("a"))
        w.write(result("b"))
    sidecar_path(out).write_text(json.dumps(result("b")) + "\n")  # the stream the kill left behind
    with ResultWriter(out, resume=True) as w:
        w.write(result("c"))
    assert pq.read_table(out).column("id").to_pylist() == ["a", "b", "c"]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_an_output_deleted_while_the_job_runs_is_an_error_not_results_written(tmp_path, fmt):
    """The run appended to a file no path named any more: it reported its results written."""
    from workloads import OutputWriteError

    out = tmp_path / f"out.{fmt}"
    w = ResultWriter(out)
    w.write(result("a"))
    w.stream_path.unlink()
    with pytest.raises(OutputWriteError, match="deleted or replaced while the job ran: the 1 result") as e:
        w.close()
    assert "are in it" not in str(e.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_overwrite_through_a_symbolic_link_replaces_its_file_and_keeps_the_link(tmp_path, fmt):
    """The link was replaced by a new file, and the file it named kept the old results."""
    real = tmp_path / "runs" / f"real.{fmt}"
    real.parent.mkdir()
    with ResultWriter(real) as w:
        w.write(result("old"))
    link = tmp_path / f"out.{fmt}"
    link.symlink_to(real)
    with ResultWriter(link, overwrite=True) as w:
        w.write(result("new"))
    assert link.is_symlink() and link.resolve() == real
    assert finished_ids(real) == {"new"} and not list(real.parent.glob("*.tmp"))
