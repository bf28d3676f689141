"""Tool-call syntaxes: read a model's calls out of its text, write them back for the prompt, and
the Lark grammar (llguidance) that forces an answer made only of calls.

Each parser follows the format its model family was trained on, as vLLM's parser of the same name
reads it: `hermes` (Hermes, Qwen 2.5/3, SmolLM3: `<tool_call>{json}</tool_call>`), `llama3_json`
(Llama 3.1-3.3: `{"name", "parameters"}`, optionally after `<|python_tag|>`), `mistral`
(`[TOOL_CALLS][{...}]`, or `[TOOL_CALLS]name[ARGS]{...}` from v11 tokenizers), `gemma` (a
```tool_code block of Python calls or JSON) and `glm45` (GLM-4.5/4.6: `<tool_call>name` then
`<arg_key>`/`<arg_value>` pairs; `glm47`, GLM-4.7's spelling of them without newlines), `gemma4`
(`<|tool_call>call:name{key:value}<tool_call|>`, kestrel.server.tools.gemma4) and `qwen3_coder`
(Qwen3-Coder, Qwen3.5: `<function=name>` and `<parameter=key>` tags, values typed by the tool's
schema, kestrel.server.tools.qwen3_coder). `choose_parser` picks one from the model's chat template
and vocabulary (`DETECT`), or by name (`--tool-call-parser`).
"""

import ast
import json
import re
from dataclasses import dataclass
from typing import ClassVar

from kestrel.server.tools import gemma4, qwen3_coder

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as the JSON text of an object."""

    name: str
    arguments: str


def call_of(name, arguments) -> ToolCall | None:
    """The call, or None unless `name` is a string and `arguments` an object (or its JSON)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_call(value, arguments_key: str = "arguments", written: str = "") -> ToolCall | None:
    """The call of a decoded JSON object; `written`, the object's text, keeps the arguments as
    the model wrote them (what streaming sent) where they are an object after the name."""
    if not isinstance(value, dict):
        return None
    arguments = value.get(arguments_key, value.get("parameters", value.get("arguments", {})))
    call = call_of(value.get("name"), arguments)
    partial = partial_call(written)
    if call and partial and partial.done and partial.name == call.name:
        return ToolCall(call.name, partial.arguments)
    return call


@dataclass(frozen=True)
class PartialCall:
    """A JSON call being written: its name, and its arguments object's text so far (`done`: the
    whole object)."""

    name: str
    arguments: str
    done: bool


# `{"name": "...", "arguments": ` (or "parameters"), the arguments an object
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


def partial_call(text: str) -> PartialCall | None:
    """The call whose JSON object `text` begins, once its name and the `{` of its arguments are
    written; None for anything else (arguments as a string, keys in another order)."""
    head = _CALL_HEAD.match(text)
    try:
        name = head and json.loads(head[1])
    except ValueError:
        return None
    if not name:
        return None
    end = object_end(text, head.end())
    return PartialCall(name, text[head.end() : len(text) if end is None else end], end is not None)


