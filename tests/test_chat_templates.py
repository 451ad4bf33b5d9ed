"""Chat templates in the style of each family's Hub template (Mixtral, Qwen2-MoE / DBRX ChatML, Qwen3-MoE,
OLMoE / Tulu, GPT-OSS harmony) render through moelight's jinja2 exactly as transformers 5 renders them, text
and token ids: system messages, tools, tool calls and tool results, reasoning, `add_generation_prompt` both
ways, extra template arguments (`enable_thinking`, `reasoning_effort`, `builtin_tools`), documents, the
special tokens, named templates, `continue_final_message`, and `raise_exception`; `LLM.chat` passes the same
arguments through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from moelight.tokenization.tokenizer import TokenizerError, load_tokenizer
from tests.chat_template_cases import (
    CASES,
    CLASSES,
    DOCS,
    FAMILIES,
    FEATURE_TURNS,
    HARMONY_TOOLS,
    MIXED_REASONING,
    PLAIN,
    QWEN_REASONING,
    SEARCH,
    TOOL_TURNS,
    WEATHER,
    WITH_SYSTEM,
    family_tokenizer,
)
from tests.test_tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (template, special, plain, config) in FAMILIES.items():
        config = {"tokenizer_class": CLASSES.get(name, "PreTrainedTokenizerFast"), **config}
        out[name] = family_tokenizer(tmp_path_factory.mktemp(name), template, special, plain, **config)
    return out


LOADERS = ["AutoTokenizer", "PreTrainedTokenizerFast", "tokenizer_file"]
_refs: dict = {}


def reference(folder: Path, loader: str = "AutoTokenizer"):
    """transformers' tokenizer for the folder: from_pretrained, or built from tokenizer.json and the config."""
    key = (str(folder), loader)
    if key not in _refs:
        if loader == "tokenizer_file":
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            cfg.pop("tokenizer_class", None)
            _refs[key] = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **cfg)
        else:
            _refs[key] = getattr(transformers, loader).from_pretrained(str(folder))
    return _refs[key]


def _ids(x) -> list[int]:
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def assert_same(folder: Path, messages, loader: str = "AutoTokenizer", add_generation_prompt: bool = True,
                **kwargs) -> str:
    """moelight's text and ids equal transformers' apply_chat_template(tokenize=False / True)."""
    ref, mine = reference(folder, loader), load_tokenizer(folder)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    assert mine.render_chat(messages, add_generation_prompt, **kwargs) == want
    assert mine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                    **kwargs) == want  # as vLLM scripts build prompt strings
    ids = _ids(ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                       **kwargs))
    assert mine.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs) == ids
    return want


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name, messages, tools, gen, extra", CASES)
def test_template_renders_as_transformers_renders_it(folders, loader, name, messages, tools, gen, extra):
    before = json.dumps(messages, default=repr)
    text = assert_same(folders[name], messages, loader, gen, tools=tools, **extra)
    assert json.dumps(messages, default=repr) == before  # the caller's messages are left as they were
    if tools and name != "chatml":  # the tools really reached the template (ChatML has no place for them)
        assert "get_weather" in text


