"""`moelight run` end to end on the `tiny` preset, its bad inputs, and Ctrl-C + --resume.

Bad inputs exit with code 2 and one clear message naming the file and the problem, never
a traceback. Ctrl-C is simulated by raising KeyboardInterrupt after some results are written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moelight.engine.generation
from moelight.cli import app
from tests.cli_text import says

# A named CPU hardware spec: planning needs no profile of this machine (and writes no cache).
HW = ["--hardware", "cpu-server"]
TINY = ["--model", "tiny", "--load-format", "dummy", "--no-progress", *HW]


def invoke(*args: str | Path):
    return CliRunner().invoke(app, ["run", *map(str, args)])


def assert_user_error(result, *needles: str) -> str:
    """Exit 2, no traceback, and a message that holds every needle."""
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert "Traceback" not in out
    for n in needles:
        assert says(out, n), (n, out)
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report_of(output: Path) -> dict:
    return json.loads(output.with_name(output.name + ".report.json").read_text())


def prompts_file(tmp_path: Path, n: int = 6) -> Path:
    records = [{"id": f"p{i}", "prompt": "Tell me about " + "cats " * (i * 3 + 1)} for i in range(n)]
    return write_jsonl(tmp_path / "prompts.jsonl", records)


# ----------------------------------------------------------------------------- end to end


def _mtbench_file(path: Path) -> Path:
    """A small MT-Bench question.jsonl in FastChat's format: two turns per question."""
    questions = [{"question_id": 81 + i, "category": cat, "turns": [first, second]} for i, (cat, first, second) in
                 enumerate([("writing", "Compose a travel blog post about Hawaii.", "Rewrite it starting every "
                             "sentence with the letter A."),
                            ("math", "What is the area of a triangle with vertices (0,0), (-1,1), (3,3)?",
                             "What is the area of the circle circumscribing it?"),
                            ("coding", "Write a function that reverses a string.", "Now make it handle Unicode."),
                            ("reasoning", "Which is heavier, a kilo of feathers or a kilo of steel?",
                             "Explain why in one sentence.")])]
    return write_jsonl(path, questions)


def test_mtbench_two_turns(tmp_path):
    dataset = _mtbench_file(tmp_path / "question.jsonl")
    questions = read_jsonl(dataset)
    out = tmp_path / "answers.jsonl"
    r = invoke("--dataset", dataset, *TINY, "--output", out, "--turn", "2", "--num-requests", "3",
               "--gen-len", "4", "--ignore-eos", "--batch-size", "2", "--micro-batch-size", "1")
    assert r.exit_code == 0, (r.output, r.exception)
    recs = read_jsonl(out)
    assert sorted(x["id"] for x in recs) == sorted(str(q["question_id"]) for q in questions[:3])
    by_id = {str(q["question_id"]): q for q in questions}
    for rec in recs:
        turns = rec["turns"]
        assert len(turns) == 2
        assert [t["user"] for t in turns] == by_id[rec["id"]]["turns"][:2]  # each turn names what it answered
        assert [len(t["output_token_ids"]) for t in turns] == [4, 4]
        assert rec["completion_tokens"] == 8 and rec["output_token_ids"] == turns[1]["output_token_ids"]
        # the second turn's prompt holds the first turn's prompt and answer
        assert turns[1]["prompt_tokens"] > turns[0]["prompt_tokens"] + 4
    rep = report_of(out)
    assert rep["requests"] == 3 and not rep["interrupted"]
    assert rep["generated_tokens"] == sum(x["completion_tokens"] for x in recs) == 24
    assert rep["prompt_tokens"] == sum(x["prompt_tokens"] for x in recs)
    assert rep["decode_tokens"] == 24 - 6  # all but the first token of each of 6 turns
    for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "end_to_end_tokens_per_s"):
        assert rep[k] > 0, k
    assert says(r.output, "decode") and says(r.output, "tok/s")


