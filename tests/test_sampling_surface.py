"""vLLM's sampling surface: each logits transform against a reference written from vLLM's definitions,
stop strings, n samples, structured outputs that always parse, skip_tokenizer_init, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moelight import LLM, SamplingParams
from moelight.sampling.logits_processors import RowState, apply_processors, bad_word_ids
from moelight.sampling.params import StructuredOutputsParams
from moelight.sampling.sampler import _min_p
from moelight.tokenization.byte_tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", load_format="dummy", dtype="float32", hardware="cpu-server")


# ---- transforms against references of vLLM's definitions -------------------------------------------

def _reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for t in set(prompt) | set(output):  # repetition: prompt and output tokens
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


@pytest.mark.parametrize("rep, freq, pres", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.1), (0.8, -0.5, 0.4)])
def test_penalties_match_vllms_definitions(rep, freq, pres):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=g) * 3
    prompt, output = [1, 4, 4, 9], [9, 9, 9, 17, 4, 30]
    p = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    ours = logits.clone()
    apply_processors(ours, [RowState(p, prompt, output)])
    torch.testing.assert_close(ours[0], _reference_penalties(logits[0], prompt, output, rep, freq, pres))


def test_min_p_keeps_the_tokens_within_min_p_of_the_top_probability():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    probs = torch.softmax(x, -1)[0]
    kept = torch.isfinite(_min_p(x, torch.tensor([0.2]))[0])
    assert kept.tolist() == (probs >= 0.2 * probs.max()).tolist() == [True, True, False, False, False]


def test_allowed_ids_bias_min_tokens_and_bad_words():
    logits = torch.zeros(1, 40)
    p = SamplingParams(allowed_token_ids=[3, 5, 7], logit_bias={5: 2.0, 7: -1.0})
    apply_processors(logits, [RowState(p, [], [])])
    assert torch.isinf(logits[0, [0, 1, 2, 4, 6, 8]]).all() and logits[0, 5] == 2.0 and logits[0, 7] == -1.0
    logits = torch.zeros(1, 40)
    p = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[9])
    state = RowState(p, [], [11], stop_ids=frozenset({2, 9}))
    apply_processors(logits, [state])
    assert torch.isinf(logits[0, [2, 9]]).all()  # EOS and stop tokens banned before min_tokens
    state.output_ids.append(12)
    logits = torch.zeros(1, 40)
    apply_processors(logits, [state])
    assert torch.isfinite(logits[0]).all()
    # bad words: the last token of a word is banned once the output ends with the rest of it
    words = bad_word_ids(["ab"], lambda text: [ord(c) - 90 for c in text])  # a=7, b=8, space=-58
    state = RowState(SamplingParams(bad_words=["ab"]), [], [1, 7], bad_word_ids=[w for w in words if min(w) >= 0])
    logits = torch.zeros(1, 40)
    apply_processors(logits, [state])
    assert torch.isinf(logits[0, 8]) and torch.isfinite(logits[0, 7])


def test_allowed_tokens_and_logit_bias_steer_generation(llm):
    out = llm.generate(["abc"], SamplingParams(max_tokens=6, temperature=0.0, allowed_token_ids=[70, 71],
                                               ignore_eos=True))[0].outputs[0]
    assert set(out.token_ids) <= {70, 71}
    out = llm.generate(["abc"], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={99: 100.0},
                                               ignore_eos=True))[0].outputs[0]
    assert out.token_ids == [99] * 4


# ---- stop strings, n samples -----------------------------------------------------------------------

LETTERS = [3 + c for c in range(ord("a"), ord("z") + 1)]  # the byte tokenizer's ids of a..z


def test_stop_strings_cut_the_text_and_say_which(llm):
    base = dict(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True, allowed_token_ids=LETTERS)
    text = llm.generate(["hello there"], SamplingParams(**base))[0].outputs[0].text
    at = next(i for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]  # two letters from the middle of what it would say, said there first
    cut = llm.generate(["hello there"], SamplingParams(**base, stop=[stop, "never-said"]))[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:at], "stop", stop)
    assert len(cut.token_ids) == at + 2 < 16
    kept = llm.generate(["hello there"], SamplingParams(**base, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:at + 2]


def test_the_stop_token_that_ends_a_sequence_is_left_out_of_its_text(llm):
    """vLLM's rule, with or without stop strings beside it: the text leaves out the EOS or stop token
    that ended the sequence unless include_stop_str_in_output; token_ids keep it."""
    stop_at = LETTERS[25]  # "z"
    base = dict(max_tokens=64, temperature=1.0, seed=2, allowed_token_ids=LETTERS, stop_token_ids=[stop_at])
    texts = {}
    for name, extra in {"plain": {}, "with stop strings": {"stop": ["never-said"]},
                        "kept": {"include_stop_str_in_output": True},
                        "kept, with stop strings": {"stop": ["never-said"], "include_stop_str_in_output": True}
                        }.items():
        out = llm.generate(["hello there"], SamplingParams(**base, **extra))[0].outputs[0]
        assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", stop_at, stop_at), name
        texts[name] = out.text
    assert texts["plain"] == texts["with stop strings"] and "z" not in texts["plain"]
    assert texts["kept"] == texts["kept, with stop strings"] == texts["plain"] + "z"


def test_eos_is_left_out_of_the_text_with_special_tokens_shown(tmp_path):
    llm = LLM(str(Path(__file__).parent / "data" / "stdlib-moe"), dtype="float32", hardware="cpu-server")
    eos = llm.tokenizer.eos_id
    forced = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2, allowed_token_ids=[eos, 300],
                            logit_bias={eos: 100.0}, skip_special_tokens=False)
    out = llm.generate(["def f():"], forced)[0].outputs[0]
    assert out.token_ids == [300, 300, eos] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode([300, 300], skip_special_tokens=False)
    kept = llm.generate(["def f():"], SamplingParams(**{**forced.__dict__, "include_stop_str_in_output": True}))
    assert kept[0].outputs[0].text == llm.tokenizer.decode([300, 300, eos], skip_special_tokens=False)


def test_n_samples_are_distinct_reproducible_and_equal_when_greedy(llm):
    p = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7, ignore_eos=True)
    a, b = llm.generate(["x y z"], p)[0], llm.generate(["x y z"], p)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3
    g = llm.generate(["x y z"], SamplingParams(max_tokens=5, temperature=0.0, n=2, ignore_eos=True))[0]
    assert g.outputs[0].token_ids == g.outputs[1].token_ids


# ---- structured outputs ----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"]}


def _valid(obj) -> bool:
    return (isinstance(obj, dict) and set(obj) == {"name", "n", "ok"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6 and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
            and isinstance(obj["ok"], bool))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_constrained_output_parses_and_validates_on_random_weights(llm, temperature):
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate([f"person {i}" for i in range(12)],
                        SamplingParams(max_tokens=80, temperature=temperature, seed=3, structured_outputs=so))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        assert _valid(json.loads(o.outputs[0].text)), o.outputs[0].text
        assert list(json.loads(o.outputs[0].text)) == ["name", "n", "ok"]  # the schema's order, as vLLM's


def test_fields_come_in_the_schemas_order(llm):
    """Reasoning before the answer is the usual reason to order a schema's properties: the same
    properties in another order are another grammar, not one shared through a sorted key."""
    backwards = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    for schema in (SCHEMA, backwards, SCHEMA):
        out = llm.generate(["who"], SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=(
            StructuredOutputsParams(json=schema))))[0].outputs[0]
        assert list(json.loads(out.text)) == list(schema["properties"]), out.text


def test_a_string_of_bounded_length_admits_no_control_character(llm):
    """JSON strings carry control characters escaped only (RFC 8259): inside "name" (maxLength 6) the
    mask leaves no raw byte below 0x20, and leaves the printable ones."""
    c = llm.session.sampling.grammars.constraint(StructuredOutputsParams(json=SCHEMA))
    for t in llm.tokenizer.encode('{"name": "a', add_bos=False):  # the schema's first key
        assert c.accept(t)
    row = torch.zeros(llm.config.vocab_size)
    c.mask(row)
    byte = llm.tokenizer.encode("\x01\t\x1fb", add_bos=False)
    assert [bool(torch.isinf(row[i])) for i in byte] == [True, True, True, False]
    lead = ByteTokenizer.OFFSET + 0xED  # a surrogate's UTF-8: 0xED 0xA0 0x80 (no character)
    assert c.accept(lead) and not c.accept(ByteTokenizer.OFFSET + 0xA0)


def test_choice_regex_and_grammar(llm):
    def one(**kw):
        return llm.generate(["pick"], SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                                     structured_outputs=StructuredOutputsParams(**kw)))[0].outputs[0]
    assert one(choice=["red", "green", "blue"]).text in ("red", "green", "blue")
    import re

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", one(regex=r"[0-9]{3}-[a-z]{2}").text)
    assert one(grammar='root ::= "yes" | "no"').text in ("yes", "no")



def test_json_object_mode_writes_objects(llm):
    """json_object means a JSON object (OpenAI's mode, vLLM's {"type": "object"}), not any JSON value:
    on random weights, lists and numbers were most of the outputs."""
    row = torch.zeros(llm.config.vocab_size)
    llm.session.sampling.grammars.constraint(StructuredOutputsParams(json_object=True)).mask(row)
    first = [i for i in range(llm.config.vocab_size) if not torch.isinf(row[i])]
    assert [llm.tokenizer.decode([i]) for i in first] == ["{"]  # no "[", digit, quote, true/false/null
    outs = llm.generate([f"any json {i}" for i in range(6)], SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(json_object=True)))
    assert all(o.outputs[0].text.startswith("{") for o in outs), [o.outputs[0].text for o in outs]
    c = llm.session.sampling.grammars.constraint(StructuredOutputsParams(json_object=True))
    assert all(c.accept(t) for t in llm.tokenizer.encode('{"a": [1, {"b": null}]}', add_bos=False))
    assert c.accept(llm.tokenizer.eos_id) and c.done  # the object complete, a stop token ends it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_finished_grammar_outranks_min_tokens_and_allowed_ids(llm, temperature):
    """min_tokens bans the EOS a finished choice needs, allowed_token_ids leave the grammar nothing: the
    grammar wins, so the output is still one of the choices (not masked-out tokens reported as "stop")."""
    so = StructuredOutputsParams(choice=["yes", "no"])
    for extra in ({"min_tokens": 5}, {"allowed_token_ids": LETTERS[:3]}):
        outs = llm.generate([f"answer {i}" for i in range(4)], SamplingParams(
            max_tokens=12, temperature=temperature, seed=1, structured_outputs=so, **extra))
        assert {o.outputs[0].text for o in outs} <= {"yes", "no"}, (extra, [o.outputs[0] for o in outs])
        assert {o.outputs[0].finish_reason for o in outs} == {"stop"}


def test_a_bad_schema_or_regex_is_refused_before_generation(llm):
    from moelight.sampling.structured import StructuredOutputError

    with pytest.raises(StructuredOutputError, match="does not compile: Regex parsing error"):
        llm.session.sampling.check(SamplingParams(structured_outputs=StructuredOutputsParams(regex="([a-z")))
    with pytest.raises(ValueError, match="request 0: the structured-output constraint does not compile"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="([a-z")))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    nothing = StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]")  # an empty character class: no text matches
    with pytest.raises(ValueError, match="request 0: the structured-output constraint matches no text"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=nothing))


# ---- skip_tokenizer_init ----------------------------------------------------------------------------

def test_skip_tokenizer_init_runs_a_folder_without_a_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(seed=2), tmp_path / "ck", "legacy", 1)
    assert not (folder / "tokenizer.json").exists()
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", hardware="cpu-server")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0.0,
                                                                           ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate(["text"])


def test_max_tokens_none_takes_what_the_context_leaves_and_detokenize_false_leaves_no_text(llm):
    prompt = "x" * (llm.config.max_position_embeddings - 8)
    room = llm.config.max_position_embeddings - len(llm.tokenizer.encode(prompt))
    out = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, min_tokens=99))
    assert (len(out[0].outputs[0].token_ids), out[0].outputs[0].finish_reason) == (room, "length")
    assert not llm.last_report.warnings  # asked for, so nothing was cut
    ids_only = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))[0].outputs[0]
    assert ids_only.text == "" and ids_only.token_ids == llm.generate(["hello"], SamplingParams(
        max_tokens=4, temperature=0.0))[0].outputs[0].token_ids


# ---- bad input ----------------------------------------------------------------------------------------

def test_vllms_spaces_between_special_tokens_is_taken():
    """vLLM scripts set it; a tokenizer.json decodes as it is either way (vLLM v1's fast detokenizer too)."""
    assert SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens is False


def test_values_vllms_sampling_params_takes_for_others():
    """vLLM's defaults and spellings a vLLM script passes: stop_token_ids None is none, logprobs True is 1
    (a bool is an int there) and False none (no logprobs: what the script means), a tuple of stops a list."""
    sp = SamplingParams(stop_token_ids=None, logprobs=True, prompt_logprobs=True, stop=("a", "b"))
    assert (sp.stop_token_ids, sp.logprobs, sp.prompt_logprobs, sp.stop) == ([], 1, 1, ["a", "b"])
    off = SamplingParams(logprobs=False, prompt_logprobs=False)
    assert (off.logprobs, off.prompt_logprobs) == (None, None)
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("kw, error, needle", [
    (dict(n=0), ValueError, "n must be at least 1"),
    (dict(stop=("a", 5)), TypeError, "stop must be a string or a list"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a list of ints"),
    (dict(logprobs="1"), TypeError, "logprobs must be an int, got str"),
    (dict(prompt_logprobs=1.0), TypeError, "prompt_logprobs must be an int, got float"),
    (dict(logprobs=21), ValueError, "logprobs must be in [0, 20]"),
    (dict(stop=5), TypeError, "stop must be a string or a list"),
    (dict(min_p=2.0), ValueError, "min_p must be in [0, 1]"),
    (dict(presence_penalty=3.0), ValueError, "presence_penalty must be in [-2, 2]"),
    (dict(structured_outputs=StructuredOutputsParams(choice=["a"]), logit_bias="x"), TypeError, "logit_bias"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(stop=["x"], detokenize=False), ValueError, "stop strings need detokenize=True"),
    (dict(spaces_between_special_tokens="no"), TypeError, "spaces_between_special_tokens"),
])
def test_sampling_params_refuse_bad_values(kw, error, needle):
    with pytest.raises(error, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw)


def test_dataset_records_with_bad_sampling_are_named_before_loading(tmp_path):
    from typer.testing import CliRunner

    from moelight.cli import app
    from tests.cli_text import says

    data = tmp_path / "d.jsonl"
    rows = [{"id": "ok", "prompt": "fine", "n": 2},
            {"id": "n0", "prompt": "x", "n": 0},
            {"id": "lp", "prompt": "x", "logprobs": 50},
            {"id": "st", "prompt": "x", "stop": 5},
            {"id": "rf", "prompt": "x", "response_format": {"type": "xml"}},
            {"id": "schema", "prompt": "x", "structured_outputs": {"regex": "([a-"}}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", "--dataset", str(data), "--output", str(tmp_path / "o.jsonl"), "--model", "tiny",
            "--load-format", "dummy", "--gen-len", "3", "--hardware", "cpu-server", "--no-progress"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output
    for needle in (f"{data}:2", "'n' must be in [1", f"{data}:3", "'logprobs' must be in [0, 20]", f"{data}:4",
                   "'stop' must be a string", f"{data}:5", "response_format.type"):
        assert says(res.output, needle), (needle, res.output)
    # the line errors skipped, the schema that does not compile is a prompt problem named by its line
    res = CliRunner().invoke(app, [*args, "--skip-bad-lines"])
    assert res.exit_code == 0, res.output
    written = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["id"] for r in written] == ["ok"] and len(written[0]["outputs"]) == 2
    bad_schema = tmp_path / "s.jsonl"
    bad_schema.write_text(json.dumps(rows[-1]) + "\n")
    res = CliRunner().invoke(app, ["run", "--dataset", str(bad_schema), *args[3:], "--overwrite"])
    assert res.exit_code == 2 and says(res.output, f"{bad_schema}:1") and says(res.output, "does not compile")


def test_a_record_can_ask_for_token_ids_only(tmp_path):
    from moelight.jobs.dataset_job import run_job
    from moelight.jobs.run_options import RunOptions

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 3, "detokenize": False}) + "\n"
                    + json.dumps({"id": "b", "prompt": "x", "max_tokens": 3}) + "\n")
    run_job(RunOptions(dataset=data, output=tmp_path / "o.jsonl", model="tiny", load_format="dummy",
                       hardware="cpu-server", temperature=0.0, ignore_eos=True, progress=False))
    a, b = (json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines())
    assert a["output"] == "" and b["output"] and a["output_token_ids"] == b["output_token_ids"]