def test_family_cases_render_what_they_are_meant_to(folders):
    """Guards against comparisons that pass because both sides render nothing interesting."""
    def text(name, messages, gen=True, **kw):
        return load_tokenizer(folders[name]).render_chat(messages, gen, **kw)

    assert text("qwen3", WITH_SYSTEM, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert '"arguments": {"city": "Paris", "days": [1, 2]}' in text("qwen3", TOOL_TURNS, tools=[WEATHER])
    assert "<think>\nAdd them.\n</think>\n\n4" in text("qwen3", QWEN_REASONING, False)
    assert "<|channel|>analysis<|message|>Add again.<|end|>" in text("harmony", MIXED_REASONING)
    assert "<|channel|>analysis<|message|>Add them.<|end|>" in text("harmony", QWEN_REASONING, False)
    harmony = text("harmony", HARMONY_TOOLS, False, tools=[WEATHER], reasoning_effort="high")
    assert "Reasoning: high" in harmony and "namespace functions {" in harmony
    assert 'unit?: "celsius" | "fahrenheit",' in harmony and "days?: number[]," in harmony
    assert harmony.endswith("<|channel|>final<|message|>21 degrees.<|return|>")
    assert text("tulu", WITH_SYSTEM[1:3], False) == "<|user|>\nHi\n<|assistant|>\nHello!<|endoftext|>\n"
    features = text("features", FEATURE_TURNS, False, documents=DOCS)
    assert "content-defined=False" in features and "dropped by break" not in features
    assert '{"a":[1,"é<&>"],"b":2} "\\u00e9"' in features and "<doc 1: Doc A>alpha</doc>" in features
    assert "tokens: <s> </s> <sep> <mask> <image> False" in features


# ----------------------------------------------------------------------------- special tokens


def test_special_tokens_map_json_as_transformers_reads_it(tmp_path):
    """special_tokens_map.json wins over tokenizer_config.json when the config has no added_tokens_decoder,
    and is ignored when it has one (transformers 5); templates and the engine's EOS see the same tokens."""
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ pad_token | default('-') }}|{{ audio_token | default('-') }}"
    for with_decoder in (False, True):
        extra = {"added_tokens_decoder": {"2": {"content": "</s>", "special": True}}} if with_decoder else {}
        d = build_tokenizer(tmp_path / str(with_decoder), chat_template=tpl, tokenizer_class="PreTrainedTokenizerFast",
                            extra_special_tokens={"audio_token": "<unk>"}, **extra)
        (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<unk>"},
                                                               "pad_token": "</s>"}))
        text = assert_same(d, PLAIN)
        assert text == ("<s>|</s>|-|<unk>" if with_decoder else "<s>|<unk>|</s>|<unk>")
        assert load_tokenizer(d).eos_id == reference(d).eos_token_id


# ----------------------------------------------------------------------------- named templates


def test_named_templates_in_tokenizer_config(tmp_path):
    """A list of named templates: `tool_use` when tools are given (even none), else `default`; a name or a
    template string through chat_template=, as transformers' get_chat_template picks."""
    body = "{% for m in messages %}|{{ m.content }}{% endfor %}"
    named = [{"name": "default", "template": "D" + body},
             {"name": "tool_use", "template": "T{{ tools | length }}" + body}]
    d = build_tokenizer(tmp_path / "t", chat_template=named, tokenizer_class="PreTrainedTokenizerFast")
    assert assert_same(d, PLAIN) == "D|Hi there"
    assert assert_same(d, PLAIN, tools=[WEATHER]) == "T1|Hi there"
    assert assert_same(d, PLAIN, tools=[]) == "T0|Hi there"
    assert assert_same(d, PLAIN, chat_template="tool_use", tools=[WEATHER, SEARCH]) == "T2|Hi there"
    assert assert_same(d, PLAIN, chat_template="X{{ messages | length }}") == "X1"
    assert load_tokenizer(d).chat_template == named[0]["template"]


def test_template_files_win_over_the_config(tmp_path):
    """chat_template.jinja (the default) and additional_chat_templates/*.jinja (named) win over the config's."""
    def folder(name, default=True, tool_use=True):
        d = build_tokenizer(tmp_path / name, tokenizer_class="PreTrainedTokenizerFast")  # config: the Mistral one
        if default:
            (d / "chat_template.jinja").write_text("J{% for m in messages %}|{{ m.content }}{% endfor %}")
        if tool_use:
            (d / "additional_chat_templates").mkdir()
            (d / "additional_chat_templates" / "tool_use.jinja").write_text("U{{ tools[0].function.name }}")
        return d

    d = folder("default_only", tool_use=False)
    assert assert_same(d, PLAIN) == assert_same(d, PLAIN, tools=[WEATHER]) == "J|Hi there"
    d = folder("both")
    assert assert_same(d, PLAIN, tools=[WEATHER]) == "Uget_weather"
    assert assert_same(d, PLAIN) == "J|Hi there"
    d = folder("named_only", default=False)  # named templates without a default: a name must be given
    with pytest.raises(ValueError, match="no default"):
        reference(d).apply_chat_template(PLAIN, tokenize=False)
    with pytest.raises(TokenizerError, match="no default.*tool_use"):
        load_tokenizer(d).render_chat(PLAIN)
    assert assert_same(d, PLAIN, chat_template="tool_use", tools=[SEARCH]) == "Usearch"
    assert assert_same(d, PLAIN, tools=[SEARCH]) == "Usearch"


