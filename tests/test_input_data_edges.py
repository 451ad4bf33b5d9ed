"""Input data that used to slip past the readers and go wrong after the model loaded: NaN sampling values,
meta values JSON cannot hold, lone surrogates outside the prompt, compressed or UTF-16 files, CR line
endings. Each is refused (or read) before any model loads, by its file and line."""

from __future__ import annotations

import datetime
import decimal
import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moelight.cli import app
from moelight.sampling.params import SamplingParams
from workloads import DatasetError, load_dataset
from workloads.dataset import parse_dataset

TINY = ["--model", "tiny", "--load-format", "dummy", "--hardware", "cpu-server", "--no-progress", "--gen-len", "2"]


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("record", [
    '{"prompt": "a", "temperature": NaN}',
    '{"prompt": "a", "top_p": NaN}',
    '{"prompt": "a", "min_p": NaN}',
    '{"prompt": "a", "presence_penalty": NaN}',
    '{"prompt": "a", "logit_bias": {"3": NaN}}',
    '{"custom_id": "c", "body": {"prompt": "a", "temperature": NaN}}',
])
def test_a_nan_sampling_value_is_a_bad_record(tmp_path, record):
    data = _jsonl(tmp_path / "d.jsonl", record, record.replace("NaN", "0.5"))
    loaded = load_dataset(data, skip_bad_lines=True)
    assert len(loaded.requests) == 1 and loaded.skipped[0].where == f"{data}:1", loaded.skipped
    assert "nan" in loaded.skipped[0].message.lower()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
def test_sampling_params_refuse_nan(field):
    with pytest.raises(ValueError, match=f"{field} must be a number, got nan"):
        SamplingParams(**{field: float("nan")})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_sampling_params_refuse_an_infinite_divisor(field):
    """Logits are divided by these: inf turns a masked token's -inf into NaN, and the draw then picks
    an arbitrary token (a banned one included), so it is refused with the request, not mid-job."""
    with pytest.raises(ValueError, match=f"{field} must be .* finite, got inf"):
        SamplingParams(**{field: float("inf")})
    SamplingParams(**{field: 1e6})  # large but finite stays valid


def test_parquet_meta_columns_are_made_json_before_the_run(tmp_path):
    table = pa.table({"prompt": ["a", "b"],
                      "when": pa.array([datetime.datetime(2024, 5, 1, 12, 30), None], pa.timestamp("us")),
                      "day": pa.array([datetime.date(2024, 5, 1), None], pa.date32()),
                      "price": pa.array([decimal.Decimal("1.10"), None], pa.decimal128(5, 2)),
                      "score": [float("nan"), float("inf")]})
    pq.write_table(table, tmp_path / "d.parquet")
    a, b = load_dataset(tmp_path / "d.parquet").requests
    assert {k: a.meta[k] for k in ("when", "day", "price", "score")} == {
        "when": "2024-05-01T12:30:00", "day": "2024-05-01", "price": "1.10", "score": None}
    assert b.meta["score"] is None
    json.dumps(a.meta, allow_nan=False)  # strict JSON: the writer cannot fail on it after the run
    pq.write_table(pa.table({"prompt": ["a"], "blob": [b"\x00\x01"]}), tmp_path / "b.parquet")
    with pytest.raises(DatasetError, match=r"b.parquet: column\(s\) 'blob' hold bytes.*drop them"):
        load_dataset(tmp_path / "b.parquet")


@pytest.mark.parametrize("record, field", [
    ('{"prompt": "a", "note": "x\\udc00"}', "field 'note'"),
    ('{"messages": [{"role": "user", "content": "a", "name": "\\udc00"}]}', "field 'messages[0].name'"),
    ('{"id": "\\udc00", "prompt": "a"}', "field 'id'"),
    ('{"prompt": "a", "x\\udc00": 1}', "a field name"),
])
def test_a_lone_surrogate_anywhere_in_a_record_is_refused_by_its_line(tmp_path, record, field):
    data = _jsonl(tmp_path / "d.jsonl", record)
    with pytest.raises(DatasetError, match="lone surrogate") as e:
        load_dataset(data)
    assert str(e.value).startswith(f"{data}:1: {field} holds a lone surrogate"), str(e.value)


