"""Tool-call parsers on strings: each format's calls and the text around them, whole and streamed
in every chunking tried (the streamed deltas reassemble to the whole answer's parse), rendering
back, the grammars they force (compiled by llguidance, and matching what the parser reads), and the
parser chosen for a tokenizer."""

import json
import random

import llguidance
import pytest
from llguidance import LLMatcher
from tests.llama_cpp_tools import LLAMA_CPP

from kestrel.server.tools.parsers import PARSERS, ToolCall, choose_parser, parser_name
from kestrel.server.tools.stream import CallDelta, ToolStream, visible_content

WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", '{"zone": "UTC+1"}')
NONE_ARGS = ToolCall("ping", "{}")

# (parser, answer, content (None: only whitespace), calls)
CASES = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        None,
        [WEATHER],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        '"{\\"zone\\": \\"UTC+1\\"}"}\n</tool_call>',
        "Let me check.",
        [WEATHER, TIME],
    ),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    (
        "hermes",
        "<tool_call>\nnot json\n</tool_call> ok",
        "<tool_call>\nnot json\n</tool_call> ok",
        [],
    ),
    (  # the answer ended before the close tag: the call is whole all the same
        "hermes",
        '<tool_call>\n{"name": "ping", "arguments": {}}',
        None,
        [NONE_ARGS],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None,
        [WEATHER],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "get_time", "parameters": {"zone": "UTC+1"}}',
        None,
        [WEATHER, TIME],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},'
        ' {"name": "get_time", "arguments": {"zone": "UTC+1"}}]',
        None,
        [WEATHER, TIME],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        "[TOOL_CALLS]ping[ARGS]{}",
        "Sure.",
        [WEATHER, NONE_ARGS],
    ),
    ("mistral", "[TOOL_CALLS] nothing", "[TOOL_CALLS] nothing", []),
    (
        "gemma",
        'I will look.\n```tool_code\nget_weather(city="Paris", unit="celsius")\nget_time(zone='
        '"UTC+1")\n```',
        "I will look.",
        [WEATHER, TIME],
    ),
    (
        "gemma",
        '```tool_code\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n```",
        None,
        [WEATHER],
    ),
    ("gemma", "```tool_code\nprint(1 + 1)\n```", "```tool_code\nprint(1 + 1)\n```", []),
    (
        "glm45",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        '<arg_key>unit</arg_key>\n<arg_value>"celsius"</arg_value>\n</tool_call>'
        "<tool_call>ping\n</tool_call>",
        None,
        [WEATHER, NONE_ARGS],
    ),
    (  # GLM-4.7 writes no newlines, after its thinking
        "glm47",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>unit"
        "</arg_key><arg_value>celsius</arg_value></tool_call><tool_call>ping</tool_call>",
        None,
        [WEATHER, NONE_ARGS],
    ),
    (
        "glm45",
        "Here.<tool_call>get_time<arg_key>zone</arg_key><arg_value>UTC+1</arg_value></tool_call>",
        "Here.",
        [TIME],
    ),
    (
        "gemma4",
        'Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius<|"|>}'
        '<tool_call|><|tool_call>call:get_time{zone:<|"|>UTC+1<|"|>}<tool_call|>',
        "Let me look.",
        [WEATHER, TIME],
    ),
    ("gemma4", "<|tool_call>call:ping{}<tool_call|>", None, [NONE_ARGS]),
    (  # values of every kind, and a string holding the syntax's own characters
        "gemma4",
        '<|tool_call>call:plan{days:3,ratio:-0.5,on:true,off:false,none:null,tags:[<|"|>a, b'
        '<|"|>,2],where:{city:<|"|>{Paris}: "x"<|"|>,zip:75001}}<tool_call|>',
        None,
        [
            ToolCall(
                "plan",
                '{"days": 3, "ratio": -0.5, "on": true, "off": false, "none": null, "tags": '
                '["a, b", 2], "where": {"city": "{Paris}: \\"x\\"", "zip": 75001}}',
            )
        ],
    ),
    (
        "qwen3_coder",
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC+1\n</parameter>\n</function>"
        "\n</tool_call>",
        "I will check.",
        [WEATHER, TIME],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        None,
        [NONE_ARGS],
    ),
    (  # values typed by the tool's schema; a string keeps its lines and its `<`
        "qwen3_coder typed",
        "<tool_call>\n<function=plan>\n<parameter=note>\nline one\n<b>two</b>\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=ratio>\n2.5\n</parameter>\n"
        '<parameter=on>\nTrue\n</parameter>\n<parameter=where>\n{"city": "Paris"}\n'
        '</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n<parameter=code>\n007\n'
        "</parameter>\n</function>\n</tool_call>",
        None,
        [
            ToolCall(
                "plan",
                '{"note": "line one\\n<b>two</b>", "days": 3, "ratio": 2.5, "on": true, "where": '
                '{"city": "Paris"}, "tags": ["a", 1], "code": "007"}',
            )
        ],
    ),
]

