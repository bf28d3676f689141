"""Gemma 4's tool-call values, as its chat template writes them (`format_argument`): objects of
bare `key:value` pairs (`{city:<|"|>Paris<|"|>,days:3}`), strings between `<|"|>` marks, numbers,
`true`/`false`/`null` and lists as JSON writes them, keys sorted.

`Reader` turns them into JSON text pair by pair (as `json.dumps` spaces it), so that a call's
arguments can stream: on text that ends mid-value it raises `Cut` with the JSON its prefix already
decides, always a prefix of the whole value's JSON. `write` is the template's spelling of a JSON
value, and `Grammar` the Lark rules (llguidance) of values that match a JSON schema.
"""

import json
import re

QUOTE = '<|"|>'
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")
_NULLS = ("null", "none", "nil")


class Cut(Exception):
    """The text ended inside a value; `decided` is the JSON text its prefix fixes."""

    def __init__(self, decided: str = ""):
        super().__init__(decided)
        self.decided = decided


class Reader:
    """Reads values from `text` at `at`, as JSON text; ValueError where it is not Gemma 4's."""

    def __init__(self, text: str, at: int = 0):
        self.text, self.at = text, at

    def value(self) -> str:
        self._space()
        rest = self.text[self.at :]
        if rest.startswith(QUOTE):
            return self._string()
        if QUOTE.startswith(rest):
            raise Cut()  # nothing yet, or a string's mark being written
        if rest[0] in "{[":
            return self._container()
        return self._bare()

    def _container(self) -> str:
        opening = self.text[self.at]
        closing, item = ("}", self._pair) if opening == "{" else ("]", self.value)
        self.at += 1
        items: list[str] = []
        lead = ""  # ", " once a comma promised another item
        try:
            while True:
                self._space()
                if self._take(closing):
                    return opening + ", ".join(items) + closing
                if items and not self._take(","):
                    raise ValueError(f"expected ',' or {closing!r} at {self.at}")
                lead = ", " if items else ""
                items.append(item())
                lead = ""
        except Cut as cut:
            raise Cut(opening + ", ".join(items) + lead + cut.decided) from None

    def _pair(self) -> str:
        self._space()
        colon = self.text.find(":", self.at)
        if colon < 0:
            if any(c in self.text[self.at :] for c in ",{}[]"):
                raise ValueError(f"a key without ':' at {self.at}")
            raise Cut()
        key = self.text[self.at : colon].strip()
        if key.startswith(QUOTE) and key.endswith(QUOTE) and len(key) >= 2 * len(QUOTE):
            key = key[len(QUOTE) : -len(QUOTE)]
        if not key or any(c in key for c in ",{}[]"):
            raise ValueError(f"a bad key {key!r} at {self.at}")
        self.at = colon + 1
        head = f"{json.dumps(key, ensure_ascii=False)}: "
        try:
            return head + self.value()
        except Cut as cut:
            raise Cut(head + cut.decided) from None

    def _string(self) -> str:
        start = self.at + len(QUOTE)
        end = self.text.find(QUOTE, start)
        if end < 0:  # the end may hold the beginning of the closing mark
            content = self.text[start:]
            content = content[: len(content) - _mark_begun(content)]
            raise Cut(json.dumps(content, ensure_ascii=False)[:-1])
        self.at = end + len(QUOTE)
        return json.dumps(self.text[start:end], ensure_ascii=False)

    def _bare(self) -> str:
        match = re.compile(r"[^,}\]]*").match(self.text, self.at)
        if match.end() == len(self.text):
            raise Cut()  # `tru`, `4`: more may come
        self.at = match.end()
        return bare_json(match[0].strip())

    def _space(self) -> None:
        while self.at < len(self.text) and self.text[self.at].isspace():
            self.at += 1

    def _take(self, char: str) -> bool:
        if self.at >= len(self.text):
            raise Cut()
        if self.text[self.at] == char:
            self.at += 1
            return True
        return False


