"""Chat templates in the style of each family's Hub template render through moelight's jinja2
exactly as transformers renders them: system messages, tools, tool calls and tool results,
`add_generation_prompt` both ways, extra template arguments (`enable_thinking`,
`reasoning_effort`) and `raise_exception`."""

from __future__ import annotations

import json

import pytest

from moelight.tokenizer import TokenizerError, load_tokenizer
from tests.test_tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

CHATML = (  # Qwen2-MoE / DBRX-instruct: ChatML with a default system message
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3 = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- if message.tool_calls %}{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
TULU = (  # OLMoE-instruct
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
HARMONY = """{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" %}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" }}
{{- "Knowledge cutoff: 2024-06\\n\\nReasoning: " + effort + "\\n\\n" }}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>" }}
{%- set dev = messages | selectattr("role", "equalto", "developer") | list %}
{%- if dev or tools %}
{{- "<|start|>developer<|message|>" }}
{%- if dev %}{{- "# Instructions\\n\\n" + dev[0].content + "\\n\\n" }}{%- endif %}
{%- if tools %}
{{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" }}
{%- for tool in tools %}
{{- "// " + tool.function.description + "\\ntype " + tool.function.name + " = (_: {\\n" }}
{%- for name, param in tool.function.parameters.properties.items() %}
{{- "// " + (param.description or "") + "\\n" + name + ": " + param.type + ",\\n" }}
{%- endfor %}
{{- "}) => any;\\n\\n" }}
{%- endfor %}
{{- "} // namespace functions" }}
{%- endif %}
{{- "<|end|>" }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" %}{{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == "assistant" %}
{%- if message.thinking %}{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
{%- endif %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- elif message.role in ("system", "developer") %}
{%- else %}{{- raise_exception("Unexpected message role: " + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start|>assistant" }}{%- endif %}"""

TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "tulu": TULU, "harmony": HARMONY}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"}, "unit": {"type": "string"}},
        "required": ["city"]}}}
PLAIN = [{"role": "user", "content": "Hi there"}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Café? 2+2"}]
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": json.dumps({"temp": 21})}]
HARMONY_TURNS = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Bonjour !", "thinking": "The user greets me."},
                 {"role": "user", "content": "2+2?"}]

CASES = [  # (template, messages, tools, add_generation_prompt, extra template arguments)
    ("chatml", PLAIN, None, True, {}),
    ("chatml", WITH_SYSTEM, None, False, {}),
    ("qwen3", WITH_SYSTEM, None, True, {}),
    ("qwen3", WITH_SYSTEM, [WEATHER], True, {"enable_thinking": False}),
    ("qwen3", TOOL_TURNS, [WEATHER], True, {}),
    ("qwen3", PLAIN, None, False, {"enable_thinking": True}),
    ("tulu", WITH_SYSTEM, None, True, {}),
    ("tulu", PLAIN, None, False, {}),
    ("harmony", PLAIN, None, True, {}),
    ("harmony", HARMONY_TURNS, [WEATHER], True, {"reasoning_effort": "high"}),
    ("harmony", HARMONY_TURNS, None, False, {"reasoning_effort": "low"}),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: build_tokenizer(tmp_path_factory.mktemp(name), chat_template=tpl)
            for name, tpl in TEMPLATES.items()}


@pytest.mark.parametrize("name, messages, tools, gen, extra", CASES)
def test_template_renders_as_transformers_renders_it(folders, name, messages, tools, gen, extra):
    ref = transformers.AutoTokenizer.from_pretrained(str(folders[name]))
    mine = load_tokenizer(folders[name])
    want = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **extra)
    assert mine.render_chat(messages, gen, tools=tools, **extra) == want
    ids = ref.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen, **extra)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    assert mine.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **extra) == ids
    if tools:  # the tools really reached the template
        assert "get_weather" in want


def test_raise_exception_in_a_template_is_a_clear_error(folders):
    mine = load_tokenizer(folders["harmony"])
    with pytest.raises(TokenizerError, match="Unexpected message role: narrator") as e:
        mine.apply_chat_template([{"role": "narrator", "content": "Once upon a time"}])
    assert str(folders["harmony"]) in str(e.value)
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="narrator"):  # transformers raises the same
        transformers.AutoTokenizer.from_pretrained(str(folders["harmony"])).apply_chat_template(
            [{"role": "narrator", "content": "x"}], tokenize=False)


def test_llm_chat_passes_tools_and_template_arguments(folders, tmp_path):
    """`LLM.chat` on a model folder with the Qwen3-style template: the prompt ids are the template's."""
    import shutil

    from moelight import LLM, SamplingParams
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(vocab_size=512, max_position_embeddings=1024), tmp_path / "m",
                             byte_tokenizer=False)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / f, folder / f)
    llm = LLM(str(folder), dtype="float32", hardware="cpu-server")
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    out = llm.chat(WITH_SYSTEM, greedy, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False})[0]
    want = llm.tokenizer.apply_chat_template(WITH_SYSTEM, tools=[WEATHER], enable_thinking=False)
    assert out.prompt_token_ids == want
    assert out.prompt_token_ids != llm.chat(WITH_SYSTEM, greedy)[0].prompt_token_ids  # tools made a difference


def test_byte_tokenizer_refuses_tools():
    from moelight.tokenizer import ByteTokenizer

    with pytest.raises(TokenizerError, match="no place for tools"):
        ByteTokenizer().apply_chat_template(PLAIN, tools=[WEATHER])


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