def _brackets(text: str, at: int):
    """(index, char) of each brace and bracket of `text[at:]` outside JSON strings."""
    in_string = escaped = False
    for i in range(at, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif in_string:
            escaped, in_string = c == "\\", c != '"'
        elif c == '"':
            in_string = True
        elif c in "{}[]":
            yield i, c


def object_end(text: str, at: int) -> int | None:
    """Just past the `}` that closes the object opening at `text[at]`, or None (not yet)."""
    depth = 0
    for i, c in _brackets(text, at):
        depth += 1 if c in "{[" else -1
        if depth == 0:
            return i + 1
    return None


def open_object(text: str, at: int = 0) -> tuple[int, int] | None:
    """(how many top-level objects of `text[at:]` are closed, where the last one opens) when
    that last one is not closed yet; else None. Brackets outside objects are not counted."""
    start, depth, closed = 0, 0, 0
    for i, c in _brackets(text, at):
        if c in "{[" and (depth or c == "{"):
            start, depth = (i if depth == 0 else start), depth + 1
        elif c in "}]" and depth:
            depth -= 1
            closed += depth == 0
    return (closed, start) if depth else None


def _decode(text: str, at: int = 0) -> tuple[object, int] | None:
    """The JSON value starting at `at` (after whitespace) and where it ends, or None."""
    at += len(text[at:]) - len(text[at:].lstrip())
    try:
        return _DECODER.raw_decode(text, at)
    except ValueError:
        return None


def suffix_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """A format: `markers` open the calls part of an answer; `parse` splits text into what lies
    outside the calls and the calls. `final` False (streaming) parses only calls that more text
    can no longer change."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]
    syntax: ClassVar[str]  # how a call is written, for the prompt of templates without tools
    arguments_key: ClassVar[str] = "arguments"
    special_tokens: ClassVar[bool] = False  # its markers are special tokens (decode them)

    def __init__(self, literal=json.dumps):
        self.literal = literal  # marker -> its Lark expression (a special token: `<[id]>`)

    def start(self, text: str) -> int:
        """Where the calls part begins in `text`, or -1."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def held(self, text: str) -> int:
        """How many characters at the end of `text` may begin a marker (not content yet)."""
        return max(suffix_prefix(text, m) for m in self.markers)

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        """The JSON call being written at the end of `text` (arguments not closed, or the call
        not yet read by `parse`) and how many calls come before it; None if there is none."""
        begin = self.start(text)
        found = open_object(text, begin) if begin >= 0 else None
        call = found and partial_call(text[found[1] :])
        return (found[0], call) if call else None

    def render(self, calls: list[ToolCall]) -> str:
        """The calls as the model writes them (for earlier assistant turns in the prompt)."""
        raise NotImplementedError

    def for_tools(self, tools: list[dict]) -> "ToolParser":
        """The parser of a request that offers `tools` (OpenAI function tools): itself, or a
        copy that reads values by their schema."""
        return self

    def grammar(self, call_schema: dict, parallel: bool) -> str:
        """A Lark grammar of answers made of one call (or, parallel, one or more) whose JSON
        object (name and arguments) matches `call_schema`."""
        repeat = f" ({self.literal(self.separator)} call)*" if parallel else ""
        return f"start: call{repeat}\n{self._call_rule()}\n{_json_rule(call_schema)}"

    separator: ClassVar[str] = "\n"

    def _call_rule(self) -> str:
        return "call: obj"


def _json_rule(schema: dict) -> str:
    # compact JSON, as response_format's (see kestrel.structured.JSON_OPTIONS)
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return f"obj: %json {json.dumps(schema)}\n"


class Tagged(ToolParser):
    """Calls between an open and a close tag, text around them (hermes, gemma, glm45)."""

    open: ClassVar[str]
    close: ClassVar[str]

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.open,)

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ToolCall]]:
        content, calls, at = [], [], 0
        while (begin := text.find(self.open, at)) >= 0:
            end = text.find(self.close, begin + len(self.open))
            if end < 0 and not final:  # unclosed: a call only once the text ends
                break
            body_end = len(text) if end < 0 else end
            stop = body_end if end < 0 else end + len(self.close)
            found = self.body(text[begin + len(self.open) : body_end])
            content.append(text[at:begin] if found else text[at:stop])  # a bad call stays text
            calls += found
            at = stop
        content.append(text[at:])
        return "".join(content), calls

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        begin = text.rfind(self.open)
        if begin < 0 or text.find(self.close, begin) >= 0:
            return None
        call = partial_call(text[begin + len(self.open) :])
        return (len(self.parse(text, final=False)[1]), call) if call else None

    def body(self, text: str) -> list[ToolCall]:
        """The calls of one tagged body (none if it does not parse)."""
        raise NotImplementedError

    def render(self, calls: list[ToolCall]) -> str:
        return self.separator.join(f"{self.open}{self.write(c)}{self.close}" for c in calls)

    def write(self, call: ToolCall) -> str:
        raise NotImplementedError

    @property
    def tags(self) -> tuple[str, ...]:
        """The format's tags (tokens in some vocabularies)."""
        return (self.open, self.close)

    def spelled(self, text: str) -> str:
        """`text` as a Lark sequence, each of the format's tags in it as `literal` writes it."""
        parts = re.split(f"({'|'.join(map(re.escape, self.tags))})", text)
        return " ".join(self.literal(p) if p in self.tags else json.dumps(p) for p in parts if p)

    def _call_rule(self) -> str:
        return f"call: {self.literal(self.open)} obj {self.literal(self.close)}"