# the tool the `typed` cases offer
PLAN = {
    "name": "plan",
    "parameters": {
        "type": "object",
        "properties": {
            "note": {"type": "string"},
            "days": {"type": "integer"},
            "ratio": {"type": "number"},
            "on": {"type": "boolean"},
            "where": {"type": "object"},
            "tags": {"type": "array"},
            "code": {"type": "string"},
            "maybe": {"type": ["string", "null"]},
        },
    },
}


def _parser(name: str):
    """The parser `name`; `NAME typed`: of a request that offers PLAN."""
    parser = PARSERS[name.split()[0]]()
    return parser.for_tools([{"type": "function", "function": PLAN}]) if "typed" in name else parser


def _chunkings(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _stream(parser, chunks: list[str]) -> tuple[str | None, list[ToolCall]]:
    """The streamed content and calls, each call's name and arguments joined from its pieces
    (and checked against its last, whole piece)."""
    stream, content, pieces = ToolStream(parser), "", []
    for chunk in [*chunks, None]:
        text, new = stream.feed(chunk) if chunk is not None else stream.finish()
        content, pieces = content + text, pieces + new
    names = {p.index: p.name for p in pieces if p.name is not None}
    joined = {i: "".join(p.arguments for p in pieces if p.index == i and not p.done) for i in names}
    calls = [ToolCall(names[p.index], p.arguments) for p in pieces if p.done]
    assert [c.arguments for c in calls] == [joined[i] for i in sorted(names)], pieces
    return content or None, calls


# calls that only fail to parse once whole (their streams may have begun a call): text
MALFORMED = [
    (
        "gemma4",
        "<|tool_call>call:get_weather{city Paris}<tool_call|>",
        "<|tool_call>call:get_weather{city Paris}<tool_call|>",
        [],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",
        [],
    ),
]


@pytest.mark.parametrize(("name", "answer", "content", "calls"), CASES + MALFORMED)
def test_parser_reads_calls_and_the_text_around_them(name, answer, content, calls):
    text, found = _parser(name).parse(answer)
    assert (visible_content(text), found) == (content, calls)


@pytest.mark.parametrize(("name", "answer", "content", "calls"), CASES)
def test_streamed_deltas_reassemble_to_the_whole_parse_in_any_chunking(
    name, answer, content, calls
):
    rng = random.Random(answer)
    for chunks in _chunkings(answer, rng):
        assert _stream(_parser(name), chunks) == (content, calls), chunks


def test_content_streams_before_the_calls_are_complete():
    stream = ToolStream(_parser("hermes"))
    assert stream.feed("Let me check the weather ") == ("Let me check the weather", [])
    assert stream.feed("<tool") == ("", [])  # may begin a marker: held
    assert stream.feed('_call>\n{"name": "ping", "arguments": {}}') == (
        "",
        [CallDelta(0, name="ping"), CallDelta(0, "{}")],
    )
    assert stream.feed("\n</tool_call>") == ("", [CallDelta(0, "{}", done=True)])
    assert stream.finish() == ("", [])


ARGUMENTS_PIECES = {  # (parser, the answer up to the call's arguments, what closes the call)
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ', "}"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": ', "}]"),
    "mistral v11": ("[TOOL_CALLS]get_weather[ARGS]", ""),
    "gemma": ('```tool_code\n{"name": "get_weather", "arguments": ', "}\n```"),
}


@pytest.mark.parametrize("case", ARGUMENTS_PIECES)
def test_arguments_stream_as_they_are_written(case):
    head, tail = ARGUMENTS_PIECES[case]
    stream = ToolStream(_parser(case.split()[0]))
    assert stream.feed(head) == ("", [])  # no name before its arguments open
    assert stream.feed('{"city": "Pa') == (
        "",
        [CallDelta(0, name="get_weather"), CallDelta(0, '{"city": "Pa')],
    )
    assert stream.feed('ris", ') == ("", [CallDelta(0, 'ris", ')])
    last = stream.feed('"unit": "celsius"}')[1] + stream.feed(tail)[1] + stream.finish()[1]
    assert last == [CallDelta(0, '"unit": "celsius"}'), CallDelta(0, WEATHER.arguments, done=True)]


