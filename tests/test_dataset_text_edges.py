"""Datasets as users write them, read as they mean: a lone surrogate is a bad record (by its line, not a
traceback), OpenAI-style tool-call turns reach the chat template whole, a second turn that cannot be
formatted is refused before turn 1 runs, stop strings that begin with a multi-byte character stop, and
parquet rows take what jsonl records take (dictionary-encoded strings, sampling columns, meta), and blank
prompts run as vLLM runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from moelight.cli import app
from moelight.engine.sequence import Sequence
from moelight.sampling.params import SamplingParams
from moelight.tokenization.byte_tokenizer import ByteTokenizer
from tests.cli_text import says
from workloads import load_dataset, read_dataset

STDLIB = Path(__file__).parent / "data" / "stdlib-moe"  # a BPE tokenizer without a chat template
TINY = ["--model", "tiny", "--load-format", "dummy", "--hardware", "cpu-server", "--no-progress", "--gen-len", "2"]


def _jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_lone_surrogate_is_a_bad_record_by_its_line(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", json.dumps({"id": "ok", "prompt": "fine"}),
                  '{"id": "s", "prompt": "abc \\ud800 def"}')
    out = tmp_path / "o.jsonl"
    refused = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), *TINY])
    assert refused.exit_code == 2 and f"{data}:2" in refused.output and "lone surrogate" in refused.output
    skipped = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), *TINY,
                                       "--skip-bad-lines"])
    assert skipped.exit_code == 0, skipped.output
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["ok"]


def test_tool_call_turns_keep_their_fields(tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "21C", "tool_call_id": "c1", "name": "f"}]
    data = _jsonl(tmp_path / "d.jsonl", json.dumps({"id": "t", "messages": messages}))
    (req,) = load_dataset(data).requests
    parsed = {**call, "function": {"name": "f", "arguments": {}}}  # the arguments' JSON text read, as vLLM does
    assert req.messages == [messages[0], {"role": "assistant", "content": None, "tool_calls": [parsed]},
                            messages[2]]
    bad = _jsonl(tmp_path / "b.jsonl", json.dumps({"id": "u", "messages": [{"role": "user", "content": None}]}),
                 json.dumps({"id": "ok", "prompt": "x"}))
    assert "content may be null only in an assistant turn with tool_calls" in str(load_dataset(
        bad, skip_bad_lines=True).skipped[0])


def test_a_second_turn_without_a_chat_template_is_refused_before_turn_one(tmp_path, monkeypatch):
    import moelight.engine.session

    data = _jsonl(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "x", "turns": ["a?", "b?"]}))
    monkeypatch.setattr(moelight.engine.session.EngineSession, "engine",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("turn 1 ran")))
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(tmp_path / "o.jsonl"),
                                   "--model", str(STDLIB), "--hardware", "cpu-server", "--no-progress",
                                   "--turn", "2"])
    assert res.exit_code == 2 and f"{data}:1" in res.output and "has no chat_template" in res.output, res.output
    # the user's question is named, not the probe conversation moelight formats to check it
    assert "multi-turn question" in res.output and "3 messages" not in res.output, res.output


def test_a_stop_string_that_begins_with_a_multibyte_character_stops():
    tok = ByteTokenizer()
    for stop in ("世", "世界", " 世"):
        seq = Sequence(0, 1, SamplingParams(max_tokens=64, stop=[stop]))
        ids = tok.encode("a 世界 b", add_bos=False)
        ended = [seq.append(t, set(), lambda ids, skip, context=(): tok.decode(ids)) for t in ids]
        assert True in ended and seq.finish == "stop" and seq.stop_reason == stop, stop
        assert seq.text == "a" + ("" if stop.startswith(" ") else " "), (stop, seq.text)


def test_parquet_rows_read_as_jsonl_records(tmp_path):
    table = pa.table({"prompt": pa.array(["one", "two"]).dictionary_encode(), "n": [2, 1],
                      "stop": [["x"], None], "category": ["a", "b"]})
    pq.write_table(table, tmp_path / "d.parquet")
    a, b = load_dataset(tmp_path / "d.parquet").requests
    assert (a.prompt, a.sampling["n"], a.sampling["stop"], a.meta["category"]) == ("one", 2, ["x"], "a")
    assert (b.prompt, b.sampling.get("n", 1), "stop" in b.sampling, b.meta["category"]) == ("two", 1, False, "b")


def test_blank_prompts_run_and_a_prompt_of_no_tokens_is_refused_by_its_line(tmp_path):
    """As vLLM: blank text is a prompt (spaces and newlines are tokens); only a prompt of no tokens is refused,
    by its line and before the model loads (this BPE tokenizer adds no BOS, so "" has none)."""
    body = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "  "}}
    assert read_dataset(_jsonl(tmp_path / "b.jsonl", json.dumps(body)))[0].prompt == "  "
    data = _jsonl(tmp_path / "d.jsonl", *(json.dumps({"id": k, "prompt": p})
                                          for k, p in (("ws", "   "), ("nl", "\n"), ("none", ""), ("ok", "Hi"))))
    args = ["run", "--dataset", str(data), "--output", str(tmp_path / "o.jsonl"), "--model", str(STDLIB),
            "--hardware", "cpu-server", "--no-progress", "--gen-len", "2", "--dtype", "float32"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"{data}:3: prompt is empty: it has no tokens"), res.output
    res = CliRunner().invoke(app, [*args, "--skip-bad-lines"])
    assert res.exit_code == 0, res.output
    written = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in written) == ["nl", "ok", "ws"]


def test_blank_chat_turns_run_and_a_chat_of_no_tokens_is_refused_by_its_line(tmp_path):
    """As vLLM renders them: a blank user or assistant message, followup or MT-Bench turn is a turn (the chat
    template gives it tokens); only a conversation that renders to no tokens is refused, by its line, before the
    model loads (this BPE tokenizer has no template and adds no BOS: a lone user turn "" is no tokens)."""
    blank_user = [{"role": "user", "content": "  "}]
    body = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": blank_user}}
    assert read_dataset(_jsonl(tmp_path / "b.jsonl", json.dumps(body)))[0].messages == blank_user
    data = _jsonl(tmp_path / "d.jsonl", *(json.dumps(r) for r in (
        {"id": "user", "messages": [{"role": "user", "content": ""}]},
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": " "}]}]},
        {"id": "assistant", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                                         {"role": "user", "content": "b"}]},
        {"id": "followup", "prompt": "a", "followups": ["", "\n"]})))
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), *TINY])
    assert res.exit_code == 0, res.output
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(written) == ["assistant", "followup", "parts", "user"] and len(written["followup"]["turns"]) == 3
    mt = _jsonl(tmp_path / "q.jsonl", json.dumps({"question_id": 1, "category": "c", "turns": [" ", ""]}))
    res = CliRunner().invoke(app, ["run", "--dataset", str(mt), "--output", str(tmp_path / "m.jsonl"), *TINY,
                                   "--turn", "2"])
    assert res.exit_code == 0, res.output
    none = _jsonl(tmp_path / "n.jsonl", json.dumps({"id": "n", "messages": [{"role": "user", "content": ""}]}))
    res = CliRunner().invoke(app, ["run", "--dataset", str(none), "--output", str(tmp_path / "x.jsonl"), "--model",
                                   str(STDLIB), "--hardware", "cpu-server", "--no-progress", "--dtype", "float32"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"{none}:1: prompt is empty: it has no tokens"), res.output
