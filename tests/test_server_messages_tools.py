"""Tool use on Anthropic's Messages API (POST /v1/messages) on a real `kestrel serve` (smollm2,
calls forced by tool_choice any or tool so that the tiny model's answer is grammar-bound), through
the real `anthropic` client: tool_use blocks whose input validates against input_schema, a round
trip with a tool_result, the stream's tool_use block with its input JSON in pieces, and bad tools,
choices and blocks as a 400 naming the field while the server goes on serving."""

import anthropic
import jsonschema
import pytest

from server_fixtures import API_KEY, HANG_S, shared_server
from tool_schemas import QUESTION, SCHEMAS, TIME, WEATHER

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather of a city",
        "input_schema": WEATHER,
    },
    {"name": "get_time", "description": "The time in a zone", "input_schema": TIME},
]
MAX = 48
GREEDY = {"temperature": 0}  # this SDK sends sampling parameters as extra body fields


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=HANG_S)


def _create(client, messages=QUESTION, **kwargs):
    kwargs = {"max_tokens": MAX, "tools": TOOLS, **kwargs}
    return client.messages.create(model="smollm2", messages=messages, extra_body=GREEDY, **kwargs)


def _forced(name: str | None = None) -> dict:
    choice = {"type": "tool", "name": name} if name else {"type": "any"}
    return {"tool_choice": {**choice, "disable_parallel_tool_use": True}}


def _valid_tool_use(block, name: str | None = None):
    assert block.type == "tool_use" and block.id.startswith("toolu_"), block
    assert name is None or block.name == name
    jsonschema.validate(block.input, SCHEMAS[block.name])
    return block


def test_any_answers_with_a_tool_use_block_that_validates(client):
    message = _create(client, **_forced())
    assert message.stop_reason == "tool_use"
    [block] = message.content  # only the call: no text block beside it
    _valid_tool_use(block)


def test_a_round_trip_tool_use_result_answer(client):
    first = _create(client, **_forced("get_weather"))
    [call] = first.content
    _valid_tool_use(call, "get_weather")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees, sunny"}
    turns = [*QUESTION, {"role": "assistant", "content": first.content}]
    final = _create(client, [*turns, {"role": "user", "content": [result]}], max_tokens=16)
    assert final.content and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the result as text blocks, followed by more of the user's text, is the same kind of turn
    blocks = {**result, "content": [{"type": "text", "text": "21 degrees, sunny"}]}
    more = [blocks, {"type": "text", "text": "Thanks."}]
    again = _create(client, [*turns, {"role": "user", "content": more}], max_tokens=4)
    # the prompt is longer; its prefix came from the cache (Anthropic counts reads apart)
    prompt = lambda usage: usage.input_tokens + usage.cache_read_input_tokens  # noqa: E731
    assert prompt(again.usage) > prompt(final.usage)
    assert again.usage.cache_read_input_tokens > 0


def test_stream_sends_the_input_json_in_pieces(client):
    whole = _create(client, **_forced("get_time"))
    with client.messages.stream(
        model="smollm2",
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=MAX,
        extra_body=GREEDY,
        **_forced("get_time"),
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "content_block_start")
    assert (start.content_block.type, start.content_block.name) == ("tool_use", "get_time")
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 1  # generated piece by piece, not in one delta at the end
    assert [e.type for e in events if e.type.startswith("content_block_s")] == [
        "content_block_start",
        "content_block_stop",
    ]
    [block] = final.content
    _valid_tool_use(block, "get_time")
    assert block.input == whole.content[0].input and final.stop_reason == "tool_use"


def test_choice_none_answers_with_text(client):
    message = _create(client, tool_choice={"type": "none"}, max_tokens=8)
    assert [block.type for block in message.content] == ["text"]


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}


def _result(tool_use_id: str = "toolu_1", **fields) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "12:00", **fields}


def _answered(use: dict, result: dict) -> list[dict]:
    """The question, the assistant's tool_use, the user's tool_result."""
    assistant = {"role": "assistant", "content": [use]}
    return [*QUESTION, assistant, {"role": "user", "content": [result]}]


BAD = {
    "a server tool type": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "tools[0].type",
    ),
    "a named tool not among the tools": (
        {"tool_choice": {"type": "tool", "name": "get_mood"}},
        "tool_choice",
    ),
    "type tool without a name": ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    "any without tools": ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    "an input_schema that does not compile": (
        {"tools": [{"name": "bad", "input_schema": {"type": "strin"}}]},
        "tools[0].input_schema",
    ),
    "a result answering no tool_use": (
        {"messages": _answered(USE, _result("toolu_2"))},
        "messages[2].content[0].tool_use_id",
    ),
    "a result without tool_use_id": (
        {"messages": _answered(USE, {"type": "tool_result", "content": "12:00"})},
        "messages[2].content[0].tool_use_id",
    ),
    "a tool_use without input": (
        {"messages": _answered({k: v for k, v in USE.items() if k != "input"}, _result())},
        "messages[1].content[0].input",
    ),
    "a tool_use in a user message": (
        {"messages": [{"role": "user", "content": [USE]}]},
        "messages[0].content[0]",
    ),
}


@pytest.mark.parametrize(("fields", "param"), BAD.values(), ids=BAD.keys())
def test_bad_tools_and_blocks_are_400_naming_the_field(server, client, fields, param):
    body = {"model": "smollm2", "max_tokens": 2, "messages": QUESTION, "tools": TOOLS, **fields}
    status, reply = server.post("/v1/messages", body, headers={"x-api-key": API_KEY})
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert reply["error"]["message"].startswith(param), reply
    if param == "tools[0].type":
        assert "web_search_20250305" in reply["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # the same through the client
        client.messages.create(model="smollm2", **{k: v for k, v in body.items() if k != "model"})
    assert _create(client, tools=[], max_tokens=2).usage.output_tokens == 2  # still serving
