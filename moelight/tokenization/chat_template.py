"""Chat templates as transformers 5 renders them: the sandboxed jinja environment (its filters,
globals and extensions) and the template's inputs (messages as plain dicts with None-valued keys
dropped and reasoning copied under ``reasoning_content`` and ``thinking``; tools and documents
checked), without importing transformers."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from moelight.errors import TokenizerError


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask templates) and render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like transformers: jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """transformers' ``dict`` global: builds dicts without handing the template the ``dict`` type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' ``namespace``: underscore-prefixed attributes are refused (no way to CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's signature trick, so that namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace (got {name!r})")


def compile_chat_template(source: str) -> jinja2.Template:
    """A sandboxed template with the environment transformers 5 gives Hub chat templates: trim_blocks and
    lstrip_blocks, loop controls, ``{% generation %}``, a ``tojson`` that does not HTML-escape (with
    ``indent``, ``separators``, ``sort_keys``, ``ensure_ascii``), ``raise_exception``, ``strftime_now``,
    and its guarded ``dict`` and ``namespace``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


# What a template sees, as transformers 5 builds it (utils/chat_template_utils.py).

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# transformers' apply_chat_template takes these itself (they never reach the template); moelight has no use for them
NOT_TEMPLATE_ARGS = ("tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                      "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens")


def _objects_to_dicts(value: Any) -> Any:
    """Dataclasses and pydantic models (e.g. OpenAI SDK messages) as dicts, at any depth."""
    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def plain(value: Any) -> Any:
    """Plain JSON-like data only (a fresh copy): other objects become a ``<TypeName>`` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    np = sys.modules.get("numpy")  # a numpy value can only exist if numpy is imported
    if np is not None and isinstance(value, np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def template_messages(messages: Any) -> list[dict]:
    """transformers' message preparation: objects to dicts, None-valued keys dropped, plain data, and a
    message's reasoning under ``reasoning_content`` and ``thinking`` (gpt-oss templates read the latter)."""
    out = []
    for m in _objects_to_dicts(getattr(messages, "messages", messages)):
        if not isinstance(m, dict):
            raise TokenizerError(f"chat messages are dicts with 'role' and 'content', got {m!r}")
        m = plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def template_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise TokenizerError(f"tools is a list of JSON-schema tool dicts, got {type(tools).__name__}")
    for tool in tools:
        if not isinstance(tool, dict):
            hint = (" (transformers.utils.get_json_schema(fn) gives a function's schema)"
                    if callable(tool) else "")
            raise TokenizerError(f"each tool is a JSON-schema dict such as {{'type': 'function', 'function': "
                                 f"{{'name': ..., 'description': ..., 'parameters': {{...}}}}}}, got "
                                 f"{type(tool).__name__}{hint}")
    return plain(list(tools))


def template_documents(documents: Any) -> list[dict] | None:
    if documents is None:
        return None
    if not all(isinstance(d, dict) for d in documents):
        raise TokenizerError("documents is a list of dicts with 'title' and 'text' keys")
    return plain(documents)