def test_nan_in_a_jsonl_extra_field_is_written_as_null(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", '{"prompt": "a", "score": NaN, "deep": [Infinity]}')
    (req,) = load_dataset(data).requests
    assert (req.meta["score"], req.meta["deep"]) == (None, [None])


def test_a_prompt_record_with_a_custom_id_is_a_prompt_record(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", '{"custom_id": "a", "prompt": "x"}', '{"custom_id": "b", "prompt": "y"}')
    loaded = load_dataset(data)
    assert loaded.format == "jsonl" and [r.meta["custom_id"] for r in loaded.requests] == ["a", "b"]


def test_the_format_is_told_by_the_first_record_that_shows_one(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", '{"question": "x"}', '{"prompt": "y"}')
    loaded = load_dataset(data, skip_bad_lines=True)
    assert loaded.format == "jsonl" and [r.prompt for r in loaded.requests] == ["y"]
    assert loaded.skipped[0].where == f"{data}:1" and "missing required field 'prompt'" in loaded.skipped[0].message
    oai = _jsonl(tmp_path / "o.jsonl", '{"custom_id": "a"}', '{"custom_id": "b", "body": {"prompt": "y"}}')
    loaded = load_dataset(oai, skip_bad_lines=True)
    assert loaded.format == "openai" and "missing required field 'body'" in loaded.skipped[0].message
    with pytest.raises(DatasetError, match="cannot tell the dataset format"):
        load_dataset(_jsonl(tmp_path / "n.jsonl", '{"question": "x"}'))


def test_a_prompt_column_of_another_name_is_named_in_errors_and_a_prompt_column_is_meta(tmp_path):
    table = pa.table({"question": ["q1", None, " "], "prompt": ["p1", "p2", "p3"], "key": ["k1", "k2", "k3"],
                      "id": ["i1", "i2", "i3"]})
    pq.write_table(table, tmp_path / "d.parquet")
    loaded = load_dataset(tmp_path / "d.parquet", prompt_column="question", id_column="key", skip_bad_lines=True)
    req, blank = loaded.requests  # blank text is a prompt, as in vLLM
    assert (req.id, req.prompt, req.meta["prompt"], req.meta["id"]) == ("k1", "q1", "p1", "i1")
    assert (blank.id, blank.prompt) == ("k3", " ")
    assert [p.message for p in loaded.skipped] == ["missing required field 'question'"]


def _file_and_pipe(path: Path, data: bytes, **kw) -> list:
    """load_dataset of `data` as a file and as a pipe's bytes (what /dev/stdin gives)."""
    path.write_bytes(data)
    return [parse_dataset(path, str(path), **kw), parse_dataset(data, str(path), **kw)]


def test_a_gzip_compressed_jsonl_is_read_from_a_file_and_a_pipe(tmp_path):
    data = gzip.compress(b'{"prompt": "a"}\n{"prompt": "b"}\n')
    for requests, problems, fmt in _file_and_pipe(tmp_path / "d.jsonl.gz", data):
        assert ([r.prompt for r in requests], problems, fmt) == (["a", "b"], [], "jsonl")


def test_cr_line_endings_read_alike_from_a_file_and_a_pipe(tmp_path):
    data = b'{"prompt": "a"}\r{"prompt": "b"}\r'
    (tmp_path / "d.jsonl").write_bytes(data)
    errors = []
    for source in (tmp_path / "d.jsonl", data):
        with pytest.raises(DatasetError, match="bare carriage return") as e:
            parse_dataset(source, "d.jsonl")
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    crlf = b'{"prompt": "a"}\r\n{"prompt": "b"}\r\n'
    (f_req, _, _), (p_req, _, _) = _file_and_pipe(tmp_path / "w.jsonl", crlf)
    assert [(r.id, r.prompt) for r in f_req] == [(r.id, r.prompt) for r in p_req] == [("1", "a"), ("2", "b")]


@pytest.mark.parametrize("data, message", [
    ('{"prompt": "a"}\n'.encode("utf-16"), "UTF-16 text; moelight reads UTF-8: convert it"),
    ('{"prompt": "a"}\n'.encode("utf-16-le"), "UTF-16 text"),
    (b"prompt,id\nhello,1\n", "looks like CSV/TSV"),
    (b"prompt\tid\nhello\t1\n", "looks like CSV/TSV"),
    (b'{"prompt": "a\x01"}\n', "(Invalid control character at column"),
])
def test_a_file_that_is_not_json_lines_says_what_it_is(tmp_path, data, message):
    (tmp_path / "d.jsonl").write_bytes(data)
    with pytest.raises(DatasetError) as e:
        load_dataset(tmp_path / "d.jsonl")
    assert message in str(e.value) and " at at " not in str(e.value), str(e.value)


def test_an_openai_record_refused_at_read_is_answered_under_its_custom_id(tmp_path):
    """README: an OpenAI batch output answers each unusable request with an error line under its custom_id,
    those refused when the file is read too (one line an id; resume counts it finished)."""
    def line(cid, body):
        return json.dumps({**({"custom_id": cid} if cid else {}), "url": "/v1/completions", "body": body})
    data = _jsonl(tmp_path / "b.jsonl", line("ok", {"prompt": "fine", "max_tokens": 2}),
                  line("list", {"prompt": ["a", "b"]}), line("num", {"prompt": 7}),
                  line("ok", {"prompt": ""}), line(None, {"prompt": "x"}))
    out = tmp_path / "o.jsonl"
    args = ["run", "--dataset", str(data), "--output", str(out), *TINY, "--skip-bad-lines"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == ["list", "num", "ok"]
    errors = {x["custom_id"]: x["error"] for x in lines if x["error"]}
    assert errors["list"]["code"] == "invalid_request" and f"{data}:2: body.prompt" in errors["list"]["message"]
    assert f"{data}:3: body.prompt must be a string" in errors["num"]["message"]
    again = CliRunner().invoke(app, [*args, "--resume"])
    assert again.exit_code == 0, again.output
    assert len(out.read_text().splitlines()) == 3  # nothing answered twice


def test_a_misspelled_sampling_field_is_warned_of_with_the_name_meant(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", '{"prompt": "a", "temprature": 0.2, "category": "x"}',
                  '{"prompt": "b", "temprature": 0.2, "top_pp": 0.5}')
    warnings = load_dataset(data).warnings
    assert len(warnings) == 2 and "category" not in " ".join(warnings)
    assert warnings[0] == (f"{data}: field 'temprature' (2 record(s), first at {data}:1) is not one moelight reads "
                           "and is kept in meta; did you mean 'temperature'?")
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), *TINY])
    assert res.exit_code == 0, res.output
    notes = json.loads(Path(f"{out}.report.json").read_text())["notes"]
    assert any("did you mean 'top_p'" in n for n in notes), notes


def test_an_unread_openai_body_field_is_warned_of_once_per_name(tmp_path):
    """A body's misspelled field left the request on the run's defaults without a word (it is not kept in
    meta); each unread name is said once, with the name meant or as ignored, as vLLM's server logs them."""
    body = '"messages": [{"role": "user", "content": "hi"}], "temprature": 0.5, "max_tokns": 3, "frobnicate": 1'
    data = _jsonl(tmp_path / "b.jsonl", *(f'{{"custom_id": "{c}", "body": {{{body}}}}}' for c in "ab"),
                  '{"custom_id": "c", "body": {"prompt": "x", "model": "m", "top_logprobs": null}}')
    warnings = load_dataset(data).warnings
    assert warnings == [
        f"{data}: field 'body.temprature' (2 record(s), first at {data}:1) is not one moelight reads: did you "
        "mean 'temperature'?",
        f"{data}: field 'body.max_tokns' (2 record(s), first at {data}:1) is not one moelight reads: did you "
        "mean 'max_tokens'?",
        f"{data}: field 'body.frobnicate' (2 record(s), first at {data}:1) is not one moelight reads: moelight "
        "ignores it"]
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), *TINY])
    assert res.exit_code == 0, res.output
    notes = json.loads(Path(f"{out}.report.json").read_text())["notes"]
    assert sum("did you mean 'temperature'" in n for n in notes) == 1, notes
