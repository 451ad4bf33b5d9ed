"""lm-evaluation-harness on moelight: a local multiple-choice task, a perplexity task (texts shorter and
several times longer than the context) and a generation task with a context longer than the model's give
the same metrics, per-item log-likelihoods and generations through `moelight` as through lm-eval's own
`hf` model on the same checkpoint (at moelight's max_length: the context less the slot a prompt leaves),
and `moelight eval` runs them from the command line."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

from typer.testing import CliRunner  # noqa: E402

from moelight.cli import app  # noqa: E402

pytestmark = pytest.mark.no_race_check  # lm-eval's scores; ordering: the runtimes' own tests

QUESTIONS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two and two make", "choices": [" four", " five"], "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry", " square", " late"], "answer": 1},
    {"question": "Experts route", "choices": [" tokens", " trains"], "answer": 0},
    {"question": "Hello", "choices": [" world", " there", " you"], "answer": 2},
]
TEXTS = [{"text": "Mixture of experts models route each token to a few experts. " * 3},
         {"text": "The quick brown fox jumps over the lazy dog, again and again. " * 5},
         {"text": "Paged experts cross the link while the CPU attends; the GPU waits for none. " * 24}]
LONG = [{"context": "Experts and routers, tokens and layers: " * 40 + "The model said", "id": 0},
        {"context": "A short question:", "id": 1}]


def gen_task(name: str, root, generation: str) -> str:
    """A generate_until task over the long contexts, with `generation` (YAML lines) after its `until`."""
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
output_type: generate_until
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: " x"
generation_kwargs:
  until: ["\\n\\n"]
{generation}
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.checkpoints import make_hf_model, save_checkpoint
    from tests.test_tokenizer import build_tokenizer

    root = tmp_path_factory.mktemp("lm_eval")
    folder = save_checkpoint(make_hf_model(seed=4, vocab_size=640), root / "ckpt", "legacy", 1)
    build_tokenizer(folder, add_bos_token=False)
    tasks = root / "tasks"
    tasks.mkdir()
    (root / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "ppl.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    (root / "gen.jsonl").write_text("".join(json.dumps(t) + "\n" for t in LONG))
    (tasks / "tiny_gen.yaml").write_text(gen_task("tiny_gen", root, "  max_gen_toks: 12\n  do_sample: false"))
    (tasks / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (tasks / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'ppl.jsonl'}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""")
    return folder, tasks, root


def _evaluate(model, tasks):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, tasks=["tiny_mc", "tiny_ppl", "tiny_gen"], task_manager=TaskManager(
        include_path=str(tasks), include_defaults=False), log_samples=True, random_seed=0)


def _doc(sample) -> int:
    return sample["doc_id"]


def _loglikelihoods(results, task):
    return [[float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in sample["filtered_resps"]]
            for sample in sorted(results["samples"][task], key=_doc)]


def test_moelight_scores_as_lm_evals_hf_model(setup, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from moelight.api.lm_eval_model import MoelightLM

    folder, tasks, _ = setup
    ours_lm = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    ours = _evaluate(ours_lm, tasks)
    theirs = _evaluate(HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1,
                            max_length=ours_lm.max_length), tasks)
    longest = max(len(ours_lm.tok_encode(t["text"])) for t in TEXTS)
    assert longest > 3 * ours_lm.max_length  # several rolling windows
    for task in ("tiny_mc", "tiny_ppl"):
        a, b = _loglikelihoods(ours, task), _loglikelihoods(theirs, task)
        assert len(a) == len(b) > 0
        for x, y in zip(a, b, strict=True):
            assert all(math.isclose(u, v, rel_tol=1e-4, abs_tol=1e-3) for u, v in zip(x, y, strict=True)), (x, y)
        for metric, value in theirs["results"][task].items():
            if isinstance(value, float) and "stderr" not in metric:
                assert math.isclose(ours["results"][task][metric], value, rel_tol=1e-4, abs_tol=1e-6), metric
    gens = [[s["filtered_resps"], s["arguments"]] for s in sorted(ours["samples"]["tiny_gen"], key=_doc)]
    assert gens == [[s["filtered_resps"], s["arguments"]] for s in sorted(theirs["samples"]["tiny_gen"], key=_doc)]
    assert all(g[0][0] for g in gens), gens  # each generated something