# ----------------------------------------------------------------------------- continue_final_message


@pytest.mark.parametrize("name, messages, field", [
    ("chatml", [*PLAIN, {"role": "assistant", "content": "The answer is "}], True),
    ("qwen3", [*PLAIN, {"role": "assistant", "content": "Sure"}], True),
    ("qwen3", [*PLAIN, {"role": "assistant", "content": "", "reasoning_content": "Let me think"}], "reasoning_content"),
    ("harmony", [*PLAIN, {"role": "assistant", "content": "Bonjour", "thinking": "Greet"}], "thinking"),
])
def test_continue_final_message_matches_transformers(folders, name, messages, field):
    text = assert_same(folders[name], messages, add_generation_prompt=False, continue_final_message=field)
    kept = messages[-1]["content"] if field is True else messages[-1][field]
    assert text.rstrip().endswith(kept.rstrip()) and "CONTINUE_FINAL_MESSAGE_TAG" not in text
    assert "CONTINUE_FINAL_MESSAGE_TAG" not in json.dumps(messages)
    with pytest.raises(TokenizerError, match="add_generation_prompt=False"):
        load_tokenizer(folders[name]).apply_chat_template(messages, continue_final_message=field)


# ----------------------------------------------------------------------------- errors


def test_raise_exception_in_a_template_is_a_clear_error(folders):
    mine = load_tokenizer(folders["harmony"])
    with pytest.raises(TokenizerError, match="Unexpected message role: narrator") as e:
        mine.apply_chat_template([{"role": "narrator", "content": "Once upon a time"}])
    assert str(folders["harmony"]) in str(e.value)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unexpected message role: narrator"):
        reference(folders["harmony"]).apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)
    with pytest.raises(TokenizerError, match="needs an assistant tool call"):
        mine.render_chat([{"role": "tool", "content": "21"}])
    with pytest.raises(TokenizerError, match="Only user, assistant and tool roles"):
        load_tokenizer(folders["mixtral"]).render_chat([*PLAIN, {"role": "system", "content": "late"}])


def test_bad_inputs_are_clear_errors(folders):
    mine = load_tokenizer(folders["qwen3"])
    with pytest.raises(TokenizerError, match="empty conversation"):
        mine.render_chat([])
    with pytest.raises(TokenizerError, match="get_json_schema"):
        mine.render_chat(PLAIN, tools=[len])
    with pytest.raises(TokenizerError, match="list of JSON-schema"):
        mine.render_chat(PLAIN, tools=WEATHER)
    with pytest.raises(TokenizerError, match="documents"):
        mine.render_chat(PLAIN, documents=["just text"])
    with pytest.raises(TokenizerError, match="return_tensors"):
        mine.apply_chat_template(PLAIN, return_tensors="pt")
    with pytest.raises(TokenizerError, match="messages are dicts"):
        mine.render_chat(["hello"])


def test_broken_template_loads_and_fails_when_used(tmp_path):
    """transformers compiles a template when it is first applied; a broken one must not stop plain prompts."""
    d = build_tokenizer(tmp_path / "t", chat_template="{% for m in messages %}{{ m.content }")
    tok = load_tokenizer(d)
    assert tok.encode("Hello world") == reference(d).encode("Hello world")
    with pytest.raises(TokenizerError, match="does not parse") as e:
        tok.render_chat(PLAIN)
    assert str(d) in str(e.value)


