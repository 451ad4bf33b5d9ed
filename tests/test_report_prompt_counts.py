"""A report counts each request's prompt once whatever its n (vLLM's count, and the sum of its records'
`prompt_tokens`), and its prefill tok/s is the prompt positions prefill computed per second: n samples
and shared prefixes once made prompt_tokens n times the prompts and the prefill rate count reused KV."""

from __future__ import annotations

import json

import pytest

from moelight import LLM, SamplingParams
from tests.test_job_files import TINY, run

PROMPTS = ["the same system prompt, then a question " * 3 + str(i) for i in range(3)]


def _consistent(report: dict) -> None:
    assert report["prefix_reused_tokens"] > 0  # the samples share their prompt's pages
    assert report["prefill_tokens_per_s"] == pytest.approx(report["prefill_computed_tokens"]
                                                           / report["prefill_seconds"])


def test_llm_reports_each_prompt_once_and_the_computed_prefill_rate():
    llm = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")
    outs = llm.generate(PROMPTS, SamplingParams(n=4, max_tokens=3, temperature=1.0, ignore_eos=True))
    report = llm.last_report.to_dict()
    assert report["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert report["generated_tokens"] == 3 * 4 * len(PROMPTS)
    assert llm.last_stats.prompt_tokens == 4 * report["prompt_tokens"]  # the engine's: every sequence's
    _consistent(report)
    assert "positions computed" in llm.last_report.summary()


def test_a_dataset_job_reports_the_prompts_its_records_hold(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "n": 3, "temperature": 1.0}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    res = run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert report["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    _consistent(report)
