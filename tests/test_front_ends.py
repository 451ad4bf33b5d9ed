"""`moelight run` and `LLM.generate` are two front ends over one job path: the same job through
both gives the same tokens and the same report figures, on the CPU executor and on the CGOPipe
runtime (emulated device); the API accepts vLLM's prompt forms."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moelight import LLM, SamplingParams
from moelight.cli import app
from moelight.engine.options import OptionError
from moelight.errors import PromptError
from optimizer import Policy

pytestmark = pytest.mark.no_race_check  # two front ends agree; ordering: the runtimes' own tests

PROMPTS = ["Tell me about cats.", "Why is the sky blue? " * 3, "Hi", "Write a limerick about PCIe lanes."]
# report fields that describe the job (not its timings)
SAME_FIELDS = ("model", "dtype", "requests", "batch_size", "micro_batch_size", "prompt_tokens", "generated_tokens",
               "decode_tokens", "skipped_requests", "attention_backend")


def run_cli(tmp_path, *extra: str) -> tuple[dict[str, list[int]], dict]:
    ds = tmp_path / "prompts.jsonl"
    ds.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(app, ["run", "--dataset", str(ds), "--output", str(out), "--no-progress",
                                 "--overwrite", *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    tokens = {rec["id"]: rec["output_token_ids"] for rec in map(json.loads, out.read_text().splitlines())}
    return tokens, json.loads((tmp_path / "out.jsonl.report.json").read_text())


def assert_same_job(cli_report: dict, api_report: dict) -> None:
    for key in SAME_FIELDS:
        assert cli_report[key] == api_report[key], key
    drop = ("plan_seconds", "host_in_use")  # measured: the time planning took, this process's memory then
    assert {k: v for k, v in cli_report["policy"].items() if k not in drop} == \
        {k: v for k, v in api_report["policy"].items() if k not in drop}
    assert cli_report["prediction"] == api_report["prediction"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cli_and_api_give_the_same_tokens_and_report(tmp_path, temperature):
    cli_tokens, cli_report = run_cli(
        tmp_path, "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--hardware", "cpu-server",
        "--gen-len", "6", "--temperature", str(temperature), "--seed", "3", "--micro-batch-size", "2")
    llm = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server", seed=3, micro_batch_size=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=temperature))
    assert {o.request_id: o.outputs[0].token_ids for o in outs} == cli_tokens
    assert_same_job(cli_report, llm.last_report.to_dict())
    assert llm.last_report.end_to_end_tokens_per_s > 0 and llm.last_stats.generated_tokens == 6 * len(PROMPTS)
    # the API writes no file: its summary has no "written" line, the command's names its output
    assert "written" not in llm.last_report.summary() and cli_report["output"].endswith(".jsonl")


def test_cli_and_api_agree_on_the_emulated_cgopipe_runtime(tmp_path):
    """A GPU policy through both front ends runs the same pipeline executor, with the same tokens."""
    pol = str(Policy(4, 2, 2, False, True, 0.5, 0.0, "float32").save(tmp_path / "gpu.json"))
    opts = {"load_format": "dummy", "dtype": "float32", "hardware": "t4", "policy": pol, "device": "emulated",
            "schedule": "flexgen-cpu", "refill": False}
    cli_tokens, cli_report = run_cli(
        tmp_path, "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--hardware", "t4",
        "--policy", pol, "--device", "emulated", "--schedule", "flexgen-cpu", "--static-batches", "--gen-len", "4",
        "--ignore-eos")
    llm = LLM("tiny", **opts)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert type(llm.session._executor).__name__ == "PipelineExecutor"
    finally:
        llm.close()
    assert {o.request_id: o.outputs[0].token_ids for o in outs} == cli_tokens
    assert cli_report["policy"]["schedule"] == "flexgen-cpu" and cli_report["policy"]["batching"] == "static"
    assert_same_job(cli_report, llm.last_report.to_dict())


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")


def test_vllm_prompt_forms_give_the_same_tokens(tiny):
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    ids = [tiny.tokenizer.encode(p) for p in PROMPTS]
    by_text = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, greedy)]
    forms = [
        ids,
        [{"prompt_token_ids": t} for t in ids],
        [{"prompt": p} for p in PROMPTS],
        [PROMPTS[0], {"prompt_token_ids": ids[1]}, ids[2], {"prompt": PROMPTS[3]}],  # mixed
    ]
    for form in forms:
        assert [o.outputs[0].token_ids for o in tiny.generate(form, greedy)] == by_text
    one = tiny.generate({"prompt_token_ids": ids[1]}, greedy)
    assert len(one) == 1 and one[0].outputs[0].token_ids == by_text[1] and one[0].prompt_token_ids == ids[1]
    assert tiny.generate(ids[2], greedy)[0].outputs[0].token_ids == by_text[2]  # a flat id list is one prompt
    assert tiny.generate({"prompt": PROMPTS[0]}, greedy)[0].prompt == PROMPTS[0]


def test_outputs_in_input_order_with_progress_bar(tiny, capsys):
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    outs = tiny.generate(PROMPTS, greedy, use_tqdm=True)
    assert "generating" in capsys.readouterr().err
    rev = tiny.generate(PROMPTS[::-1], greedy)
    first = int(outs[0].request_id)  # vLLM's ids: a counter over the LLM's calls
    assert [o.prompt for o in outs] == PROMPTS and [o.request_id for o in outs] == [str(first + i) for i in range(4)]
    assert [o.request_id for o in rev] == [str(first + 4 + i) for i in range(4)]
    assert [o.outputs[0].token_ids for o in rev] == [o.outputs[0].token_ids for o in outs][::-1]


def test_a_second_call_draws_new_samples_and_a_new_llm_the_same_ones(tiny):
    """Request ids count on over an LLM's calls (vLLM's), and an unseeded request samples with seed +
    crc32(id): calling generate again gives new samples, a fresh LLM the first call's again."""
    sampled = SamplingParams(max_tokens=8, temperature=1.0)
    fresh = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")
    once, again = ([o.outputs[0].token_ids for o in fresh.generate(PROMPTS, sampled)] for _ in range(2))
    assert once != again
    assert [o.outputs[0].token_ids for o in LLM("tiny", load_format="dummy", dtype="float32",
                                                 hardware="cpu-server").generate(PROMPTS, sampled)] == once