# (parser, the answer up to the call's arguments, its pieces, what closes the call): formats whose
# arguments are not JSON stream the JSON they decide, a string's text as it comes
PIECES = {
    "gemma4": (
        "<|tool_call>call:get_weather{",
        ['city:<|"|>Pa', 'ris<|"|>,uni', 't:<|"|>celsius<|"|>', "}"],
        ['"city": "Pa', 'ris", ', '"unit": "celsius"', "}"],
        "<tool_call|>",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n",
        ["<parameter=city>\nPa", "ris\n</param", "eter>\n<parameter=unit>\ncelsius\n"],
        ['"city": "Pa', "ris", '", "unit": "celsius'],
        "</parameter>\n</function>\n</tool_call>",
    ),
}


@pytest.mark.parametrize("name", PIECES)
def test_arguments_of_tagged_values_stream_as_json(name):
    head, chunks, expected, tail = PIECES[name]
    stream = ToolStream(_parser(name))
    assert stream.feed(head) == ("", [CallDelta(0, name="get_weather"), CallDelta(0, "{")])
    for chunk, piece in zip(chunks, expected, strict=True):
        assert stream.feed(chunk) == ("", [CallDelta(0, piece)]), chunk
    *rest, last = stream.feed(tail)[1] + stream.finish()[1]
    assert last == CallDelta(0, WEATHER.arguments, done=True)
    assert "".join(["{", *expected, *(p.arguments for p in rest)]) == WEATHER.arguments


def test_qwen3_coder_holds_a_typed_value_until_it_is_whole():
    stream = ToolStream(_parser("qwen3_coder typed"))
    stream.feed("<tool_call>\n<function=plan>\n<parameter=days>\n1")
    assert stream.feed("2") == ("", [])  # 12, or more digits: not yet
    assert stream.feed("\n</parameter>\n") == ("", [CallDelta(0, "12")])
    assert stream.feed("<parameter=maybe>\nnul") == ("", [CallDelta(0, ', "maybe": ')])
    assert stream.feed("l\n</parameter>\n") == ("", [CallDelta(0, "null")])


@pytest.mark.parametrize(
    ("schema", "text", "value"),
    [
        ({"type": "string"}, "3", "3"),
        ({"type": "string"}, "null", "null"),
        ({"type": ["string", "null"]}, "null", None),
        ({"anyOf": [{"type": "null"}, {"type": "integer"}]}, "7", 7),
        ({"type": "integer"}, "seven", "seven"),
        ({"type": "integer"}, "None", None),
        ({"type": "number"}, "4.0", 4),
        ({"type": "number"}, "nan", "nan"),
        ({"type": "boolean"}, "false", False),
        ({"type": "object"}, "{'a': (1, 2)}", {"a": [1, 2]}),
        ({"type": "array"}, "{1, 2}", "{1, 2}"),
        ({"enum": ["a", "b"]}, "a", "a"),
        (None, "12", "12"),  # a parameter the tool does not declare: its text
    ],
)
def test_qwen3_coder_values_follow_the_tool_schema(schema, text, value):
    parser = PARSERS["qwen3_coder"]()
    parameters = {"type": "object", "properties": {"x": schema} if schema else {}}
    parser = parser.for_tools(
        [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    )
    [call] = parser.parse(
        f"<tool_call>\n<function=f>\n<parameter=x>\n{text}\n</parameter>\n</function>\n</tool_call>"
    )[1]
    assert json.loads(call.arguments) == {"x": value}


def test_gemma4_renders_as_its_template_does():
    call = ToolCall("f", '{"b": [1, "x"], "a": {"z": true, "y": null}, "c": 2.5}')
    rendered = _parser("gemma4").render([call, NONE_ARGS])
    assert rendered == (
        '<|tool_call>call:f{a:{y:null,z:true},b:[1,<|"|>x<|"|>],c:2.5}<tool_call|>'
        "<|tool_call>call:ping{}<tool_call|>"
    )


def test_text_that_only_looked_like_a_marker_is_sent():
    stream = ToolStream(_parser("hermes"))
    assert stream.feed("a <tool") == ("a", [])
    assert stream.feed("box> b") == (" <toolbox> b", [])


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_rendered_calls_parse_back(name):
    parser = _parser(name)
    text, calls = parser.parse(parser.render([WEATHER, TIME]))
    assert (visible_content(text), calls) == (None, [WEATHER, TIME])


def _call_schema(parser) -> dict:
    tools = [
        ("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["celsius", "kelvin"]}}),
        ("get_time", {"zone": {"type": "string"}}),
    ]
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    parser.arguments_key: {
                        "type": "object",
                        "properties": properties,
                        "required": list(properties),
                        "additionalProperties": False,
                    },
                },
                "required": ["name", parser.arguments_key],
                "additionalProperties": False,
            }
            for name, properties in tools
        ]
    }


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("parallel", [False, True])
def test_grammar_compiles_and_accepts_what_the_parser_reads(name, parallel):
    parser = _parser(name)
    grammar = llguidance.grammar_from("lark", parser.grammar(_call_schema(parser), parallel))
    assert LLMatcher.validate_grammar(grammar) == ""
    calls = [WEATHER, TIME] if parallel else [WEATHER]
    answer = _compact_render(parser, calls)
    assert _matches(grammar, answer), answer
    text, found = parser.parse(answer)
    assert (visible_content(text), _loaded(found)) == (None, _loaded(calls))
    assert not _matches(grammar, answer.replace("celsius", "warm"))  # not in the enum
    if not parallel:
        assert not _matches(grammar, _compact_render(parser, [WEATHER, TIME]))