def test_the_progress_bar_counts_requests_whatever_their_samples(tmp_path):
    from typer.testing import CliRunner

    from moelight.cli import app

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "x", "n": 3}) + "\n" for i in range(2)))
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(tmp_path / "o.jsonl"), "--model",
                                   "tiny", "--load-format", "dummy", "--hardware", "cpu-server", "--gen-len", "2"])
    assert res.exit_code == 0, res.output
    assert "2/2" in res.output and "6/2" not in res.output and "3/2" not in res.output, res.output


def test_a_records_ignore_eos_and_stop_ids_and_greedy_samples_are_honoured_and_warned(tmp_path):
    """A record's `ignore_eos` beats the job's, its `stop_token_ids` still stop it; n > 1 at the job's
    greedy default gives equal samples, which the report warns of."""
    from moelight.jobs.dataset_job import run_job
    from moelight.jobs.run_options import RunOptions

    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    opts = dict(dataset=data, output=out, model="tiny", load_format="dummy", hardware="cpu-server", progress=False)
    data.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 6, "ignore_eos": True}) + "\n")
    run_job(RunOptions(**opts, ignore_eos=False))
    (first,) = (json.loads(line) for line in out.read_text().splitlines())
    tokens = first["output_token_ids"]
    assert len(tokens) == 6
    data.write_text(json.dumps({"id": "a", "prompt": "x", "max_tokens": 6, "ignore_eos": True,
                                "stop_token_ids": [tokens[2]]}) + "\n"
                    + json.dumps({"id": "b", "prompt": "x", "max_tokens": 2, "n": 3}) + "\n")
    run_job(RunOptions(**opts, ignore_eos=True, overwrite=True))
    a, b = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["id"])
    stop_at = tokens.index(tokens[2])
    assert a["output_token_ids"] == tokens[:stop_at + 1] and a["finish_reason"] == "stop", a
    report = json.loads(out.with_name(out.name + ".report.json").read_text())
    assert report["warnings"]["counts"] == {"greedy_samples": 1}, report["warnings"]
    assert len({tuple(o["output_token_ids"]) for o in b["outputs"]}) == 1