def test_sandbox_refuses_namespace_internals(tmp_path):
    d = build_tokenizer(tmp_path / "t", chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(TokenizerError, match="underscore"):
        load_tokenizer(d).render_chat(PLAIN)
    with pytest.raises(jinja2.exceptions.SecurityError):
        reference(d).apply_chat_template(PLAIN, tokenize=False)


def test_byte_tokenizer_refuses_tools_and_templates():
    from moelight.tokenization.byte_tokenizer import ByteTokenizer

    with pytest.raises(TokenizerError, match="no place for tools"):
        ByteTokenizer().apply_chat_template(PLAIN, tools=[WEATHER])
    with pytest.raises(TokenizerError, match="chat_template"):
        ByteTokenizer().apply_chat_template(PLAIN, chat_template="{{ messages }}")
    byte = ByteTokenizer()
    assert byte.apply_chat_template(PLAIN, enable_thinking=False) == byte.apply_chat_template(PLAIN)
    assert byte.apply_chat_template(PLAIN, tokenize=False) == byte.render_chat(PLAIN)


def test_get_tokenizer_builds_prompt_strings_as_vllm_scripts_do(folders, tmp_path):
    """`llm.get_tokenizer().apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)`: the
    template's text, as transformers renders it; encoded, the ids chat() sends."""
    from moelight import LLM
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(vocab_size=512, max_position_embeddings=1024), tmp_path / "m",
                             byte_tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / f, folder / f)
    llm = LLM(str(folder), dtype="float32")
    try:
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template(PLAIN, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str) and text == reference(folders["qwen3"]).apply_chat_template(
            PLAIN, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text, add_special_tokens=False) == tok.apply_chat_template(PLAIN, add_generation_prompt=True)
    finally:
        llm.close()


# ----------------------------------------------------------------------------- LLM.chat


