"""lm-eval's options reach moelight as they reach its `hf` model: a task's sampling settings (they were
dropped), add_bos_token=True on a tokenizer that adds no BOS itself (it was ignored), a text that
starts with BOS (no second one), and chat templates (apply_chat_template crashed)."""

from __future__ import annotations

import pytest

lm_eval = pytest.importorskip("lm_eval")

from tests.test_lm_eval import _doc, gen_task, setup  # noqa: E402, F401 - the module's checkpoint and tasks


def test_a_tasks_sampling_settings_become_the_requests_and_unknown_ones_are_refused():
    from moelight.api.lm_eval_model import generation_sampling
    from moelight.engine.options import OptionError

    assert generation_sampling({"do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.9}) == \
        {"temperature": 0.7, "top_k": 1, "top_p": 0.9}
    assert generation_sampling({"do_sample": True}) == {"temperature": 1.0}
    assert generation_sampling({"do_sample": False, "temperature": 0.7, "top_k": 5}) == {"temperature": 0.0}
    assert generation_sampling({"top_k": 5}) == {"temperature": 0.0}
    with pytest.raises(OptionError, match="num_beams"):  # the CLI's one line and exit 2, no traceback
        generation_sampling({"num_beams": 4})


@pytest.mark.parametrize("kwargs", [{"temperature": 0.7}, {"temperature": 0.0}, {},
                                    {"do_sample": None, "temperature": 1}, {"do_sample": False, "temperature": 0.7},
                                    {"do_sample": True}])
def test_do_sample_unset_samples_at_a_positive_temperature_as_lm_evals_rule(kwargs):
    """lm-eval's normalize_gen_kwargs (its hf and vllm models follow it) samples when do_sample is unset
    and temperature > 0; moelight decoded those greedily."""
    from moelight.api.lm_eval_model import generation_sampling

    normalize = pytest.importorskip("lm_eval.models.utils").normalize_gen_kwargs
    sampling = generation_sampling(dict(kwargs))
    assert (sampling["temperature"] > 0) == normalize(kwargs)["do_sample"]
    if sampling["temperature"] > 0 and "temperature" in kwargs:
        assert sampling["temperature"] == kwargs["temperature"]


def _generate(lm, tasks, yaml: str, **kw):
    from lm_eval.tasks import TaskManager

    (tasks / "tiny_gen_opts.yaml").write_text(yaml)
    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_gen_opts"], task_manager=TaskManager(
        include_path=str(tasks), include_defaults=False), log_samples=True, random_seed=0, **kw)
    return [[s["filtered_resps"], s["arguments"]] for s in sorted(results["samples"]["tiny_gen_opts"], key=_doc)]


def _task(root, sampling: str) -> str:
    return gen_task("tiny_gen_opts", root, "  max_gen_toks: 8\n" + sampling)


def test_top_k_one_samples_the_greedy_tokens(setup, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from moelight.api.lm_eval_model import MoelightLM

    folder, tasks, root = setup
    lm = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    greedy = _generate(lm, tasks, _task(root, "  do_sample: false"))
    top1 = _generate(lm, tasks, _task(root, "  do_sample: true\n  temperature: 1.0\n  top_k: 1"))
    assert [g[0] for g in top1] == [g[0] for g in greedy]


def test_lm_evals_aliases_of_max_gen_toks_set_the_budget(setup, monkeypatch):  # noqa: F811
    """max_new_tokens, max_tokens and max_completion_tokens are lm-eval's names for max_gen_toks (they
    were refused after the load); max_gen_toks wins where several are given, as in lm-eval."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from moelight.api.lm_eval_model import MoelightLM, generation_budget

    assert generation_budget({"max_tokens": 5, "max_completion_tokens": 7}, 256) == 5
    assert generation_budget({"max_new_tokens": 4, "max_gen_toks": 3}, 256) == 3
    assert generation_budget({}, 256) == 256
    folder, tasks, root = setup
    lm = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    budget = _generate(lm, tasks, gen_task("tiny_gen_opts", root, "  max_gen_toks: 3\n  do_sample: false"))
    for alias in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
        got = _generate(lm, tasks, gen_task("tiny_gen_opts", root, f"  {alias}: 3\n  do_sample: false"))
        assert [g[0] for g in got] == [g[0] for g in budget], alias


def test_a_budget_that_leaves_no_room_for_the_context_is_refused(setup, monkeypatch):  # noqa: F811
    """max_gen_toks >= max_length cut the prompt to one token and generated on; hf asserts."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from moelight.api.lm_eval_model import MoelightLM
    from moelight.engine.options import OptionError

    folder, tasks, root = setup
    lm = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    yaml = gen_task("tiny_gen_opts", root, f"  max_gen_toks: {lm.max_length}\n  do_sample: false")
    with pytest.raises(OptionError, match=f"task tiny_gen_opts: .*{lm.max_length} tokens .*max_gen_toks"):
        _generate(lm, tasks, yaml)


def test_an_empty_or_overlong_continuation_is_refused(setup):  # noqa: F811
    """hf asserts 0 < len(continuation) <= max_length; moelight scored the context's last token for an
    empty one and cut a long one silently."""
    from moelight.api.lm_eval_model import MoelightLM
    from moelight.errors import PromptError

    folder, _, _ = setup
    lm = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    with pytest.raises(PromptError, match="no tokens"):
        lm._loglikelihood_tokens([(("ctx", ""), [1, 40, 41], [])])
    with pytest.raises(PromptError, match=f"more than the model's max_length of {lm.max_length}"):
        lm._loglikelihood_tokens([(("ctx", "long"), [1], [40] * (lm.max_length + 1))])
    assert len(lm._loglikelihood_tokens([(None, [1], [40] * lm.max_length)])) == 1  # hf's limit, still scored


def test_chat_templates_render_as_the_hf_models(setup, monkeypatch):  # noqa: F811
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from moelight.api.lm_eval_model import MoelightLM

    folder, tasks, root = setup
    ours = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    theirs = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1, max_length=ours.max_length)
    yaml = _task(root, "  do_sample: false")
    assert _generate(ours, tasks, yaml, apply_chat_template=True) == \
        _generate(theirs, tasks, yaml, apply_chat_template=True)


