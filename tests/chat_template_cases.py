"""The chat templates, message lists and cases that tests/test_chat_templates.py renders through moelight and
transformers: shortened templates in the style of each family's Hub template, and the tokenizer folders they
go in."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from tests.test_tokenizer import build_tokenizer

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
