"""Qwen3-Coder's tool-call values: each parameter's text between `<parameter=KEY>` and
`</parameter>`, typed by the tool's JSON schema as vLLM's `qwen3_coder` parser types it. A string
parameter (or one the schema does not declare) stays the text as written; integers, numbers and
booleans are read from it, `null` or `None` is null where the type allows it; objects, arrays and
anything else are JSON (or a Python literal), else the text.
"""

import ast
import json
import math

_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_NULLS = ("null", "none")


def param_type(schema: dict | None) -> tuple[str, bool]:
    """(the parameter's type, lower case, and whether null is allowed): the first non-null
    type of a list or `anyOf`; string where the schema names none."""
    schema = schema if isinstance(schema, dict) else {}
    options = schema.get("anyOf") or [schema]
    types = [t for o in options if isinstance(o, dict) for t in _types(o)]
    kinds = [t for t in types if t != "null"]
    return (kinds[0] if kinds else ("null" if types else "string")), "null" in types


def _types(schema: dict) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        return []
    return [str(t).strip().lower() for t in (kind if isinstance(kind, list) else [kind])]


def is_text(schema: dict | None) -> bool:
    """The parameter is a string: written as bare text (`null` may still mean null)."""
    return param_type(schema)[0] in _STRINGS


def stays_text(schema: dict | None) -> bool:
    """Any text of the parameter is its value (a string that cannot be null)."""
    kind, nullable = param_type(schema)
    return kind in _STRINGS and not nullable


def typed(text: str, schema: dict | None):
    """The JSON value of a parameter's text under its schema (None: undeclared, a string)."""
    kind, nullable = param_type(schema)
    if text.lower() in _NULLS and (nullable or kind not in _STRINGS):
        return None
    if kind in _STRINGS:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _number(text, int)
    if kind.startswith(("num", "float")):
        value = _number(text, float)
        return int(value) if isinstance(value, float) and value.is_integer() else value
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    return _literal(text)


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        return text
    return value if math.isfinite(value) else text


def _literal(text: str):
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)  # a set, bytes or NaN is no JSON value: the text
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is no JSON value")


def value_text(value) -> str:
    """A value as the template writes a parameter: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