def test_a_gen_prefix_continues_the_assistants_message_as_the_hf_models(setup, monkeypatch):  # noqa: F811
    """lm-eval renders a task's gen_prefix as an assistant message to continue; moelight closed it."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from moelight.api.lm_eval_model import MoelightLM

    folder, tasks, root = setup
    ours = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    theirs = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1, max_length=ours.max_length)
    yaml = _task(root, "  do_sample: false") + 'gen_prefix: "Sure:"\n'
    got = _generate(ours, tasks, yaml, apply_chat_template=True)
    assert got[0][1][0][0].endswith("[/INST]Sure:"), got[0][1][0][0]
    assert got == _generate(theirs, tasks, yaml, apply_chat_template=True)


def test_a_template_that_refuses_a_system_message_renders_without_it_as_the_hf_models(setup, monkeypatch):  # noqa: F811
    """A system_instruction with a template that has no system role: hf drops it with a warning; moelight
    raised TokenizerError."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from moelight.api.lm_eval_model import MoelightLM
    from moelight.errors import TokenizerError

    folder, tasks, root = setup
    ours = MoelightLM(str(folder), dtype="float32", hardware="cpu-server")
    with pytest.raises(TokenizerError, match="rejected"):  # the checkpoint's Mistral template: no system role
        ours.tokenizer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    theirs = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1, max_length=ours.max_length)
    yaml = _task(root, "  do_sample: false")
    got = _generate(ours, tasks, yaml, apply_chat_template=True, system_instruction="Be brief.")
    assert got == _generate(theirs, tasks, yaml, apply_chat_template=True, system_instruction="Be brief.")


def test_add_bos_token_true_adds_bos_where_the_tokenizer_adds_none(tmp_path):
    from lm_eval.models.huggingface import HFLM

    from moelight.api.lm_eval_model import MoelightLM
    from tests.checkpoints import make_hf_model, save_checkpoint
    from tests.test_tokenizer import build_tokenizer

    folder = save_checkpoint(make_hf_model(seed=4, vocab_size=640), tmp_path / "ckpt", "legacy", 1)
    build_tokenizer(folder, post_processor=False, add_bos_token=None)
    ours = MoelightLM(str(folder), dtype="float32", hardware="cpu-server", add_bos_token=True)
    theirs = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1, add_bos_token=True)
    for text in ("Hello world", "<s>Hello", " lead"):
        assert ours.tok_encode(text) == theirs.tok_encode(text), text
    assert ours.tok_encode("Hello world")[0] == ours.tokenizer.bos_id


def test_the_eval_command_takes_the_chat_template_and_bos_choices(setup, monkeypatch):  # noqa: F811
    import json

    from typer.testing import CliRunner

    import moelight.api.lm_eval_model as lm_model
    from moelight.cli import app

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder, tasks, root = setup
    seen = {}
    real = lm_model.MoelightLM.__init__

    def spy(self, *a, **kw):
        seen.update(kw)
        real(self, *a, **kw)

    monkeypatch.setattr(lm_model.MoelightLM, "__init__", spy)
    out = root / "chat.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(folder), "--tasks", "tiny_gen", "--include-path", str(tasks),
                                   "--dtype", "float32", "--hardware", "cpu-server", "--limit", "1", "--output",
                                   str(out), "--apply-chat-template", "--no-add-bos-token", "--overwrite"])
    assert res.exit_code == 0, (res.output, res.exception)
    assert seen["add_bos_token"] is False
    sample = json.loads(out.read_text())["samples"]["tiny_gen"][0]
    assert sample["arguments"][0][0].startswith("<s>[INST] ")  # the checkpoint's Mistral template