class Hermes(Tagged):
    name = "hermes"
    open, close = "<tool_call>\n", "\n</tool_call>"
    syntax = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'

    @property
    def markers(self) -> tuple[str, ...]:
        return ("<tool_call>",)

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ToolCall]]:
        return super().parse(self._spelled(text), final)

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        return super().pending(self._spelled(text))

    def _spelled(self, text: str) -> str:
        # models put any whitespace inside the tags; parse one spelling
        text = re.sub(r"<tool_call>\s*", "<tool_call>\n", text)
        return re.sub(r"\s*</tool_call>", "\n</tool_call>", text)

    def body(self, text: str) -> list[ToolCall]:
        decoded = _decode(text)
        call = decoded and not text[decoded[1] :].strip() and _json_call(decoded[0], written=text)
        return [call] if call else []

    def write(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})

    def _call_rule(self) -> str:
        tags = self.literal("<tool_call>"), self.literal("</tool_call>")
        return f'call: {tags[0]} "\\n" obj "\\n" {tags[1]}'


class Gemma(Tagged):
    """A ```tool_code block: Python calls `f(a=1)` (one a line, or a list), or JSON objects."""

    name = "gemma"
    open, close = "```tool_code\n", "\n```"
    syntax = '```tool_code\n{"name": <function-name>, "arguments": <args-json-object>}\n```'

    def body(self, text: str) -> list[ToolCall]:
        decoded = _decode(text)
        if decoded and not text[decoded[1] :].strip():
            if not isinstance(decoded[0], list):
                call = _json_call(decoded[0], written=text)
                return [call] if call else []
            calls = [_json_call(v) for v in decoded[0]]
            return calls if calls and all(calls) else []
        return python_calls(text)

    def write(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "arguments": json.loads(call.arguments)})


def python_calls(text: str) -> list[ToolCall]:
    """`f(a=1, b="x")` lines or `[f(a=1), g()]`: keyword arguments of literal values only."""
    try:
        tree = ast.parse(text.strip(), mode="eval" if text.strip().startswith("[") else "exec")
    except SyntaxError:
        return []
    nodes = tree.body.elts if isinstance(tree, ast.Expression) else [s.value for s in tree.body]
    calls = [_python_call(node) for node in nodes]
    return calls if calls and all(calls) else []


def _python_call(node) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        return None
    return call_of(node.func.id, arguments) if None not in arguments else None


