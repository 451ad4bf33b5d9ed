"""Every option is checked before anything heavy: a bad value exits 2 with the option's name and
its valid choices, before the dataset is read or a weight is loaded (CLI), or raises OptionError
before loading (API)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import moelight.engine.session
from moelight import LLM
from moelight.cli import app
from moelight.engine.options import EngineOptions, OptionError
from moelight.pipeline.schedule import SCHEDULES
from tests.cli_text import says


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(moelight.engine.session, "load_model", refuse)


# (CLI args, phrases the message must hold: the option, the bad value, the valid choices)
CASES = [
    (["--schedule", "bogus"], ["--schedule", "bogus", "cgopipe, flexgen, flexgen-cpu, overlap-unpaged"]),
    (["--device", "tpu"], ["--device", "tpu", "auto, cpu, cuda, emulated"]),
    (["--hardware", "v100"], ["--hardware", "v100", "cpu-server", "profile"]),
    (["--dtype", "float8"], ["--dtype", "float8", "auto, float32, bfloat16, float16"]),
    (["--load-format", "gguf"], ["--load-format", "gguf", "auto, safetensors, dummy"]),
    (["--tokenizer", "sentencepiece"], ["--tokenizer", "sentencepiece", "auto, hf, byte"]),
    (["--format", "csv"], ["--format", "csv", "mtbench, jsonl, openai, parquet"]),
    (["--policy", "/no/such/policy.json"], ["--policy", "policy.json", "no such file"]),
    (["--resume", "--overwrite"], ["--resume", "--overwrite", "choose one"]),
    (["--output-name", "results.csv"], ["--output", "results.csv", ".csv", ".jsonl", ".parquet"]),
    (["--output-name", "results"], ["--output", "extension-less", ".jsonl"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--mode", "fast"], ["--mode", "fast", "auto, throughput, latency"]),
    (["--cache-policy", "arc"], ["--cache-policy", "arc", "auto, on-demand, lru, lfu, moe-infinity"]),
    (["--cache-size", "2.5"], ["--cache-size", "2.5", "a whole number of slots"]),
    (["--eamc", "/no/such/eamc.npz"], ["--eamc", "eamc.npz", "no such file", "moelight eamc"]),
    (["--cache-policy", "moe-infinity"], ["--cache-policy moe-infinity needs --eamc"]),
    (["--prefetch-per-layer", "-1"], ["--prefetch-per-layer", ">= 0"]),
    (["--coe-order", "random"], ["--coe-order", "random", "grouped, fcfs"]),
    # options that would go unused are refused, as --ray-replicas without --ray is
    (["--schedule", "flexgen", "--device", "cpu"], ["--schedule flexgen", "--device cpu", "--device emulated"]),
    (["--coe-order", "fcfs"], ["--coe-order fcfs", "CoE job", "--model tiny is one model"]),
]


@pytest.mark.parametrize("args, phrases", CASES, ids=[c[0][0] + ("=" + c[0][1] if len(c[0]) > 1 else "")
                                                      for c in CASES])
def test_cli_bad_option_exits_2_before_reading_anything(tmp_path, args, phrases):
    name = "out.jsonl"
    if args[0] == "--output-name":
        name, args = args[1], []
    # the dataset does not exist: an option error must come first
    r = CliRunner().invoke(app, ["run", "--dataset", str(tmp_path / "missing.jsonl"), "--model", "tiny",
                                 "--load-format", "dummy", "--output", str(tmp_path / name), *args])
    assert r.exit_code == 2, (r.output, r.exception)
    assert "Traceback" not in r.output and "missing.jsonl" not in r.output
    for phrase in phrases:
        assert says(r.output, phrase), (phrase, r.output)
    assert not (tmp_path / name).exists()


@pytest.mark.parametrize("option, value, phrase", [
    ("schedule", "bogus", "cgopipe"),
    ("device", "tpu", "emulated"),
    ("hardware", "v100", "cpu-server"),
    ("dtype", "float8", "bfloat16"),
    ("load_format", "gguf", "safetensors"),
    ("tokenizer", "spm", "byte"),
    ("policy", "/no/such/policy.json", "no such file"),
    ("batch_size", 0, ">= 1"),
    ("micro_batch_size", -1, ">= 1"),
    ("gpus", -2, ">= 0"),
    ("max_prefill_tokens", 0, ">= 1"),
    ("mode", "fast", "throughput"),
    ("cache_policy", "arc", "moe-infinity"),
    ("cache_size", 0.0, "a share of the experts"),
    ("eamc", "/no/such/eamc.npz", "no such file"),
    ("prefetch_per_layer", -3, ">= 0"),
])
def test_api_bad_option_raises_before_loading(option, value, phrase):
    with pytest.raises(OptionError, match=phrase):
        LLM("tiny", **({"load_format": "dummy"} | {option: value}))


def test_api_unknown_option_lists_the_valid_ones():
    with pytest.raises(OptionError, match="unknown option.*schedul.*valid: .*schedule"):
        LLM("tiny", schedul="cgopipe")


def test_every_cli_run_option_is_an_engine_option_or_a_job_option():
    """The two front ends share EngineOptions: no engine option is reachable from the CLI only."""
    import inspect

    from moelight.cli.run_cmd import run
    from moelight.jobs.run_options import RunOptions

    cli = set(inspect.signature(run).parameters)
    assert set(EngineOptions.names()) <= cli
    assert cli <= set(RunOptions.__dataclass_fields__)
    assert set(SCHEDULES) == {"cgopipe", "flexgen", "flexgen-cpu", "overlap-unpaged"}


def test_an_eamc_or_predictor_file_a_chosen_policy_would_not_read_is_refused(tmp_path):
    """--eamc with policy auto takes MoE-Infinity, its one reader; beside another policy, or a predictor
    beside a policy that reads none, the file would be left unused without a word."""
    from moelight.engine.options import EngineOptions

    eamc, pred = tmp_path / "e.npz", tmp_path / "p.npz"
    eamc.write_bytes(b"x")
    pred.write_bytes(b"x")
    assert EngineOptions(model="tiny", eamc=str(eamc)).cache_policy_name() == "moe-infinity"
    assert EngineOptions(model="tiny").cache_policy_name() == "combined"
    with pytest.raises(OptionError, match="only --cache-policy moe-infinity reads it"):
        EngineOptions(model="tiny", eamc=str(eamc), cache_policy="lru").validate()
    with pytest.raises(OptionError, match="only --cache-policy promoe, duoserve or coserve reads one"):
        EngineOptions(model="tiny", predictor=str(pred)).validate()


def test_one_definition_of_shared_choices():
    """--quantize's split, MAX_LOGPROBS and --load-format's choices each have one definition the layers share."""
    import moelight.cli.held_experts as held_experts
    import moelight.engine.options as options
    import moelight.loading.model_source as model_source
    import moelight.sampling.params as params
    import workloads.readers.sampling_options as reader

    assert options.quantization("int4-g64") == ("int4", 64) and options.quantization("int8") == ("int8", 128)
    assert options.EngineOptions(model="tiny", quantize="int4-g32").quantization() == ("int4", 32)
    assert held_experts.quantization is options.quantization
    assert params.MAX_LOGPROBS is reader.MAX_LOGPROBS
    assert options.LOAD_FORMATS is model_source.LOAD_FORMATS


def test_prompt_column_on_a_jsonl_dataset_is_refused_not_ignored(tmp_path):
    """--prompt-column names a parquet column; a jsonl record's prompt is its `prompt` field."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "question": "hi", "prompt": "hello"}\n')
    r = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", "tiny", "--load-format", "dummy",
                                 "--output", str(tmp_path / "o.jsonl"), "--prompt-column", "question"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert says(r.output, "--prompt-column and the id column name parquet columns; this dataset is jsonl")
    assert not (tmp_path / "o.jsonl").exists()


def test_the_errors_a_caller_catches_import_from_moelight():
    import moelight
    import moelight.errors

    assert moelight.OptionError is moelight.errors.OptionError is OptionError
    assert issubclass(moelight.OptionError, moelight.MoelightError)
    with pytest.raises(moelight.OptionError, match="--schedule 'bogus'"):
        EngineOptions(model="tiny", schedule="bogus").validate()