def _mark_begun(text: str) -> int:
    return next((n for n in range(len(QUOTE) - 1, 0, -1) if text.endswith(QUOTE[:n])), 0)


def bare_json(text: str) -> str:
    """An unquoted value's JSON: true, false, null (also None, nil), a number; else a string."""
    if text in ("true", "false"):
        return text
    if text.lower() in _NULLS:
        return "null"
    if _NUMBER.fullmatch(text):
        return json.dumps(json.loads(text))
    if not text:
        raise ValueError("a key without a value")
    return json.dumps(text, ensure_ascii=False)


def write(value) -> str:
    """A JSON value as the template writes it (keys sorted, bare)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write(v) for v in value) + "]"
    return json.dumps(value)  # numbers, true, false, null


# values of any schema: strings, JSON scalars, objects of bare keys and lists of them
ANY_RULES = """g4_any: g4_string | g4_scalar | g4_object | g4_array
g4_scalar: %json {"type": ["number", "boolean", "null"]}
g4_object: "{" (g4_pair ("," g4_pair)*)? "}"
g4_pair: G4_KEY ":" g4_any
G4_KEY: /[A-Za-z_][A-Za-z0-9_.-]*/
g4_array: "[" (g4_any ("," g4_any)*)? "]"
G4_TEXT: /(?s:.*)/
"""


class Grammar:
    """Lark rules of Gemma 4 values matching JSON schemas; `quote` is the Lark expression of
    the string mark (a special token's `<[id]>`, or its text)."""

    def __init__(self, quote: str):
        self.quote = quote
        self.rules: list[str] = []

    def text(self) -> str:
        """All rules made so far, and the shared ones."""
        # a mark that is a token ends a greedy text; a text mark ends the shortest (lazy)
        string = (
            f"g4_string: {self.quote} G4_TEXT {self.quote}"
            if self.quote.startswith("<[")
            else f"g4_string: {self.quote} g4_text\ng4_text[lazy]: G4_TEXT {self.quote}"
        )
        return "\n".join([*self.rules, string, ANY_RULES])

    def value(self, schema: dict) -> str:
        """The expression of a value matching `schema` (what it cannot follow: any value)."""
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return self._choice([self.literal(v) for v in values])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._choice([self.value(s) for s in schema[key]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._choice([self.value({**schema, "type": t}) for t in kind])
        if kind == "string":
            return "g4_string"
        if kind in ("integer", "number", "boolean", "null"):
            compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
            return self._rule(f"%json {json.dumps(compact)}")
        if kind == "object" and "properties" in schema:
            return self.object(schema)
        if kind == "array":
            item = self.value(schema.get("items") or {})
            return f'"[" ({item} ("," {item})*)? "]"'
        return "g4_any"

    def object(self, schema: dict) -> str:
        """`{key:value,...}`: the schema's properties in the template's (sorted) order, each
        required one present, commas only between those written."""
        required = set(schema.get("required", ()))
        properties = sorted(schema.get("properties", {}).items())
        first, rest = None, None  # rules of the pairs from i on: none written yet / some
        for key, sub in reversed(properties):
            pair = f"{json.dumps(key + ':')} {self.value(sub)}"
            tail = f" {rest}" if rest else ""
            if key in required:
                first, rest = self._rule(pair + tail), self._rule(f'"," {pair}{tail}')
            else:
                alone = f"({pair}{tail})"
                first = self._rule(f"{alone} | {first}" if first else f"{alone}?")
                rest = self._rule(f'("," {pair})?{tail}')
        return f'"{{" {first} "}}"' if first else '"{}"'

    def literal(self, value) -> str:
        if isinstance(value, str):
            inner = f" {json.dumps(value)} " if value else " "
            return f"{self.quote}{inner}{self.quote}"
        if isinstance(value, (dict, list)):
            return "g4_any"
        return json.dumps(write(value))

    def _choice(self, options: list[str]) -> str:
        return "(" + " | ".join(options) + ")"

    def _rule(self, body: str) -> str:
        name = f"g4_{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name