@pytest.mark.parametrize("bad, needle", [
    ({"prompt_tokens": [1, 2]}, "prompt_token_ids"),
    ({"prompt": "x", "multi_modal_data": {}}, "multi-modal"),
    ({"prompt_token_ids": [1, "a"]}, "ints in 0..511"),
    ({"prompt_token_ids": [1, 10**6]}, "ints in 0..511"),
    (3.5, "float is not a prompt"),
    ([], "empty: it has no tokens"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt must be a non-empty string"),
])
def test_bad_prompts_are_clear_errors(tiny, bad, needle):
    with pytest.raises(PromptError, match=needle):
        tiny.generate([PROMPTS[0], bad], SamplingParams(max_tokens=2))


def test_a_cache_salt_is_taken_and_changes_no_token(tiny):
    """vLLM's prefix-cache isolation key: moelight's prefix cache lives for one call, so no other call reads
    a salted prompt's KV (README); the tokens are those of the prompt without it."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    salted = tiny.generate([{"prompt": PROMPTS[0], "cache_salt": "tenant-a"},
                            {"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant-b"}], greedy)
    plain = tiny.generate([PROMPTS[0], [5, 6, 7]], greedy)
    assert [o.outputs[0].token_ids for o in salted] == [o.outputs[0].token_ids for o in plain]


def test_a_vllm_script_ports_over(tiny):
    """What a vLLM script reaches for: get_tokenizer(), the chat prompt's text, the sampled token first in
    each logprobs dict, max_model_len; its no-op arguments taken, its renamed ones named."""
    tok = tiny.get_tokenizer()  # transformers' interface and defaults, as vLLM hands out transformers' own
    assert tok.tokenizer is tiny.tokenizer and tok.eos_token_id == tiny.tokenizer.eos_id
    assert len(tok) == tiny.tokenizer.vocab_size and tok("hi")["input_ids"] == tiny.tokenizer.encode("hi")
    assert tok(["a", "bc"])["attention_mask"] == [[1] * len(tiny.tokenizer.encode(t)) for t in ("a", "bc")]
    convo = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(convo, tokenize=False) == tiny.tokenizer.render_chat(convo, False)
    ids = tiny.tokenizer.encode("hi")
    assert tok.decode(ids) == tiny.tokenizer.decode(ids, skip_special_tokens=False)  # transformers' default
    out = tiny.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.prompt == tiny.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) and "hi" in out.prompt
    sampled = tiny.generate(PROMPTS[:2], SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=3))
    for c in (o.outputs[0] for o in sampled):
        assert all(next(iter(lp)) == t for lp, t in zip(c.logprobs, c.token_ids, strict=True))
    short = LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server", max_model_len=24,
                enforce_eager=True, trust_remote_code=False)
    ids = short.tokenizer.encode(PROMPTS[0])
    with pytest.warns(UserWarning, match="max_tokens"):
        cut = short.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=100, temperature=0.0))
    assert len(ids) + len(cut[0].outputs[0].token_ids) <= 24
    with pytest.raises(OptionError, match="vLLM's tensor_parallel_size is moelight's gpus"):
        LLM("tiny", load_format="dummy", tensor_parallel_size=2)