def test_openai_batch_in_openai_batch_out(tmp_path):
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3}},
        {"custom_id": "cmpl-2", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon a time", "max_tokens": 5}},
        {"custom_id": "chat-3", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Why?"}]}},
    ]
    ds = write_jsonl(tmp_path / "batch.jsonl", lines)
    out = tmp_path / "batch_out.jsonl"
    r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "4", "--ignore-eos")
    assert r.exit_code == 0, (r.output, r.exception)
    recs = {x["custom_id"]: x for x in read_jsonl(out)}
    assert set(recs) == {"chat-1", "cmpl-2", "chat-3"}
    for cid, want_tokens in (("chat-1", 3), ("cmpl-2", 5), ("chat-3", 4)):
        rec = recs[cid]
        assert rec["error"] is None and rec["id"].startswith("batch_req_")
        assert rec["response"]["status_code"] == 200
        body = rec["response"]["body"]
        assert body["usage"]["completion_tokens"] == want_tokens
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + want_tokens
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length"
        if cid.startswith("cmpl"):
            assert body["object"] == "text_completion" and isinstance(choice["text"], str)
        else:
            assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
        assert body["model"] == "tiny"  # the model that answered, not the body's "m"
    assert report_of(out)["warnings"]["counts"]["other_model"] == 3  # said, not answered as "m" silently


def test_parquet_output(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "out.parquet"
    r = invoke("--dataset", prompts_file(tmp_path), *TINY, "--output", out, "--gen-len", "3", "--ignore-eos")
    assert r.exit_code == 0, (r.output, r.exception)
    rows = pq.read_table(out).to_pylist()
    assert sorted(x["id"] for x in rows) == [f"p{i}" for i in range(6)]
    assert all(len(x["output_token_ids"]) == 3 for x in rows)
    assert not list(tmp_path.glob("*.partial.jsonl"))
    assert report_of(out)["generated_tokens"] == 18


def test_jsonl_per_request_max_tokens_and_greedy_determinism(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "abc", "max_tokens": 2},
                                           {"id": "b", "prompt": "hello world"}])
    outs = []
    for name in ("o1.jsonl", "o2.jsonl"):
        r = invoke("--dataset", ds, *TINY, "--output", tmp_path / name, "--gen-len", "5", "--ignore-eos",
                   "--batch-size", "1" if name == "o1.jsonl" else "2")
        assert r.exit_code == 0, (r.output, r.exception)
        outs.append({x["id"]: x for x in read_jsonl(tmp_path / name)})
    assert len(outs[0]["a"]["output_token_ids"]) == 2 and len(outs[0]["b"]["output_token_ids"]) == 5
    for k in ("a", "b"):
        assert outs[0][k]["output_token_ids"] == outs[1][k]["output_token_ids"]


def test_static_batches_and_refill_give_the_same_results(tmp_path):
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": "x" * (i + 1), "max_tokens": 1 + i % 4}
                                           for i in range(7)])
    outs = {}
    for flag in ("--refill", "--static-batches"):
        out = tmp_path / f"{flag[2:]}.jsonl"
        r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "5", "--ignore-eos", "--batch-size", "3",
                   flag)
        assert r.exit_code == 0, (r.output, r.exception)
        assert says(r.output, "refill batching" if flag == "--refill" else "static batching")
        assert report_of(out)["policy"]["batching"] == flag[2:].removesuffix("-batches")
        outs[flag] = {x["id"]: x["output_token_ids"] for x in read_jsonl(out)}
    assert outs["--refill"] == outs["--static-batches"] and len(outs["--refill"]) == 7


# ----------------------------------------------------------------------------- bad inputs


def test_malformed_jsonl_lines_all_reported(tmp_path):
    ds = write_jsonl(tmp_path / "bad.jsonl", [
        {"id": "ok1", "prompt": "fine"},
        "{not json",
        {"id": "ok3", "prompt": "fine too"},
        {"id": "x4", "text": "no prompt field"},
        "[1, 2]",
        {"id": "ok6", "prompt": "last"},
    ])
    out = tmp_path / "o.jsonl"
    r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "2")
    msg = assert_user_error(r, f"{ds}:2", f"{ds}:4", f"{ds}:5", "--skip-bad-lines")
    assert f"{ds}:1:" not in msg and f"{ds}:3:" not in msg
    assert not out.exists()
    r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "2", "--skip-bad-lines")
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(x["id"] for x in read_jsonl(out)) == ["ok1", "ok3", "ok6"]
    assert report_of(out)["skipped_requests"] == 3


def test_skipped_records_and_prompts_are_named_in_the_report(tmp_path):
    """A pipeline must account for every id: a record the reader skipped and a prompt too long for the
    model are both listed, by file:line and why, in the summary and the report."""
    ds = write_jsonl(tmp_path / "d.jsonl", [{"id": "ok", "prompt": "fine"}, {"id": "bad"},
                                           {"id": "long", "prompt": "x" * 3000}])
    out = tmp_path / "o.jsonl"
    r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "2", "--skip-bad-lines")
    assert r.exit_code == 0, (r.output, r.exception)
    skipped = report_of(out)["skipped"]
    assert [s.split(": ")[0] for s in skipped] == [f"{ds}:2", f"{ds}:3"], skipped
    assert "missing required field" in skipped[0] and "the model's context is" in skipped[1]
    assert f"{ds}:3: prompt has 3001 tokens" in r.output.replace("\n", " ")