class Glm45(Tagged):
    """`<tool_call>name` then `<arg_key>`/`<arg_value>` pairs, a newline after the name and each
    tag (GLM-4.5/4.6) or none (GLM-4.7, `glm47`): both spellings parse, `gap` is the one written."""

    name = "glm45"
    open, close = "<tool_call>", "</tool_call>"
    gap: ClassVar[str] = "\n"
    syntax = (
        "<tool_call><function-name>\n<arg_key>key</arg_key>\n<arg_value>value</arg_value>\n"
        "</tool_call>"
    )
    tags = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
    _NAME_END = re.compile(r"\n|<arg_key>")

    def body(self, text: str) -> list[ToolCall]:
        end = self._NAME_END.search(text)
        name, rest = (text[: end.start()], text[end.start() :]) if end else (text, "")
        arguments = {key.strip(): _glm_value(value) for key, value in self._PAIR.findall(rest)}
        if self._PAIR.sub("", rest).strip():  # anything but pairs: not a call
            return []
        call = call_of(name.strip(), arguments)
        return [call] if call else []

    def write(self, call: ToolCall) -> str:
        gap = self.gap
        pairs = "".join(
            f"<arg_key>{key}</arg_key>{gap}<arg_value>{_glm_text(value)}</arg_value>{gap}"
            for key, value in json.loads(call.arguments).items()
        )
        return f"{call.name}{gap}{pairs}"

    def grammar(self, call_schema: dict, parallel: bool) -> str:
        """One `call` alternative per tool, its arguments in the schema's property order, each
        value JSON of its property's schema (strings in quotes, which `_glm_value` reads)."""
        rules, names = [], []
        for k, tool in enumerate(call_schema["anyOf"]):
            name = tool["properties"]["name"]["const"]
            parameters = tool["properties"]["arguments"]
            pairs, values = self._pairs(parameters, f"v{k}_")
            rules += values
            opening = self.spelled(f"{self.open}{name}{self.gap}")
            names.append(f"{opening} {pairs} {self.spelled(self.close)}")
        return (
            f"start: {self._calls(parallel)}\ncall: {' | '.join(names)}\n" + "\n".join(rules) + "\n"
        )

    def _pairs(self, parameters: dict, prefix: str) -> tuple[str, list[str]]:
        required = set(parameters.get("required", ()))
        pairs, rules = [], []
        for j, (key, schema) in enumerate(parameters.get("properties", {}).items()):
            rule = f"{prefix}{j}"
            opening = self.spelled(f"<arg_key>{key}</arg_key>{self.gap}<arg_value>")
            pair = f"{opening} {rule} {self.spelled(f'</arg_value>{self.gap}')}"
            pairs.append(pair if key in required else f"({pair})?")
            schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
            rules.append(f"{rule}: %json {json.dumps(schema)}")
        return " ".join(pairs) or '""', rules

    def _calls(self, parallel: bool) -> str:
        separator = f"{self.literal(self.separator)} " if self.separator else ""
        return f"call ({separator}call)*" if parallel else "call"


class Glm47(Glm45):
    name = "glm47"
    gap = separator = ""
    syntax = (
        "<tool_call><function-name><arg_key>key</arg_key><arg_value>value</arg_value></tool_call>"
    )


class Gemma4(Tagged):
    """`<|tool_call>call:name{key:value,...}<tool_call|>`, calls back to back; the arguments'
    JSON is read pair by pair (kestrel.server.tools.gemma4), so it streams as it is written. The
    model then writes `<|tool_response>`, an end-of-turn token (kestrel.tokenizer)."""

    name = "gemma4"
    open, close = "<|tool_call>", "<tool_call|>"
    separator = ""
    special_tokens = True
    syntax = '<|tool_call>call:<function-name>{<key>:<|"|><string><|"|>,<key>:<number>}<tool_call|>'
    _HEAD = re.compile(r"\s*call:([\w.-]+)(?=\{)")

    def body(self, text: str) -> list[ToolCall]:
        head = self._HEAD.match(text)
        reader = head and gemma4.Reader(text, head.end())
        try:
            arguments = reader and reader.value()
        except (ValueError, gemma4.Cut):
            return []
        if not arguments or text[reader.at :].strip():
            return []
        return [ToolCall(head[1], arguments)]

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        begin = text.rfind(self.open)
        if begin < 0 or text.find(self.close, begin) >= 0:
            return None
        body = text[begin + len(self.open) :]
        head = self._HEAD.match(body)
        if not head:
            return None
        try:
            arguments = gemma4.Reader(body, head.end()).value()
        except gemma4.Cut as cut:
            arguments = cut.decided
        except ValueError:
            return None
        return len(self.parse(text, final=False)[1]), PartialCall(head[1], arguments, False)

    def write(self, call: ToolCall) -> str:
        return f"call:{call.name}{gemma4.write(json.loads(call.arguments))}"

    def grammar(self, call_schema: dict, parallel: bool) -> str:
        """One `call` alternative per tool, its arguments in the template's (sorted) order."""
        values = gemma4.Grammar(self.literal(gemma4.QUOTE))
        calls = []
        for tool in call_schema["anyOf"]:
            name = tool["properties"]["name"]["const"]
            parameters = tool["properties"]["arguments"]
            arguments = values.object(parameters) if "properties" in parameters else "g4_object"
            head = json.dumps(f"call:{name}")
            calls.append(f"{self.literal(self.open)} {head} {arguments} {self.literal(self.close)}")
        start = "call+" if parallel else "call"
        return f"start: {start}\ncall: {' | '.join(calls)}\n{values.text()}"