def _loaded(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    # the arguments as written (compact here) and as json.dumps writes them are the same object
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _compact_render(parser, calls: list[ToolCall]) -> str:
    # compact JSON as the grammar forces it; glm45 writes every value as JSON
    text = parser.render(calls)
    if parser.name.startswith("glm"):
        text = text.replace("<arg_value>Paris", '<arg_value>"Paris"')
        text = text.replace("<arg_value>celsius", '<arg_value>"celsius"')
        return text.replace("<arg_value>UTC+1", '<arg_value>"UTC+1"')
    return text.replace(", ", ",").replace(": ", ":")


def _matches(grammar: str, text: str) -> bool:
    """Whether the grammar accepts `text` whole, byte by byte (no tokenizer needed)."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = LLMatcher(tokenizer, grammar)
    ids = list(text.encode())
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and (matcher.is_accepting())
    )


class _ByteTokenizer:
    """One token per byte, plus an EOS: grammars checked on strings."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


class _Tokenizer:
    def __init__(self, vocab: dict, template: str, special: tuple = ()):
        self.vocab, self.chat_template = vocab, template
        self.all_special_tokens = list(special)

    def get_vocab(self):
        return self.vocab

    def convert_tokens_to_ids(self, token):
        return self.vocab[token]


@pytest.mark.parametrize(
    ("vocab", "template", "expected"),
    [
        ({"[TOOL_CALLS]": 5}, "{{ tools }}", "mistral"),
        ({"<|python_tag|>": 7}, "{{ tools }} <|python_tag|>", "llama3_json"),
        ({}, "{% if tools %}<tool_call>{% endif %}", "hermes"),
        ({}, "<tool_call>{{ name }}<arg_key>", "glm45"),
        ({}, "```tool_code", "gemma"),
        ({}, "{{ '<|tool_call>call:' + name }}", "gemma4"),
        ({}, "<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><arg_value>", "glm47"),
        ({}, "<tool_call>\\n<function=' + name + '>\\n<parameter=", "qwen3_coder"),
        ({}, "{{ message['content'] }}", "hermes"),  # no tool syntax: the prompt teaches hermes
    ],
)
def test_parser_is_chosen_from_the_template_and_vocabulary(vocab, template, expected):
    assert parser_name(_Tokenizer(vocab, template)) == expected


def test_a_named_parser_overrides_detection_and_special_markers_become_token_ids():
    tokenizer = _Tokenizer({"[TOOL_CALLS]": 5}, "", special=("[TOOL_CALLS]",))
    assert parser_name(tokenizer, "hermes") == "hermes"
    parser = choose_parser(tokenizer)
    assert parser.name == "mistral"
    assert parser.grammar(_call_schema(parser), False).startswith("start: <[5]>")


TEMPLATES = LLAMA_CPP / "models" / "templates"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("google-gemma-4-31B-it.jinja", "gemma4"),
        ("GLM-4.7-Flash.jinja", "glm47"),
        ("GLM-4.6.jinja", "glm45"),
        ("Qwen3-Coder.jinja", "qwen3_coder"),
        ("Qwen3.5-4B.jinja", "qwen3_coder"),
        ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ],
)
def test_the_published_templates_choose_their_parser(template, expected):
    path = TEMPLATES / template
    if not path.exists():
        pytest.fail(f"llama.cpp's templates are not at {TEMPLATES}: run `make setup`")
    assert parser_name(_Tokenizer({}, path.read_text())) == expected