def test_openai_batch_output_answers_a_skipped_request_with_an_error_line(tmp_path):
    """OpenAI's and vLLM's batch runners write an error line for a request they could not serve: a
    pipeline that joins on custom_id finds every request it sent; resume counts the line finished."""
    body = lambda content: {"messages": [{"role": "user", "content": content}], "max_tokens": 2}  # noqa: E731
    ds = write_jsonl(tmp_path / "b.jsonl", [
        {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": body("fine")},
        {"custom_id": "long", "method": "POST", "url": "/v1/chat/completions", "body": body("x" * 3000)}])
    out = tmp_path / "o.jsonl"
    r = invoke("--dataset", ds, *TINY, "--output", out, "--skip-bad-lines")
    assert r.exit_code == 0, (r.output, r.exception)
    lines = {x["custom_id"]: x for x in read_jsonl(out)}
    assert set(lines) == {"ok", "long"} and lines["ok"]["error"] is None
    err = lines["long"]
    assert err["response"] is None and err["error"]["code"] == "invalid_request"
    assert "the model's context is" in err["error"]["message"] and err["id"].startswith("batch_req_")
    again = invoke("--dataset", ds, *TINY, "--output", out, "--skip-bad-lines", "--resume")
    assert again.exit_code == 0, again.output
    assert len(read_jsonl(out)) == 2  # nothing run or written twice


def test_a_blank_prompt_runs(tmp_path):
    """As in vLLM: blank text has tokens (here the byte tokenizer's BOS and the spaces); a prompt of no tokens is
    refused by its line (tests/test_dataset_text_edges.py)."""
    ds = write_jsonl(tmp_path / "e.jsonl", [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "   "}])
    res = invoke("--dataset", ds, *TINY, "--output", tmp_path / "o.jsonl", "--gen-len", "2")
    assert res.exit_code == 0, res.output
    assert sorted(r["prompt"] for r in read_jsonl(tmp_path / "o.jsonl")) == ["   ", "x"]


def test_prompt_longer_than_context(tmp_path):
    ds = write_jsonl(tmp_path / "long.jsonl", [{"id": "a", "prompt": "short"},
                                              {"id": "b", "prompt": "z" * 2100}, {"id": "c", "prompt": "ok"}])
    out = tmp_path / "o.jsonl"
    assert_user_error(invoke("--dataset", ds, *TINY, "--output", out),
                      f"{ds}:2", "2101 tokens", "context is 2048")
    r = invoke("--dataset", ds, *TINY, "--output", out, "--skip-bad-lines", "--gen-len", "2")
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(x["id"] for x in read_jsonl(out)) == ["a", "c"]


def test_dataset_does_not_exist(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert_user_error(invoke("--dataset", missing, *TINY, "--output", tmp_path / "o.jsonl"),
                      str(missing), "does not exist")


def test_output_exists_needs_resume_or_overwrite(tmp_path):
    ds = prompts_file(tmp_path, 2)
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "old"}\n')
    assert_user_error(invoke("--dataset", ds, *TINY, "--output", out), str(out), "--resume", "--overwrite")
    assert out.read_text() == '{"id": "old"}\n'
    r = invoke("--dataset", ds, *TINY, "--output", out, "--overwrite", "--gen-len", "2")
    assert r.exit_code == 0, (r.output, r.exception)
    assert sorted(x["id"] for x in read_jsonl(out)) == ["p0", "p1"]


def test_resume_and_overwrite_together(tmp_path):
    ds = prompts_file(tmp_path, 2)
    out = tmp_path / "o.jsonl"
    out.write_text("")
    assert_user_error(invoke("--dataset", ds, *TINY, "--output", out, "--resume", "--overwrite"),
                      "--resume", "--overwrite")


def test_unknown_preset(tmp_path):
    assert_user_error(invoke("--dataset", prompts_file(tmp_path), "--model", "huge-thing", "--output",
                             tmp_path / "o.jsonl", *HW), "huge-thing", "tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.checkpoints import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model(seed=9), tmp_path_factory.mktemp("cli") / "ck", "legacy", 1)


@pytest.fixture
def model_copy(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "model"))


def _run_model(tmp_path, model: Path, *extra: str):
    return invoke("--dataset", prompts_file(tmp_path, 2), "--model", model, "--output", tmp_path / "o.jsonl",
                  "--no-progress", "--gen-len", "2", *HW, *extra)


