"""Anthropic's Messages API (POST /v1/messages) on a real `kestrel serve` (smollm2), through the real
`anthropic` client: greedy text and usage equal chat completions' for the same messages, streamed
deltas add up to the final message, stop_sequences and max_tokens give their stop_reason,
x-api-key is checked, and bad input is a 400 in Anthropic's error shape naming the parameter
while the server goes on serving. Images on a tiny qwen2_vl checkpoint."""

import base64

import anthropic
import pytest
from tests.vl_reference import png_data_url, tiny_vl_checkpoint
from tests.vl_suite import MERGE, PATCH

from server_fixtures import API_KEY, HANG_S, shared_server

pytestmark = pytest.mark.slow

SYSTEM = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
MAX = 24
GREEDY = {"temperature": 0}  # this SDK sends sampling parameters as extra body fields


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _anthropic(server, api_key=API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def client(server):
    return _anthropic(server)


@pytest.fixture(scope="module")
def openai_client(server):
    return server.client()


def _chat(openai_client, messages, **kwargs):
    kwargs.setdefault("max_tokens", MAX)
    return openai_client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, **kwargs
    )


def _create(client, **kwargs):
    kwargs.setdefault("max_tokens", MAX)
    kwargs.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return client.messages.create(model="smollm2", extra_body=GREEDY, **kwargs)


def _chat_question() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def _blocks_question() -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}]


def test_message_equals_greedy_chat_completion(client, openai_client):
    chat = _chat(openai_client, _chat_question())
    message = _create(client, system=SYSTEM, messages=_blocks_question())
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content and block.text
    expected = "end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens"
    assert (message.stop_reason, message.stop_sequence) == (expected, None)
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert (message.role, message.model) == ("assistant", "smollm2")
    # system as text blocks, content as a string: the same conversation
    system_blocks = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    again = _create(client, system=system_blocks, messages=[{"role": "user", "content": QUESTION}])
    assert again.content[0].text == block.text


RAW_ORDER = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]


def _raw_types(events) -> list[str]:
    """The raw event types (the SDK adds `text` events), runs of deltas collapsed to one."""
    types = [e.type for e in events if e.type in RAW_ORDER]
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def test_stream_deltas_add_up_to_the_final_message(client):
    plain = _create(client, system=SYSTEM, messages=_blocks_question())
    with client.messages.stream(
        model="smollm2",
        system=SYSTEM,
        messages=_blocks_question(),
        max_tokens=MAX,
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == final.content[0].text == plain.content[0].text
    assert _raw_types(events) == RAW_ORDER
    assert final.stop_reason == plain.stop_reason
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_stream_sends_a_ping(server):
    import httpx

    body = {"model": "smollm2", "max_tokens": 2, "messages": _blocks_question(), "stream": True}
    response = httpx.post(
        f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=HANG_S
    )
    names = [
        line[len("event: ") :] for line in response.text.splitlines() if line.startswith("event: ")
    ]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-1] == "message_stop"


def _stop_word(text: str) -> str:
    """A word in the middle of the answer, with its leading space."""
    words = text.split(" ")
    assert len(words) > 3, text
    return " " + words[len(words) // 2]


def test_stop_sequence_ends_the_answer_before_it(client, openai_client):
    full = _create(client).content[0].text
    stop = _stop_word(full)
    chat = _chat(openai_client, [{"role": "user", "content": QUESTION}], stop=[stop])
    message = _create(client, stop_sequences=["never in the answer", stop])
    assert message.content[0].text == chat.choices[0].message.content == full[: full.index(stop)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(
        model="smollm2",
        max_tokens=MAX,
        messages=[{"role": "user", "content": QUESTION}],
        stop_sequences=[stop],
        extra_body=GREEDY,
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == message.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_max_tokens_gives_stop_reason_max_tokens(client, openai_client):
    message = _create(client, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 3
    chat = _chat(openai_client, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert message.content[0].text == chat.choices[0].message.content


def test_a_missing_or_wrong_key_is_401(server):
    with pytest.raises(anthropic.AuthenticationError):
        _create(_anthropic(server, api_key="wrong-key"), max_tokens=2)
    status, body = server.post(
        "/v1/messages",
        {"model": "smollm2", "max_tokens": 2, "messages": _blocks_question()},
        headers={},
    )
    assert status == 401
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def _image_block() -> dict:
    data = png_data_url(8, 8).split(",", 1)[1]
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def _user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


# what is wrong -> (the body's fields, the parameter the message must name)
BAD_BODIES = {
    "missing max_tokens": ({"max_tokens": None}, "max_tokens"),
    "max_tokens as a string": ({"max_tokens": "10"}, "max_tokens"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "messages as a string": ({"messages": QUESTION}, "messages"),
    "no messages": ({"messages": []}, "messages"),
    "temperature as a string": ({"temperature": "hot"}, "temperature"),
    "thinking": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    "empty stop sequence": ({"stop_sequences": [""]}, "stop_sequences"),
    "an assistant turn last": (
        {
            "messages": [
                *_user({"type": "text", "text": QUESTION}),
                {"role": "assistant", "content": "The"},
            ]
        },
        "messages[1]",
    ),
    "a tool_result answering no tool_use": (
        {"messages": _user({"type": "tool_result", "tool_use_id": "t1", "content": "{}"})},
        "messages[0].content[0].tool_use_id",
    ),
    "an image URL source": (
        {
            "messages": _user(
                {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
            )
        },
        "messages[0].content[0].source.type",
    ),
    "a block whose type is a list": (
        {"messages": _user({"type": ["text"], "text": QUESTION})},
        "messages[0].content[0]",
    ),
    # smollm2 takes no images: the error names the block the client sent
    "an image to a text model": (
        {"system": SYSTEM, "messages": _user({"type": "text", "text": "look"}, _image_block())},
        "messages[0].content[1]",
    ),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_bad_request_is_400_in_anthropic_shape_naming_the_parameter(server, client, case):
    fields, param = BAD_BODIES[case]
    body = {"model": "smollm2", "max_tokens": MAX, "messages": _blocks_question(), **fields}
    body = {key: value for key, value in body.items() if value is not None}
    status, reply = server.post("/v1/messages", body, headers={"x-api-key": API_KEY})
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert param in reply["error"]["message"], reply
    assert _create(client, max_tokens=2).usage.output_tokens == 2  # the server goes on serving


def test_unknown_model_is_404_in_anthropic_shape(client):
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(
            model="claude-nonexistent", max_tokens=2, messages=_blocks_question()
        )
    assert error.value.body["error"]["type"] == "not_found_error"


# -- images on a model that takes them ----------------------------------------------------------


@pytest.fixture(scope="module")
def vl_server():
    return shared_server(["-m", str(tiny_vl_checkpoint()), "-a", "tiny-vl", "-np", "2"], ())


def test_image_block_equals_chat_image_url(vl_server):
    side = PATCH * MERGE
    url, text = png_data_url(2 * side, 3 * side, seed=5), "what is this?"
    chat = vl_server.client().chat.completions.create(
        model="tiny-vl",
        messages=_user(
            {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}
        ),
        temperature=0,
        max_tokens=8,
    )
    data = url.split(",", 1)[1]
    assert base64.b64decode(data)  # the block carries the same PNG bytes
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    message = _anthropic(vl_server, api_key="none").messages.create(
        model="tiny-vl",
        max_tokens=8,
        messages=_user({"type": "text", "text": text}, image),
        extra_body=GREEDY,
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens
