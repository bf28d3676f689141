"""Tool-call parsers on strings: each format's calls and the text around them, whole and streamed
in every chunking tried (the streamed deltas reassemble to the whole answer's parse), rendering
back, the grammars they force (compiled by llguidance, and matching what the parser reads), and the
parser chosen for a tokenizer."""

import json
import random

import llguidance
import pytest
from llguidance import LLMatcher

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
]


def _parser(name: str):
    return PARSERS[name]()


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


@pytest.mark.parametrize(("name", "answer", "content", "calls"), CASES)
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
    if parser.name == "glm45":
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