def test_checkpoint_folder_runs(tmp_path, model_copy):
    r = _run_model(tmp_path, model_copy, "--dtype", "float32")
    assert r.exit_code == 0, (r.output, r.exception)
    assert len(read_jsonl(tmp_path / "o.jsonl")) == 2


def test_unknown_model_type(tmp_path, model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_user_error(_run_model(tmp_path, model_copy), str(model_copy / "config.json"), "'llama'")


def test_config_without_moe_fields(tmp_path, model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["num_local_experts"], cfg["num_experts_per_tok"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert_user_error(_run_model(tmp_path, model_copy), str(model_copy / "config.json"), "MoE",
                      "num_local_experts")


def test_missing_safetensors(tmp_path, model_copy):
    (model_copy / "model.safetensors").unlink()
    out = assert_user_error(_run_model(tmp_path, model_copy), str(model_copy), "no model.safetensors")
    assert "--load-format dummy" in out


def test_truncated_safetensors(tmp_path, model_copy):
    f = model_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    assert_user_error(_run_model(tmp_path, model_copy), str(f), "truncated")


def test_no_tokenizer(tmp_path, model_copy):
    (model_copy / "tokenizer_config.json").unlink()
    assert_user_error(_run_model(tmp_path, model_copy), str(model_copy), "tokenizer.json", "--tokenizer byte")
    r = _run_model(tmp_path, model_copy, "--tokenizer", "byte")
    assert r.exit_code == 0, (r.output, r.exception)


# ----------------------------------------------------------------------------- Ctrl-C and --resume


def interrupt_after(monkeypatch, n: int) -> list[int]:
    """Make Engine.generate raise KeyboardInterrupt right after the n-th finished result is handled."""
    original = moelight.engine.generation.Engine.generate
    seen: list[int] = []

    def generate(self, prompts, params, seeds, batch_size, micro_batch_size, on_finish=None, stats=None):
        def wrapped(res):
            on_finish(res)
            seen.append(res.index)
            if len(seen) >= n:
                raise KeyboardInterrupt

        return original(self, prompts, params, seeds, batch_size, micro_batch_size,
                        on_finish=wrapped, stats=stats)

    monkeypatch.setattr(moelight.engine.generation.Engine, "generate", generate)
    return seen


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_interrupt_keeps_finished_results_and_resume_completes(tmp_path, monkeypatch, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    import workloads

    ds = prompts_file(tmp_path, 9)
    common = ["--dataset", ds, *TINY, "--dtype", "float32", "--gen-len", "3", "--batch-size", "4",
              "--micro-batch-size", "2"]
    clean = tmp_path / f"clean{suffix}"
    assert invoke(*common, "--output", clean).exit_code == 0
    expected = {x["id"]: x["output_token_ids"] for x in workloads.read_results(clean)}
    assert len(expected) == 9

    out = tmp_path / f"out{suffix}"
    with monkeypatch.context() as m:
        seen = interrupt_after(m, 5)
        r = invoke(*common, "--output", out)
    assert r.exit_code == 130, (r.output, r.exception)
    assert says(r.output, "--resume") and "Traceback" not in r.output
    assert len(seen) == 5
    first = workloads.read_results(out)
    assert len(first) == 5 and len({x["id"] for x in first}) == 5  # every finished result, once
    for x in first:
        assert x["output_token_ids"] == expected[x["id"]]
    assert report_of(out)["interrupted"] is True

    assert_user_error(invoke(*common, "--output", out), str(out))  # neither flag: refused
    r = invoke(*common, "--output", out, "--resume")
    assert r.exit_code == 0, (r.output, r.exception)
    final = workloads.read_results(out)
    ids = [x["id"] for x in final]
    assert len(ids) == len(set(ids)) == 9  # no duplicates, nothing lost
    assert {x["id"]: x["output_token_ids"] for x in final} == expected
    assert report_of(out)["requests"] == 4  # only the unfinished ones ran again


def test_resume_of_a_finished_output_does_nothing(tmp_path):
    ds = prompts_file(tmp_path, 3)
    out = tmp_path / "o.jsonl"
    assert invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "2").exit_code == 0
    before = out.read_text()
    r = invoke("--dataset", ds, *TINY, "--output", out, "--gen-len", "2", "--resume")
    assert r.exit_code == 0, (r.output, r.exception)
    assert out.read_text() == before
    assert report_of(out)["requests"] == 0 and report_of(out)["generated_tokens"] == 0
