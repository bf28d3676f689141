"""Earlier tool calls and results of the Responses and Messages APIs into chat messages (no
server): Responses' function_call / function_call_output items and Anthropic's tool_use /
tool_result blocks give the messages chat completions would send (assistant `tool_calls`, `tool`
messages), and a result must answer an earlier call, named by the client's field."""

import pytest

from kestrel.errors import InvalidRequestError
from kestrel.server.routes.messages import MessagesRequest
from kestrel.server.routes.responses import ResponsesRequest, _conversation
from kestrel.server.tools.turns import Turns

QUESTION = {"role": "user", "content": "Weather in Paris and the time?"}
CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    },
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
]
CHAT = [
    QUESTION,
    {"role": "assistant", "content": "Let me look.", "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
]


def _responses(items: list[dict]) -> list[dict]:
    body = ResponsesRequest.model_validate({"model": "m", "input": items})
    return _conversation(body, [])[0]


def _messages(messages: list[dict]) -> list[dict]:
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": messages})
    return body.chat_messages()[0]


def test_responses_items_become_the_chat_messages():
    items = [
        QUESTION,
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ]  # fmt: skip
    assert _responses(items) == CHAT


def test_anthropic_blocks_become_the_chat_messages():
    uses = [
        {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
         "input": c["function"]["arguments"]}
        for c in CALLS
    ]  # fmt: skip
    results = [
        {"type": "tool_result", "tool_use_id": "call_1", "content": "21 C"},
        {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
        {"type": "text", "text": "Thanks."},
    ]  # fmt: skip
    messages = [
        QUESTION,
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, *uses]},
        {"role": "user", "content": results},
    ]
    assert _messages(messages) == [*CHAT, {"role": "user", "content": "Thanks."}]


def test_a_result_must_answer_an_earlier_call():
    with pytest.raises(InvalidRequestError) as error:
        _responses([QUESTION, {"type": "function_call_output", "call_id": "c", "output": "1"}])
    assert error.value.param == "input[1].call_id"
    result = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "1"}
    with pytest.raises(InvalidRequestError) as error:
        _messages([{"role": "user", "content": [result]}])
    assert error.value.param == "messages[0].content[0].tool_use_id"


def test_a_call_id_names_one_call():
    turns = Turns()
    turns.call("call_1", "f", {}, "input[0]", "input[0].call_id")
    with pytest.raises(InvalidRequestError) as error:
        turns.call("call_1", "g", {}, "input[1]", "input[1].call_id")
    assert error.value.param == "input[1].call_id"


def test_a_call_after_a_kept_answer_leaves_the_kept_message_as_it_was():
    kept = {"role": "assistant", "content": "Let me look."}
    turns = Turns([QUESTION, kept], ["previous_response_id"] * 2)
    turns.call("call_1", "get_weather", {"city": "Paris"}, "input[0]", "input[0].call_id")
    assert turns.messages[1] == kept | {"tool_calls": CALLS[:1]}
    assert kept == {"role": "assistant", "content": "Let me look."}