class Qwen3Coder(Tagged):
    """`<tool_call>` then `<function=name>` and a `<parameter=key>` block per argument, each
    value on its own lines, typed by the tool's parameter schema (for_tools;
    kestrel.server.tools.qwen3_coder). String values stream as they are written; the others
    once whole."""

    name = "qwen3_coder"
    open, close = "<tool_call>", "</tool_call>"
    syntax = (
        "<tool_call>\n<function=<function-name>>\n<parameter=<key>>\n<value>\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
    _OPEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*)", re.DOTALL)
    _VALUE_END = "\n</parameter>"

    def __init__(self, literal=json.dumps, properties: dict[str, dict] | None = None):
        super().__init__(literal)
        self.properties = properties or {}  # function name -> its parameters' schemas

    def for_tools(self, tools: list[dict]) -> "Qwen3Coder":
        properties = {}
        for tool in tools:
            parameters = tool["function"].get("parameters") or {}
            declared = parameters.get("properties") if isinstance(parameters, dict) else None
            properties[tool["function"]["name"]] = declared if isinstance(declared, dict) else {}
        return type(self)(self.literal, properties)

    def body(self, text: str) -> list[ToolCall]:
        head = self._FUNCTION.match(text)
        if not head:
            return []
        pairs, at = self._pairs(head[1], text, head.end())
        if text[at:].strip() not in ("", "</function>"):  # anything else: not a call
            return []
        return [ToolCall(head[1], "{" + ", ".join(pairs) + "}")]

    def _pairs(self, name: str, text: str, at: int) -> tuple[list[str], int]:
        """The JSON text of each whole parameter from `at`, and where they end."""
        schemas, pairs = self.properties.get(name, {}), []
        while match := self._PARAMETER.match(text, at):
            key, value = match[1].strip(), _one_newline_off(match[2])
            typed = qwen3_coder.typed(value, schemas.get(key))
            pairs.append(f"{json.dumps(key, ensure_ascii=False)}: {_json(typed)}")
            at = match.end()
        return pairs, at

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        begin = text.rfind(self.open)
        if begin < 0 or text.find(self.close, begin) >= 0:
            return None
        body = text[begin + len(self.open) :]
        head = self._FUNCTION.match(body)
        if not head:
            return None
        pairs, at = self._pairs(head[1], body, head.end())
        if body[at:].strip().startswith("</function>"):
            arguments = "{" + ", ".join(pairs) + "}"
        else:
            arguments = "{" + ", ".join([*pairs, *self._open_pair(head[1], body[at:])])
        return len(self.parse(text, final=False)[1]), PartialCall(head[1], arguments, False)

    def _open_pair(self, name: str, text: str) -> list[str]:
        """The decided JSON text of a parameter being written: its key, and a string's text
        so far (what may begin the closing tag held back)."""
        match = self._OPEN_PARAMETER.match(text)
        if not match:
            return []
        key = match[1].strip()
        head = f"{json.dumps(key, ensure_ascii=False)}: "
        if not qwen3_coder.stays_text(self.properties.get(name, {}).get(key)):
            return [head]
        value = match[2][1:] if match[2].startswith("\n") else match[2]
        value = value[: len(value) - suffix_prefix(value, self._VALUE_END)]
        return [head + json.dumps(value, ensure_ascii=False)[:-1]]

    def write(self, call: ToolCall) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{qwen3_coder.value_text(value)}\n</parameter>\n"
            for key, value in json.loads(call.arguments).items()
        )
        return f"\n<function={call.name}>\n{parameters}</function>\n"

    def grammar(self, call_schema: dict, parallel: bool) -> str:
        """One `call` alternative per tool, its parameters in the schema's order: strings as
        text, other types as JSON of their schema."""
        rules, calls = ["Q_TEXT: /(?s:.*)/"], []
        for k, tool in enumerate(call_schema["anyOf"]):
            name = tool["properties"]["name"]["const"]
            parameters = _qwen_parameters(tool["properties"]["arguments"], f"q{k}_", rules)
            head = json.dumps(f"\n<function={name}>\n")
            tail = f'"</function>\\n" {self.literal(self.close)}'
            calls.append(f"{self.literal(self.open)} {head} {parameters} {tail}")
        repeat = f" ({json.dumps(self.separator)} call)*" if parallel else ""
        return f"start: call{repeat}\ncall: {' | '.join(calls)}\n" + "\n".join(rules) + "\n"