def test_moelight_eval_command(setup, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder, tasks, root = setup
    out = root / "results.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(folder), "--tasks", "tiny_mc", "--include-path",
                                   str(tasks), "--dtype", "float32", "--hardware", "cpu-server", "--limit", "3",
                                   "--output", str(out)])
    assert res.exit_code == 0, (res.output, res.exception)
    saved = json.loads(out.read_text())
    assert "acc,none" in saved["results"]["tiny_mc"] and len(saved["samples"]["tiny_mc"]) == 3
    # an unknown name is looked up in lm-eval's whole index (~15k task files, ~20 s to index on two cores):
    # here an index of none stands in for it
    import functools

    from lm_eval import tasks as lm_eval_tasks

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", functools.partial(lm_eval_tasks.TaskManager,
                                                                        include_defaults=False))
    bad = CliRunner().invoke(app, ["eval", "--model", str(folder), "--tasks", "no_such_task", "--output",
                                   str(root / "x.json")])
    assert bad.exit_code == 2 and "unknown task" in bad.output


@pytest.mark.parametrize("limit", ["0", "-1", "-0.5"])
def test_moelight_eval_refuses_a_limit_below_one_item_before_the_load(monkeypatch, tmp_path, limit):
    """--limit 0 or a negative one gave a traceback after the model loaded."""
    seen = _capture_llm(monkeypatch)
    res = CliRunner().invoke(app, ["eval", "--model", "tiny", "--tasks", "tiny_mc", "--limit", limit,
                                   "--output", str(tmp_path / "r.json")])
    assert res.exit_code == 2 and "--limit" in res.output and not seen, res.output
    assert "Traceback" not in res.output


def test_registering_moelight_keeps_lm_evals_own_models():
    """lm-eval fills its registry only while it is empty: registered first, `moelight` would hide `hf`."""
    import subprocess
    import sys

    code = ("import moelight.api.lm_eval_model\nfrom lm_eval.api.registry import get_model\n"
            "print(get_model('hf').__name__, get_model('moelight').__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["HFLM", "MoelightLM"], done.stderr[-2000:]


class _Stop(Exception):
    pass


def _capture_llm(monkeypatch) -> dict:
    """LLM replaced by a stub that records its options and stops: no model load."""
    import moelight.api.lm_eval_model as lm_model

    seen: dict = {}

    def fake(model, **options):
        seen.update(options, model=model)
        raise _Stop

    monkeypatch.setattr(lm_model, "LLM", fake)
    return seen


@pytest.mark.parametrize(("given", "engine"), [("cuda:0", "cuda"), ("cuda:1", "cuda"), ("cpu", "cpu"),
                                               ("emulated", "emulated"), ("auto", "auto")])
def test_lm_eval_device_reaches_the_engine(monkeypatch, given, engine):
    from moelight.api.lm_eval_model import MoelightLM

    seen = _capture_llm(monkeypatch)
    with pytest.raises(_Stop):
        MoelightLM("tiny", device=given, dtype="float32")
    assert seen["device"] == engine and seen["dtype"] == "float32"


def test_lm_evals_batch_size_arguments_are_taken_and_ignored(monkeypatch):
    """simple_evaluate passes max_batch_size beside batch_size="auto:N"; LLM refused it as unknown."""
    from moelight.api.lm_eval_model import MoelightLM

    seen = _capture_llm(monkeypatch)
    with pytest.raises(_Stop):
        MoelightLM.create_from_arg_string("pretrained=tiny,dtype=float32",
                                          {"batch_size": "auto:4", "max_batch_size": 8, "device": None})
    assert "batch_size" not in seen and "max_batch_size" not in seen and seen["dtype"] == "float32"


def test_lm_eval_unknown_device_is_refused_before_a_load(monkeypatch):
    from moelight.api.lm_eval_model import MoelightLM
    from moelight.engine.options import OptionError

    seen = _capture_llm(monkeypatch)
    with pytest.raises(OptionError, match="--device 'mps'"):
        MoelightLM("tiny", device="mps")
    assert not seen


def test_moelight_eval_device_option(setup, monkeypatch, tmp_path):
    """`moelight eval --device emulated` reaches the engine; a bad --device is one line, exit 2."""
    import moelight.api.lm_eval_model as lm_model

    folder, tasks, _ = setup
    seen = {}

    def fake(model, **options):
        seen.update(options)
        raise lm_model.OptionError("stub: stop before the load")

    monkeypatch.setattr(lm_model, "LLM", fake)
    args = ["eval", "--model", str(folder), "--tasks", "tiny_mc", "--include-path", str(tasks),
            "--output", str(tmp_path / "r.json")]
    res = CliRunner().invoke(app, [*args, "--device", "emulated"])
    assert res.exit_code == 2 and "stub" in res.output and seen["device"] == "emulated", res.output
    seen.clear()
    bad = CliRunner().invoke(app, [*args, "--device", "tpu"])
    assert bad.exit_code == 2 and "--device 'tpu'" in bad.output and not seen, bad.output
    assert "Traceback" not in bad.output
