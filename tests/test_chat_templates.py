"""Chat templates in the style of each family's Hub template (Mixtral, Qwen2-MoE / DBRX ChatML, Qwen3-MoE,
OLMoE / Tulu, GPT-OSS harmony) render through moelight's jinja2 exactly as transformers 5 renders them, text
and token ids: system messages, tools, tool calls and tool results, reasoning, `add_generation_prompt` both
ways, extra template arguments (`enable_thinking`, `reasoning_effort`, `builtin_tools`), documents, the
special tokens, named templates, `continue_final_message`, and `raise_exception`; `LLM.chat` passes the same
arguments through."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jinja2
import pytest
from tokenizers import AddedToken, Tokenizer

from moelight.tokenization.tokenizer import TokenizerError, load_tokenizer
from tests.test_tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

# Shortened templates written for these tests in the style of each family's Hub template.
MIXTRAL = r"""{#- Mixtral-8x22B-Instruct style: tools before the last user turn, system folded into it #}
{%- if messages[0].role == "system" %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message.role == "user" %}
        {%- if tools and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] " + tools | tojson + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if system_message is defined and loop.last %}
            {{- "[INST] " + system_message + "\n\n" + message.content + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message.content + "[/INST]" }}
        {%- endif %}
    {%- elif message.role == "assistant" and message.tool_calls %}
        {{- "[TOOL_CALLS] " + message.tool_calls | map(attribute="function") | list | tojson + eos_token }}
    {%- elif message.role == "assistant" %}
        {{- " " + message.content + eos_token }}
    {%- elif message.role == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + "}[/TOOL_RESULTS]" }}
    {%- else %}
        {{- raise_exception("Only user, assistant and tool roles are supported after an optional system message!") }}
    {%- endif %}
{%- endfor %}"""

CHATML = (  # Qwen2-MoE / DBRX-instruct: ChatML with a default system message
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nReturn each call as JSON in <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}
            {%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

TULU = """{% for message in messages %}
{% if message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] }}
{% elif message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}