def _qwen_parameters(parameters: dict, prefix: str, rules: list[str]) -> str:
    required = set(parameters.get("required", ()))
    parts = []
    for j, (key, schema) in enumerate(parameters.get("properties", {}).items()):
        rule = f"{prefix}{j}"
        rules.extend(_qwen_value(rule, schema))
        part = f"{json.dumps(f'<parameter={key}>' + chr(10))} {rule}"
        parts.append(part if key in required else f"({part})?")
    return " ".join(parts) or '""'


def _qwen_value(rule: str, schema: dict) -> list[str]:
    """Rules of a parameter's value and its closing tag."""
    end = json.dumps("\n</parameter>\n")
    if not qwen3_coder.is_text(schema):
        compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
        return [f"{rule}: {rule}_json {end}", f"{rule}_json: %json {json.dumps(compact)}"]
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [json.dumps(qwen3_coder.value_text(v) + "\n</parameter>\n") for v in values]
        return [f"{rule}: {' | '.join(texts)}"]
    return [f"{rule}[lazy]: Q_TEXT {end}"]


def _one_newline_off(value: str) -> str:
    """A parameter's text without the newline after its open tag and before its close tag."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _glm_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()  # GLM writes strings bare


def _glm_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class Llama3Json(ToolParser):
    """`{"name": ..., "parameters": {...}}` as the whole answer (calls separated by `;`),
    optionally after `<|python_tag|>`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    special_tokens = True
    arguments_key = "parameters"
    separator = "; "
    syntax = '{"name": <function-name>, "parameters": <args-json-object>}'

    def start(self, text: str) -> int:
        if text.lstrip().startswith("{"):
            return len(text) - len(text.lstrip())
        return super().start(text)

    def held(self, text: str) -> int:
        return len(text) if not text.strip() else super().held(text)  # a `{` may come

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ToolCall]]:
        begin = self.start(text)
        if begin < 0:
            return text, []
        at = begin + (len(self.markers[0]) if text.startswith(self.markers[0], begin) else 0)
        calls = []
        while (decoded := _decode(text, at)) and (
            call := _json_call(decoded[0], "parameters", text[at : decoded[1]])
        ):
            rest = text[decoded[1] :].lstrip()
            if not (final or rest.startswith(";")):  # the last call: once the text ends
                break
            calls.append(call)
            at = len(text) - len(rest) + (1 if rest.startswith(";") else 0)
        if not calls:
            return text, []
        return text[:begin] + text[at:].strip(), calls

    def render(self, calls: list[ToolCall]) -> str:
        return self.separator.join(
            json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}) for c in calls
        )