@pytest.mark.parametrize("name", ["gemma4", "qwen3_coder", "glm47"])
def test_rendered_calls_match_the_published_template(name, smollm2_tokenizer):
    """The parser writes an earlier call as the family's own template renders it."""
    template = {
        "gemma4": "google-gemma-4-31B-it.jinja",
        "qwen3_coder": "Qwen3-Coder.jinja",
        "glm47": "GLM-4.7-Flash.jinja",
    }[name]
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.loads(WEATHER.arguments)},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    text = smollm2_tokenizer.apply_chat_template(
        messages, chat_template=(TEMPLATES / template).read_text(), tokenize=False
    )
    assert _parser(name).render([WEATHER]) in text


def _one_tool_grammar(name: str, parameters: dict) -> str:
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": "f"}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        ]
    }
    grammar = _parser(name).grammar(schema, parallel=False)
    return llguidance.grammar_from("lark", grammar)


TYPED = {
    "type": "object",
    "properties": {
        "b": {"type": "integer", "minimum": 1},
        "a": {"type": "string"},
        "c": {"type": "array", "items": {"type": "boolean"}},
        "d": {"type": "object", "properties": {"y": {"type": "number"}}, "required": ["y"]},
    },
    "required": ["b"],
}


@pytest.mark.parametrize(
    ("answer", "accepted"),
    [
        ("{b:2}", True),
        ('{a:<|"|>x, y<|"|>,b:2,c:[true,false],d:{y:0.5}}', True),
        ("{b:2,c:[]}", True),
        ("{b:0}", False),  # under the minimum
        ("{,b:2}", False),
        ("{b:2,}", False),
        ('{a:<|"|>x<|"|>}', False),  # b is required
        ('{b:2,a:<|"|>x<|"|>}', False),  # the template's order is sorted
        ("{b:2,d:{}}", False),
    ],
)
def test_gemma4_grammar_follows_the_schema_in_the_template_spelling(answer, accepted):
    grammar = _one_tool_grammar("gemma4", TYPED)
    assert _matches(grammar, f"<|tool_call>call:f{answer}<tool_call|>") is accepted


@pytest.mark.parametrize(
    ("parameters", "accepted"),
    [
        ("<parameter=b>\n2\n</parameter>\n", True),
        ("<parameter=b>\n2\n</parameter>\n<parameter=a>\nany\ntext\n</parameter>\n", True),
        ("<parameter=b>\n2\n</parameter>\n<parameter=c>\n[true]\n</parameter>\n", True),
        ("<parameter=b>\ntwo\n</parameter>\n", False),
        ("<parameter=a>\nx\n</parameter>\n", False),
    ],
)
def test_qwen3_coder_grammar_writes_typed_values_as_json(parameters, accepted):
    grammar = _one_tool_grammar("qwen3_coder", TYPED)
    answer = f"<tool_call>\n<function=f>\n{parameters}</function>\n</tool_call>"
    assert _matches(grammar, answer) is accepted
    if accepted:
        parser = _parser("qwen3_coder").for_tools(
            [{"type": "function", "function": {"name": "f", "parameters": TYPED}}]
        )
        assert json.loads(parser.parse(answer)[1][0].arguments)["b"] == 2


GLM_TAGS = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]


@pytest.mark.parametrize(
    ("name", "added"),
    [("hermes", []), ("glm47", GLM_TAGS), ("glm45", GLM_TAGS), ("qwen3_coder", [])],
)
def test_a_grammar_forces_markers_the_vocabulary_added_as_tokens(name, added, smollm2_tokenizer):
    """Qwen's and GLM's tags are added tokens (not special): llguidance matches them by id
    only, so the grammar must name the token, and the model's tokens then satisfy it."""
    import copy

    import llguidance.hf

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", *added])
    parser = choose_parser(tokenizer, name)
    schema = _call_schema(parser)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=eos)
    grammar = llguidance.grammar_from("lark", parser.grammar(schema, False))
    matcher = LLMatcher(lltokenizer, grammar)
    ids = tokenizer.encode(_compact_render(parser, [WEATHER]), add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids
    assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