{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""  # OLMoE-instruct: Tulu tags, multi-line (trim_blocks / lstrip_blocks decide the newlines)

HARMONY = r"""{#- GPT-OSS harmony style: system (reasoning effort, date, built-in tools), developer (instructions and
    functions as a TypeScript-like namespace), analysis / commentary / final channels -#}
{%- macro ts_type(spec) -%}
    {%- if spec.type == "array" -%}{{ ts_type(spec['items']) }}[]
    {%- elif spec.type == "string" and spec.enum is defined -%}{{ spec.enum | map("tojson") | join(" | ") }}
    {%- elif spec.type in ["integer", "number"] -%}number
    {%- else -%}{{ spec.type }}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_namespace(name, tools) -%}
namespace {{ name }} {
{% for tool in tools %}
{%- set tool = tool.function if tool.function is defined else tool %}

// {{ tool.description }}
type {{ tool.name }} = (_: {
{%- for pname, pspec in tool.parameters.properties | items %}
{%- if pspec.description %}

// {{ pspec.description }}
{%- endif %}

{{ pname }}{{ "?" if pname not in tool.parameters.required | default([]) }}: {{ ts_type(pspec) }},
{%- endfor %}

}) => any;
{% endfor %}

} // namespace {{ name }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{{- model_identity | default("You are ChatGPT, a large language model trained by OpenAI.") }}
{{- "\nKnowledge cutoff: 2024-06\nCurrent date: " + strftime_now("%Y-%m-%d") }}
{{- "\n\nReasoning: " + (reasoning_effort | default("medium")) + "\n\n" }}
{%- if builtin_tools %}
    {{- "# Tools\n\n" }}
    {%- for t in builtin_tools %}{{- "## " + t + "\n\n" }}{%- endfor %}
{%- endif %}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}{%- endif %}
{{- "<|end|>" }}
{%- if messages[0].role in ["developer", "system"] %}
    {%- set instructions = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set instructions = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if instructions or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if instructions %}{{- "# Instructions\n\n" + instructions + "\n\n" }}{%- endif %}
    {%- if tools %}{{- "# Tools\n\n## functions\n\n" + render_namespace("functions", tools) + "\n\n" }}{%- endif %}
    {{- "<|end|>" }}
{%- endif %}
{%- set ns = namespace(last_call=none) %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" %}
        {%- if "<|channel|>" in (message.content or "") %}
            {{- raise_exception("Put the reasoning in 'thinking', not channel tags in 'content'") }}
        {%- endif %}
        {%- if message.thinking and (message.tool_calls or loop.last) %}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- set call = message.tool_calls[0].function %}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" }}
            {{- call.arguments if call.arguments is string else call.arguments | tojson }}
            {{- "<|call|>" }}
            {%- set ns.last_call = call.name %}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content }}
            {{- "<|return|>" if loop.last and not add_generation_prompt else "<|end|>" }}
        {%- endif %}
    {%- elif message.role == "tool" %}
        {%- if ns.last_call is none %}
            {{- raise_exception("A tool message needs an assistant tool call before it") }}
        {%- endif %}
        {{- "<|start|>functions." + ns.last_call + " to=assistant<|channel|>commentary<|message|>" }}
        {{- message.content | tojson + "<|end|>" }}
    {%- elif message.role == "user" %}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- else %}
        {{- raise_exception("Unexpected message role: " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start|>assistant
{%- endif %}"""

# What transformers' jinja environment gives a template beyond plain jinja: checked as a whole.
FEATURES = r"""{%- set ns = namespace(n=0) %}
{%- for m in messages %}
    {%- if m.role == "skip" %}{% continue %}{% endif %}
    {%- if ns.n >= 4 %}{% break %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
[{{ m.role }} content-defined={{ m.content is defined }} {{ m.content | default("") | tojson }}]
{%- endfor %}
{{ messages | map(attribute="role") | list | tojson(indent=2) }}
{{ dict(b=2, a=[1, "é<&>"]) | tojson(sort_keys=true, separators=[",", ":"]) }} {{ "é" | tojson(ensure_ascii=true) }}
{% if documents %}
  {% for d in documents %}
<doc {{ loop.index }}: {{ d.title }}>{{ d.text | trim }}</doc>
  {% endfor %}
{% endif %}
tokens: {{ bos_token }} {{ eos_token }} {{ sep_token | default("-") }} {{ mask_token | default("-") }}
{{- " " }}{{ image_token | default("-") }} {{ pad_token is defined }}
date: {{ strftime_now("%Y-%m-%d") }} tools-none: {{ tools is none }} documents-none: {{ documents is none }}
{{- " " }}custom: {{ custom | default("unset") }}
{% if add_generation_prompt %}>>>{% endif %}"""

# Per family: template, added tokens (special, then plain), and tokenizer_config.json entries.
FAMILIES = {
    "mixtral": (MIXTRAL, ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                          "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], {}),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], [],
               {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "tulu": (TULU, ["<|endoftext|>"], ["<|system|>", "<|user|>", "<|assistant|>"],
             {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "harmony": (HARMONY, ["<|startoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|call|>",
                          "<|return|>", "<|constrain|>", "<|endoftext|>"], [],
                {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                 "unk_token": None}),
    "features": (FEATURES, ["<sep>", "<mask>", "<image>"], [],
                 {"sep_token": "<sep>", "mask_token": "<mask>", "image_token": "<image>"}),
}
# Mixtral keeps the transformers-5 Llama class (AutoTokenizer -> LlamaTokenizer); the others are generic.
CLASSES = {"mixtral": "LlamaTokenizerFast"}


def family_tokenizer(folder: Path, template, special=(), plain=(), **config) -> Path:
    """`build_tokenizer`'s BPE with the family's control tokens added to tokenizer.json."""
    build_tokenizer(folder, chat_template=template, **config)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(list(special))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tok.save(str(folder / "tokenizer.json"))
    return folder


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
PLAIN = [{"role": "user", "content": "Hi there"}]
WITH_SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Café? 2+2"}]
# OpenAI-style: the assistant's content is None beside its tool calls (transformers drops None-valued keys)
TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                  "name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}}]},
              {"role": "tool", "content": json.dumps({"temp": 21})}]
TWO_RESULTS = [*TOOL_TURNS[:1],
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                   {"type": "function", "function": {"name": "search", "arguments": {"query": "Paris"}}}]},
               {"role": "tool", "content": "21C"}, {"role": "tool", "content": "Paris is in France"}]
# reasoning under the names clients use: Qwen3 templates read reasoning_content, gpt-oss ones thinking
QWEN_REASONING = [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]
MIXED_REASONING = [{"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},
                   {"role": "user", "content": "3+3?"},
                   {"role": "assistant", "content": "6", "thinking": "Add again."}]
HARMONY_TURNS = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Bonjour !", "reasoning": "The user greets me."},
                 {"role": "user", "content": "2+2?"}]
HARMONY_TOOLS = [{"role": "system", "content": "Use tools."}, *TOOL_TURNS,
                 {"role": "assistant", "content": "21 degrees.", "thinking": "The tool said 21."}]


@dataclass
class Msg:  # a message object (like the OpenAI SDK's); transformers renders it as its fields
    role: str
    content: str | None = None


FEATURE_TURNS = [{"role": "system", "content": "S"}, {"role": "skip", "content": "x"},
                 {"role": "assistant", "content": None, "tool_calls": []}, Msg("user", "Hi <&>"), Msg("user"),
                 {"role": "user", "content": "dropped by break"}]
DOCS = [{"title": "Doc A", "text": "  alpha  "}, {"title": "Doc B", "text": "beta"}]

CASES = [  # (family, messages, tools, add_generation_prompt, extra template arguments)
    ("mixtral", [m for m in WITH_SYSTEM if m["role"] != "system"], None, True, {}),
    ("mixtral", WITH_SYSTEM, [WEATHER], True, {}),
    ("mixtral", TOOL_TURNS, [WEATHER, SEARCH], False, {}),
    ("chatml", PLAIN, None, True, {}),
    ("chatml", WITH_SYSTEM, None, False, {}),
    ("chatml", WITH_SYSTEM, [WEATHER], True, {"enable_thinking": False}),  # unused arguments change nothing
    ("qwen3", WITH_SYSTEM, None, True, {}),
    ("qwen3", WITH_SYSTEM, [WEATHER], True, {"enable_thinking": False}),
    ("qwen3", PLAIN, [WEATHER, SEARCH], False, {"enable_thinking": True}),
    ("qwen3", TOOL_TURNS, [WEATHER], True, {}),
    ("qwen3", TWO_RESULTS, [WEATHER, SEARCH], True, {"enable_thinking": False}),
    ("qwen3", QWEN_REASONING, None, False, {}),
    ("qwen3", MIXED_REASONING, None, True, {}),
    ("tulu", WITH_SYSTEM, None, True, {}),
    ("tulu", WITH_SYSTEM[1:3], None, False, {}),
    ("tulu", PLAIN, None, True, {}),
    ("harmony", PLAIN, None, True, {}),
    ("harmony", HARMONY_TURNS, [WEATHER], True, {"reasoning_effort": "high"}),
    ("harmony", HARMONY_TURNS, None, False, {"reasoning_effort": "low", "builtin_tools": ["browser", "python"]}),
    ("harmony", HARMONY_TOOLS, [WEATHER, SEARCH], False, {"model_identity": "You are a test model."}),
    ("harmony", MIXED_REASONING, None, True, {}),
    ("harmony", QWEN_REASONING, None, False, {}),  # reasoning_content reaches the template as thinking
    ("features", FEATURE_TURNS, None, True, {}),
    ("features", FEATURE_TURNS, [], False, {"custom": {"k": [1, 2]}, "documents": DOCS}),
]


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
    with pytest.raises(TokenizerError, match="tokenize"):
        mine.apply_chat_template(PLAIN, tokenize=False)
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