def test_seed_minus_one_is_no_seed_as_in_vllm(llm):
    """vLLM reads seed=-1 as None: each request draws on its own (-1 kept as a seed gave every one the same
    sample); another negative seed is a seed (torch's, mod 2^64), one beyond 64 bits is refused."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-5).seed == -5
    sp = SamplingParams(seed=-1, temperature=1.0, max_tokens=8, ignore_eos=True)
    texts = [o.outputs[0].token_ids for o in llm.generate(["x", "x", "x"], sp)]
    assert len({tuple(t) for t in texts}) > 1, texts
    # n samples of seed -2 draw with -2 and -2 + 1, which stays a seed (2^64 - 1), not vLLM's "none"
    two = llm.generate(["x"], SamplingParams(seed=-2, n=2, temperature=1.0, max_tokens=8, ignore_eos=True))[0]
    last = llm.generate(["x"], SamplingParams(seed=2**64 - 1, temperature=1.0, max_tokens=8, ignore_eos=True))[0]
    assert two.outputs[1].token_ids == last.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"seed must be in \[-2\^63, 2\^64\)"):
        SamplingParams(seed=2**64)


def test_a_records_seed_minus_one_is_no_seed(tmp_path):
    """moelight run: records with "seed": -1 draw as records without a seed (base + crc32 of their id)."""
    from moelight.jobs.dataset_job import run_job
    from moelight.jobs.run_options import RunOptions
    from workloads import DatasetError, read_dataset

    data = tmp_path / "d.jsonl"
    rows = [{"id": i, "prompt": "x", "seed": s, "max_tokens": 8} for i, s in ((1, -1), (2, -1), (3, None))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    body = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "seed": -1}}
    (tmp_path / "b.jsonl").write_text(json.dumps(body) + "\n")
    assert read_dataset(tmp_path / "b.jsonl")[0].seed is None
    out = tmp_path / "o.jsonl"
    run_job(RunOptions(dataset=data, output=out, model="tiny", load_format="dummy", hardware="cpu-server",
                       temperature=1.0, ignore_eos=True, progress=False))
    tokens = [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]
    assert tokens[0] != tokens[1], tokens
    (tmp_path / "big.jsonl").write_text(json.dumps({"prompt": "x", "seed": 2**64}) + "\n")
    with pytest.raises(DatasetError, match="'seed' must be a 64-bit seed"):
        read_dataset(tmp_path / "big.jsonl")
