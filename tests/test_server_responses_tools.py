"""Function tools on the Responses API (POST /v1/responses) on a real `kestrel serve` (smollm2,
calls forced by tool_choice so that the tiny model's answer is grammar-bound), through the real
`openai` client: a round trip (function_call item, function_call_output, a text answer), the
same call streamed with its arguments in pieces, and bad tools, choices and items as a 400 naming
the field while the server goes on serving."""

import json

import jsonschema
import openai
import pytest

from tool_schemas import QUESTION, SCHEMAS, TIME, WEATHER

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": WEATHER,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": TIME,
    },
]
MAX = 48


def _create(client, input=QUESTION, **kwargs):
    kwargs = {"temperature": 0, "max_output_tokens": MAX, "tools": TOOLS, **kwargs}
    return client.responses.create(model="smollm2", input=input, **kwargs)


def _forced(name: str | None = None) -> dict:
    choice = {"type": "function", "name": name} if name else "required"
    return {"tool_choice": choice, "parallel_tool_calls": False}


def _valid_call(item, name: str | None = None):
    assert item.type == "function_call" and item.status == "completed", item
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert name is None or item.name == name
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    return item


def test_a_round_trip_call_output_answer(client):
    first = _create(client, **_forced())
    assert first.status == "completed"
    [call] = first.output  # only the call: no message item beside it
    _valid_call(call)
    assert first.tool_choice == "required" and first.parallel_tool_calls is False
    assert [t.name for t in first.tools] == ["get_weather", "get_time"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    final = _create(client, [*QUESTION, call.model_dump(exclude_none=True), result])
    assert final.output_text and final.output[0].type == "message"
    # the same conversation through previous_response_id: the call is kept with the response
    kept = _create(client, [result], previous_response_id=first.id)
    assert kept.output_text == final.output_text


def test_named_choice_calls_that_function(client):
    [call] = _create(client, **_forced("get_time")).output
    _valid_call(call, "get_time")


def test_stream_sends_the_arguments_in_pieces_and_ends_with_the_call(client):
    whole = _create(client, **_forced("get_weather")).output[0]
    with client.responses.stream(
        model="smollm2",
        input=QUESTION,
        tools=TOOLS,
        temperature=0,
        max_output_tokens=MAX,
        **_forced("get_weather"),
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # generated piece by piece, not in one delta at the end
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = final.output
    _valid_call(call, "get_weather")
    assert "".join(deltas) == call.arguments == whole.arguments
    assert events[2].item.call_id == call.call_id and events[2].item.arguments == ""
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_choice_none_answers_with_text(client):
    response = _create(client, tool_choice="none", max_output_tokens=8)
    assert [item.type for item in response.output] == ["message"]


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": "{}"}
BAD = {
    "a hosted tool type": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "a named choice not among the tools": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_mood"}},
        "tool_choice",
    ),
    "required without tools": ({"tool_choice": "required"}, "tool_choice"),
    "parameters that do not compile": (
        {"tools": [{**TOOLS[0], "parameters": {"type": "strin"}}]},
        "tools[0].parameters",
    ),
    "a function offered twice": ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].name"),
    "an output answering no call": (
        {"input": [*QUESTION, {"type": "function_call_output", "call_id": "x", "output": "1"}]},
        "input[1].call_id",
    ),
    "an output without call_id": (
        {"input": [*QUESTION, CALL, {"type": "function_call_output", "output": "1"}]},
        "input[2].call_id",
    ),
    "an output without output": (
        {"input": [*QUESTION, CALL, {"type": "function_call_output", "call_id": "call_1"}]},
        "input[2].output",
    ),
    "call arguments that are not JSON": (
        {"input": [*QUESTION, {**CALL, "arguments": "{"}]},
        "input[1].arguments",
    ),
}


@pytest.mark.parametrize(("fields", "param"), BAD.values(), ids=BAD.keys())
def test_bad_tools_and_items_are_400_naming_the_field(server, client, fields, param):
    body = {"model": "smollm2", "input": QUESTION, "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**body)
    assert error.value.body["param"] == param, error.value.body
    if param == "tools[0].type":
        assert "web_search" in error.value.body["message"]
    assert _create(client, tools=None, max_output_tokens=2).usage.output_tokens == 2
