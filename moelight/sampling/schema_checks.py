"""JSON schema keywords that xgrammar (0.2.8) parses and then ignores, refused by where they sit: accepted,
they would let an output that ends "stop" break the schema.

What xgrammar ignores (its json_schema_converter.cc, and a probe of every case below): keywords it never
reads (_UNENFORCED); everything beside the first of $ref, const, enum, anyOf, oneOf that a schema holds
(it reads that one only); a $ref that is not a local "#/..." pointer (read as any JSON value); minLength /
maxLength beside a pattern or a format it knows, and a pattern beside such a format (the format wins); a
format it does not know; string, number, array keywords in a schema with no type, properties or items
(read as any JSON value); and in a pattern, what structured_outputs.regex refuses (a lookahead, a group
flag) or an anchor inside it (dropped).
"""

from __future__ import annotations

import re

from moelight.errors import MoelightError

# keywords xgrammar does not enforce (vLLM refuses these for xgrammar too)
_UNENFORCED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "minProperties",
               "maxProperties", "propertyNames", "patternProperties", "allOf", "not", "if", "then", "else",
               "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
               "unevaluatedItems", "$dynamicRef", "$recursiveRef")
_SCHEMA_VALUED = ("properties", "$defs", "definitions")  # maps of names to schemas: a name is no keyword
_EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf")  # xgrammar reads the first present, nothing beside
_BY_TYPE = {"string": ("format", "pattern", "minLength", "maxLength"),
            "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
            "integer": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
            "array": ("items", "prefixItems", "minItems", "maxItems"),
            "object": ("properties", "required", "additionalProperties")}
_TYPED = tuple(dict.fromkeys(k for keys in _BY_TYPE.values() for k in keys))
_VALIDATION = ("type",) + _EXCLUSIVE + _TYPED
_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template",
                      "ipv4", "ipv6", "hostname", "uuid", "json-pointer", "relative-json-pointer"})
_TYPE_OF = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
            "null": lambda v: v is None, "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, float) and v.is_integer())}


class StructuredOutputError(MoelightError, ValueError):
    """A constraint that cannot compile (a bad schema or regex), or xgrammar missing."""


def check_schema_keywords(schema, where: str = "") -> None:
    """Refuse a schema that uses a keyword the grammar cannot enforce, naming where it sits."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema_keywords(item, f"{where}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    bad = [k for k in _UNENFORCED if k in schema] + _ignored(schema)
    if bad:
        raise StructuredOutputError(f"the JSON schema uses {', '.join(bad)} at {where or 'its root'}: structured "
                                    "outputs cannot enforce it (xgrammar's JSON schema support), so outputs "
                                    "could break it; remove it or validate the outputs afterwards")
    for key, value in schema.items():
        if key in _SCHEMA_VALUED and isinstance(value, dict):
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}/{key}/{name}")
        elif key not in ("enum", "const", "default", "examples", "required"):
            check_schema_keywords(value, f"{where}/{key}")


def _ignored(schema: dict) -> list[str]:
    """The keywords of this one schema (not its subschemas) that xgrammar would read past."""
    props, required = schema.get("properties"), schema.get("required")
    props = props if isinstance(props, dict) else {}
    bad = []
    if isinstance(required, list) and (undefined := [n for n in required if n not in props]):
        bad.append(f"required {', '.join(map(str, undefined))} (not among its properties)")
    first = next((k for k in _EXCLUSIVE if k in schema), None)
    if first is not None:
        values = [schema["const"]] if first == "const" else schema.get("enum") if first == "enum" else None
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        typed = isinstance(values, list) and isinstance(types, list) and all(
            any(_TYPE_OF.get(t, lambda v: False)(v) for t in types) for v in values)
        beside = [k for k in _VALIDATION if k in schema and k != first and not (k == "type" and typed)]
        bad += [f"{k} beside {first}" for k in beside]
        ref = schema.get("$ref")
        if first == "$ref" and isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            bad.append(f"$ref {ref!r} (only a local '#/...' pointer is resolved)")
        return bad
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "string" in types:
        bad += _string_ignored(schema)
    if not types and not any(k in schema for k in ("properties", "additionalProperties", "items", "prefixItems")):
        bad += [f"{k} without a type" for k in _TYPED if k in schema and k != "required"]
    return bad


def _string_ignored(schema: dict) -> list[str]:
    fmt, pattern = schema.get("format"), schema.get("pattern")
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    bad = []
    if fmt is not None and fmt not in _FORMATS:
        bad.append(f"format {fmt!r} (the grammar knows {', '.join(sorted(_FORMATS))})")
    elif fmt is not None:
        bad += [f"{k} beside format" for k in lengths] + (["pattern beside format"] if pattern is not None else [])
    if pattern is not None and fmt is None:
        bad += [f"{k} beside pattern" for k in lengths]
        if isinstance(pattern, str) and (why := regex_problem(pattern)):
            bad.append(f"pattern {pattern!r} ({why})")
    return bad


def regex_problem(regex: str) -> str | None:
    """Why xgrammar would not match this regex as written (None if it would): a construct its regex
    parser refuses (a JSON schema's pattern passes through another parser, which drops a lookahead), or
    an anchor inside it, which it drops ("a^b" would match "ab")."""
    import xgrammar

    try:
        xgrammar.Grammar.from_regex(regex)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for what it cannot parse
        return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip()).split("\n")[0]
    if _inner_anchor(regex):
        return "an anchor ^ or $ inside it is dropped, not matched"
    return None


def _inner_anchor(regex: str) -> bool:
    """A ^ that follows a character or a $ that precedes one (outside a class, unescaped)."""
    i, in_class, n = 0, False, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":  # a class: a leading ^ negates it, a ] right after is a literal
            in_class, i = True, i + 1
            i += regex[i:i + 1] == "^"
            i += regex[i:i + 1] == "]"
            continue
        elif c == "^" and i > 0 and regex[i - 1] not in "(|" and regex[i - 3:i] != "(?:":
            return True
        elif c == "$" and i + 1 < n and regex[i + 1] not in ")|":
            return True
        i += 1
    return False
