"""Tool calls on a real `kestrel serve` (smollm2, whose template knows no tools: kestrel writes them
into the system prompt, Hermes syntax) through the real `openai` client: `required` and a named
`tool_choice` answer with calls whose arguments validate against the tool's parameters
(`jsonschema`), a whole round trip (call, tool result, answer) works, the streamed calls
reassemble to the whole answer's under greedy decoding, and bad tools, choices and tool messages
are a 400 naming the field."""

import json

import jsonschema
import openai
import pytest

from tool_schemas import QUESTION, SCHEMAS, TIME, WEATHER

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME},
    },
]
MAX_TOKENS = 48


def _chat(client, messages=QUESTION, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model="smollm2", messages=messages, **kwargs)


def _valid_calls(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    calls = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_required_choice_answers_with_a_call_that_validates(client):
    choice = _chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert choice.message.content is None
    assert len(_valid_calls(choice)) == 1


def test_named_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _chat(client, tool_choice=named, parallel_tool_calls=False).choices[0]
    [(name, _)] = _valid_calls(choice)
    assert name == "get_time"


def test_streamed_calls_reassemble_to_the_whole_answer(client):
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False}
    whole = _chat(client, **kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in _chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for piece in choice.delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": piece.id, "name": "", "arguments": ""})
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_round_trip_call_result_answer(server, client):
    first = _chat(client, tool_choice="required", parallel_tool_calls=False).choices[0]
    [call] = first.message.tool_calls
    messages = [
        *QUESTION,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = _chat(client, messages, tool_choice="auto").choices[0]
    assert final.message.content or final.message.tool_calls
    assert final.finish_reason in ("stop", "length", "tool_calls")
    # the prompt it answered: the call as the model wrote it, the result as a tool response
    status, body = server.post("/apply-template", {"messages": messages, "tools": TOOLS})
    assert status == 200, body
    arguments = json.loads(call.function.arguments)
    written = json.dumps({"name": call.function.name, "arguments": arguments})
    assert f"<tool_call>\n{written}\n</tool_call>" in body["prompt"]
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in body["prompt"]
    assert '"name": "get_time"' in body["prompt"]  # the tools, in the system prompt


def test_auto_without_a_call_is_plain_content(client):
    plain = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=12
    )
    answer = _chat(client, tool_choice="none", max_tokens=12).choices[0]
    assert answer.message.content == plain.choices[0].message.content.strip()
    assert answer.message.tool_calls is None


BAD = {
    "an unknown function named": (
        {"tool_choice": {"type": "function", "function": {"name": "get_mood"}}},
        "tool_choice",
    ),
    "required without tools": ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    "a named choice without tools": (
        {"tools": None, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
    ),
    "parameters that do not compile": (
        {
            "tools": [
                TOOLS[0],
                {
                    "type": "function",
                    "function": {"name": "bad", "parameters": {"type": "strin"}},
                },
            ]
        },
        "tools[1].function.parameters",
    ),
    "a function named twice": ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    "a bad function name": (
        {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
        "tools[0].function.name",
    ),
    "tools and the deprecated functions together": (
        {"functions": [TOOLS[0]["function"]]},
        "functions",
    ),
    "a function_call naming a function not among the functions": (
        {"tools": None, "functions": [TOOLS[0]["function"]], "function_call": {"name": "get_mood"}},
        "function_call",
    ),
}

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
BAD_MESSAGES = {
    "a tool message without tool_call_id": (
        [{"role": "tool", "content": "12:00"}],
        "messages[2].tool_call_id",
    ),
    "a tool message answering no call": (
        [{"role": "tool", "content": "12:00", "tool_call_id": "call_2"}],
        "messages[2].tool_call_id",
    ),
    "arguments that are not JSON": (
        [
            {
                "role": "assistant",
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}],
            }
        ],
        "messages[1].tool_calls[0].function.arguments",
    ),
    "a call without its function": (
        [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}],
        "messages[1].tool_calls[0].function",
    ),
    "a function message answering no function_call": (
        [{"role": "function", "name": "get_time", "content": "12:00"}],
        "messages[1].name",
    ),
}


@pytest.mark.parametrize(("kwargs", "param"), BAD.values(), ids=BAD.keys())
def test_bad_tools_and_choices_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, **kwargs)
    assert error.value.param == param, error.value.message


@pytest.mark.parametrize(("turns", "param"), BAD_MESSAGES.values(), ids=BAD_MESSAGES.keys())
def test_bad_tool_messages_are_400_naming_the_field(client, turns, param):
    history = [{"role": "assistant", "content": None, "tool_calls": [CALL]}]
    if turns[0]["role"] in ("assistant", "function"):
        history = []
    with pytest.raises(openai.BadRequestError) as error:
        _chat(client, [*QUESTION, *history, *turns], tool_choice="none")
    assert error.value.param == param, error.value.message


# -- the deprecated functions and function_call -------------------------------------------------


def _legacy(client, messages=QUESTION, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, **kwargs}
    functions = [t["function"] for t in TOOLS]
    return client.chat.completions.create(
        model="smollm2", messages=messages, functions=functions, **kwargs
    )


def test_deprecated_functions_answer_with_a_function_call(client):
    choice = _legacy(client, function_call={"name": "get_weather"}).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # streamed: delta.function_call pieces, the name first, the arguments in several pieces
    pieces = [
        c.choices[0].delta.function_call
        for c in _legacy(client, function_call={"name": "get_weather"}, stream=True)
        if c.choices and c.choices[0].delta.function_call
    ]
    assert pieces[0].name == "get_weather" and len(pieces) > 2
    assert "".join(p.arguments or "" for p in pieces) == call.arguments
    # the call and a function message go back: the result of the call of that name
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "function_call": call.model_dump()},
        {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'},
    ]
    final = _legacy(client, messages, function_call="none", max_tokens=8).choices[0]
    assert final.message.content and final.message.function_call is None
