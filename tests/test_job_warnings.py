"""What a job changed to make a request run is counted in its report (a max_tokens cut, chat without a
template, a later turn that does not fit), for the requests that ran only; a conversation the context
cut says so in its record."""

from __future__ import annotations

import json

from tests.cli_text import says
from tests.test_job_files import TINY, run


def test_max_tokens_cut_by_the_context_and_chat_without_a_template_are_counted(tmp_path):
    from moelight.loading.presets import preset_config

    ctx = preset_config("tiny").max_position_embeddings
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "long", "prompt": "x" * (ctx - 4), "max_tokens": 50, "min_tokens": 50}) + "\n"
                    + json.dumps({"id": "chat", "messages": [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hi"}]}) + "\n")
    res = run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["warnings"]["counts"] == {"max_tokens_cut": 1, "chat_without_template": 1}
    assert "(min_tokens 50 too)" in report["warnings"]["examples"]["max_tokens_cut"][0]  # cut with max_tokens
    long = next(json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines() if '"long"' in line)
    assert long["completion_tokens"] == ctx - long["prompt_tokens"]  # min_tokens held it to the end
    assert says(res.output, "max_tokens cut so prompt + answer fit") and says(res.output, "without a chat template")
    # a request skipped for its length warns of nothing it would have needed
    data.write_text(json.dumps({"id": "chat", "messages": [{"role": "user", "content": "x" * ctx}]}) + "\n"
                    + json.dumps({"id": "ok", "prompt": "hi"}) + "\n")
    res = run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY, "--skip-bad-lines", "--overwrite")
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert res.exit_code == 0 and len(report["skipped"]) == 1 and "d.jsonl:1" in report["skipped"][0], res.output
    assert not report["warnings"].get("counts"), report["warnings"]


def test_a_conversation_cut_by_the_context_says_so_in_its_record(tmp_path):
    """A second turn that no longer fits ends the conversation: the record's `turns` holds the turn
    that ran and `turns_cut` the one that did not (its top-level output alone looked single-turn)."""
    from moelight.loading.presets import preset_config

    ctx = preset_config("tiny").max_position_embeddings
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "cut", "prompt": "hi", "followups": ["x" * ctx]}) + "\n"
                    + json.dumps({"id": "whole", "prompt": "hi", "followups": ["and?"]}) + "\n")
    res = run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY)
    assert res.exit_code == 0, res.output
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    assert len(records["cut"]["turns"]) == 1 and records["cut"]["turns_cut"] == 1
    assert len(records["whole"]["turns"]) == 2 and "turns_cut" not in records["whole"]
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["warnings"]["counts"].get("turn_does_not_fit") == 1, report["warnings"]