class Mistral(ToolParser):
    """`[TOOL_CALLS]` then a JSON list of calls, or (v11 tokenizers) `name[ARGS]{...}`; each
    `[TOOL_CALLS]` may open more."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_tokens = True
    syntax = '[TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'

    def parse(self, text: str, final: bool = True) -> tuple[str, list[ToolCall]]:
        head, *segments = text.split(self.markers[0])
        content, calls = [head], []
        for segment in segments:
            found, at = self._segment(segment)
            if not found:  # nothing more parses: the rest stays text
                content.append(self.markers[0] + segment)
                continue
            calls += found
            content.append(segment[at:])
        return "".join(content), calls

    def _segment(self, segment: str) -> tuple[list[ToolCall], int]:
        decoded = _decode(segment)
        if decoded and isinstance(decoded[0], list):
            items = _list_items(segment, decoded[1])
            if len(items) != len(decoded[0]):  # not all objects: no call
                return [], 0
            found = [_json_call(v, written=w) for v, w in zip(decoded[0], items, strict=True)]
            return (found, decoded[1]) if found and all(found) else ([], 0)
        name, args, rest = segment.partition("[ARGS]")
        decoded = args and _decode(rest)
        call = decoded and call_of(name.strip(), decoded[0])
        if call:  # the arguments as written (what streaming sent)
            call = ToolCall(call.name, rest[: decoded[1]].strip())
        return ([call], len(name) + len(args) + decoded[1]) if call else ([], 0)

    def pending(self, text: str) -> tuple[int, PartialCall] | None:
        segment = text[text.rfind(self.markers[0]) + len(self.markers[0]) :]
        name, args, rest = segment.partition("[ARGS]")
        if self.start(text) < 0 or not args or not rest.strip().startswith("{"):
            return super().pending(text)
        at = len(rest) - len(rest.lstrip())
        if object_end(rest, at) is not None:  # whole: `parse` reads it
            return None
        return len(self.parse(text)[1]), PartialCall(name.strip(), rest[at:], False)

    def render(self, calls: list[ToolCall]) -> str:
        values = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls]
        return self.markers[0] + json.dumps(values)

    def grammar(self, call_schema: dict, parallel: bool) -> str:
        repeat = ' ("," obj)*' if parallel else ""
        open_ = self.literal(self.markers[0])
        return f'start: {open_} "[" obj{repeat} "]"\n' + _json_rule(call_schema)


def _list_items(text: str, end: int) -> list[str]:
    """The text of each object directly inside the JSON list of `text` that ends at `end`."""
    items, depth, start = [], 0, 0
    for i, c in _brackets(text, 0):
        if i >= end:
            break
        depth += 1 if c in "{[" else -1
        if c == "{" and depth == 2:
            start = i
        elif c == "}" and depth == 1:
            items.append(text[start : i + 1])
    return items


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Hermes, Llama3Json, Mistral, Gemma, Glm45, Glm47, Gemma4, Qwen3Coder)
}

# auto: (where to look, what to find, parser), the first match wins; else hermes, whose syntax
# the prompt then teaches (kestrel.server.tools.prompt)
DETECT = (
    ("vocab", "[TOOL_CALLS]", "mistral"),
    ("template", "<|tool_call>", "gemma4"),
    ("template", "</arg_key><arg_value>", "glm47"),
    ("template", "<arg_key>", "glm45"),
    ("template", "<parameter=", "qwen3_coder"),
    ("vocab", "<|python_tag|>", "llama3_json"),
    ("template", "<tool_call>", "hermes"),
    ("template", "tool_code", "gemma"),
)
DEFAULT_PARSER = "hermes"


def template_text(tokenizer) -> str:
    """The chat template (all of them, where a tokenizer has several by name)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def parser_name(tokenizer, name: str = "auto") -> str:
    if name != "auto":
        return name
    places = {"vocab": tokenizer.get_vocab(), "template": template_text(tokenizer)}
    return next((p for where, what, p in DETECT if what in places[where]), DEFAULT_PARSER)


def choose_parser(tokenizer, name: str = "auto") -> ToolParser:
    """The parser `name` (auto: detected), its markers as tokens where the vocabulary has them
    (special or added, as Qwen's `<tool_call>`): llguidance matches such a token by its id, so a
    grammar must force the token, not its spelling."""
    tokens = {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    tokens.update(_added_tokens(tokenizer))

    def literal(text: str) -> str:
        return f"<[{tokens[text]}]>" if text in tokens else json.dumps(text)

    return PARSERS[parser_name(tokenizer, name)](literal)


def _added_tokens(tokenizer) -> dict[str, int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {t.content: i for i, t in decoder.items()}