def test_llm_chat_passes_tools_and_template_arguments(folders, tmp_path):
    """`LLM.chat` on a model folder with the Qwen3-style template: the prompt ids are the template's, with
    the same tools and arguments, for one conversation or several, as transformers gives them."""
    from moelight import LLM, SamplingParams
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(vocab_size=512, max_position_embeddings=1024), tmp_path / "m",
                             byte_tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / f, folder / f)
    llm = LLM(str(folder), dtype="float32", hardware="cpu-server")
    ref = reference(folders["qwen3"])
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    out = llm.chat(WITH_SYSTEM, greedy, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})
    want = _ids(ref.apply_chat_template(WITH_SYSTEM, tools=[WEATHER], add_generation_prompt=True,
                                        enable_thinking=False))
    assert len(out) == 1 and out[0].prompt_token_ids == want
    assert want == llm.tokenizer.apply_chat_template(WITH_SYSTEM, tools=[WEATHER], enable_thinking=False)
    assert out[0].prompt_token_ids != llm.chat(WITH_SYSTEM, greedy)[0].prompt_token_ids  # tools made a difference

    # several conversations; vLLM-style chat_template_kwargs may carry the tools themselves
    outs = llm.chat([PLAIN, TOOL_TURNS], greedy, chat_template_kwargs={"tools": [WEATHER, SEARCH]})
    assert [o.prompt_token_ids for o in outs] == [_ids(ref.apply_chat_template(
        c, tools=[WEATHER, SEARCH], add_generation_prompt=True)) for c in (PLAIN, TOOL_TURNS)]

    prefill = [*PLAIN, {"role": "assistant", "content": "Sure"}]
    out = llm.chat(prefill, greedy, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == _ids(ref.apply_chat_template(prefill, continue_final_message=True))
    out = llm.chat(PLAIN, greedy, add_generation_prompt=False, chat_template="{{ messages[0].content }}")[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("Hi there", add_bos=False)


def test_moelight_run_renders_a_requests_tools(folders, tmp_path):
    """An OpenAI batch line with `tools` (and a jsonl line with them): `moelight run` prompts with
    the template's rendering of those tools, as `LLM.chat` does."""
    import shutil

    from typer.testing import CliRunner

    from moelight.cli import app
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(vocab_size=512, max_position_embeddings=1024), tmp_path / "m",
                             byte_tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / f, folder / f)
    batch = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": WITH_SYSTEM, "tools": [WEATHER], "max_tokens": 2}}
    plain = {"id": "b", "messages": WITH_SYSTEM, "tools": [WEATHER], "max_tokens": 2}
    tok = load_tokenizer(folders["qwen3"])
    want = len(tok.apply_chat_template(WITH_SYSTEM, tools=[WEATHER]))
    assert want > len(tok.apply_chat_template(WITH_SYSTEM))
    for name, record in (("batch", batch), ("plain", plain)):
        ds = tmp_path / f"{name}.jsonl"
        ds.write_text(json.dumps(record) + "\n")
        out = tmp_path / f"{name}-out.jsonl"
        r = CliRunner().invoke(app, ["run", "--dataset", str(ds), "--model", str(folder), "--output", str(out),
                                     "--dtype", "float32", "--hardware", "cpu-server", "--no-progress"])
        assert r.exit_code == 0, r.output
        rec = json.loads(out.read_text())
        usage = rec["response"]["body"]["usage"] if name == "batch" else rec
        assert usage["prompt_tokens"] == want, (name, rec)


def test_moelight_run_renders_a_requests_chat_template_arguments(folders, tmp_path):
    """vLLM's chat fields in an OpenAI body or a jsonl record (`chat_template_kwargs`, `add_generation_prompt`,
    `continue_final_message`) render each request's prompt as transformers renders it with them, later
    turns too; they are not dropped (nor, in jsonl, kept in meta)."""
    from typer.testing import CliRunner

    from moelight.cli import app
    from tests.checkpoints import make_hf_model, save_checkpoint
    from workloads import load_dataset

    ref, tok = reference(folders["qwen3"]), load_tokenizer(folders["qwen3"])
    prefill = [*PLAIN, {"role": "assistant", "content": "Sure"}]
    cases = [(PLAIN, {"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
             (prefill, {"continue_final_message": True, "add_generation_prompt": False},
              {"continue_final_message": True, "add_generation_prompt": False})]
    lines = []
    for i, (msgs, fields, _) in enumerate(cases):
        lines += [{"custom_id": f"b{i}", "url": "/v1/chat/completions", "body": {"messages": msgs, **fields}},
                  {"id": f"j{i}", "messages": msgs, **fields}]
    for i, line in enumerate(lines):  # each reader, one request per file
        ds = tmp_path / f"d{i}.jsonl"
        ds.write_text(json.dumps(line) + "\n")
        (r,) = load_dataset(ds).requests
        msgs, _, kwargs = cases[i // 2]
        want = _ids(ref.apply_chat_template(msgs, tokenize=True, **{"add_generation_prompt": True, **kwargs}))
        assert tok.encode_request(r) == want != tok.apply_chat_template(msgs), line
        assert not set(r.meta) & {"chat_template_kwargs", "continue_final_message", "add_generation_prompt"}

    folder = save_checkpoint(make_hf_model(vocab_size=512, max_position_embeddings=1024), tmp_path / "m",
                             byte_tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / f, folder / f)
    ds, out = tmp_path / "turns.jsonl", tmp_path / "turns-out.jsonl"
    ds.write_text(json.dumps({"id": "t", "prompt": "Hi", "followups": ["And?"], "max_tokens": 2,
                              "chat_template_kwargs": {"enable_thinking": False}}) + "\n")
    r = CliRunner().invoke(app, ["run", "--dataset", str(ds), "--model", str(folder), "--output", str(out),
                                 "--dtype", "float32", "--hardware", "cpu-server", "--no-progress"])
    assert r.exit_code == 0, r.output
    t1, t2 = json.loads(out.read_text())["turns"]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": t1["output"]},
            {"role": "user", "content": "And?"}]
    assert t1["prompt_tokens"] == len(tok.apply_chat_template(chat[:1], enable_thinking=False))
    assert t2["prompt_tokens"] == len(_ids(ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                                   enable_thinking=False)))
