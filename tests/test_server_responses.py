"""OpenAI's Responses API (POST /v1/responses) on a real `kestrel serve` (smollm2), through the real
`openai` client: greedy text and usage equal chat completions' for the same messages, streamed
deltas add up to the final response, max_output_tokens marks the response incomplete,
previous_response_id continues a kept conversation, and unsupported or malformed fields are a 400
naming them while the server goes on serving. Images on a tiny qwen2_vl checkpoint."""

import openai
import pytest
from tests.vl_reference import png_data_url, tiny_vl_checkpoint
from tests.vl_suite import MERGE, PATCH

from server_fixtures import shared_server

pytestmark = pytest.mark.slow

INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
FOLLOW_UP = "And what is the capital of Germany?"
MAX = 24


def _chat(client, messages, max_tokens=MAX):
    return client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=max_tokens
    )


def _create(client, **kwargs):
    kwargs.setdefault("max_output_tokens", MAX)
    return client.responses.create(model="smollm2", temperature=0, **kwargs)


def _chat_question() -> list[dict]:
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]


def _input_question() -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]


def test_response_equals_greedy_chat_completion(client):
    chat = _chat(client, _chat_question())
    response = _create(client, instructions=INSTRUCTIONS, input=_input_question())
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.status == (
        "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    [item] = response.output
    assert (item.type, item.role, item.content[0].type) == ("message", "assistant", "output_text")
    # a plain string input is one user message; a developer message is a system one
    plain = _create(client, input=QUESTION)
    assert (
        plain.output_text
        == _chat(client, [{"role": "user", "content": QUESTION}]).choices[0].message.content
    )
    developer = [{"role": "developer", "content": INSTRUCTIONS}, *_input_question()]
    assert _create(client, input=developer).output_text == response.output_text


EVENT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _collapse(types: list[str]) -> list[str]:
    """Event types with runs of deltas collapsed to one."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def test_stream_deltas_add_up_to_the_final_response(client):
    plain = _create(client, instructions=INSTRUCTIONS, input=_input_question())
    with client.responses.stream(
        model="smollm2",
        instructions=INSTRUCTIONS,
        input=_input_question(),
        temperature=0,
        max_output_tokens=MAX,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert "".join(deltas) == final.output_text == plain.output_text
    assert _collapse([e.type for e in events]) == [*EVENT_ORDER, f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.input_tokens == plain.usage.input_tokens
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.id == events[0].response.id != plain.id


def test_max_output_tokens_marks_the_response_incomplete(client):
    response = _create(client, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    chat = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=3)
    assert response.output_text == chat.choices[0].message.content
    events = list(_create(client, input=QUESTION, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == response.output_text


def test_previous_response_id_continues_the_kept_conversation(client):
    first = _create(client, instructions=INSTRUCTIONS, input=QUESTION)
    second = _create(client, input=FOLLOW_UP, previous_response_id=first.id)
    # instructions are not carried over (as OpenAI's); the previous turns are
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": FOLLOW_UP},
    ]
    assert second.output_text == _chat(client, history).choices[0].message.content
    assert second.previous_response_id == first.id
    # a chain: the third turn sees both earlier ones
    third = _create(client, input="Thanks!", previous_response_id=second.id)
    history += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks!"},
    ]
    assert third.output_text == _chat(client, history).choices[0].message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as error:
        _create(client, input=FOLLOW_UP, previous_response_id=first.id)
    assert error.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client):
    response = _create(client, input=QUESTION, store=False, max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        _create(client, input=FOLLOW_UP, previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"


def _user(*content) -> list[dict]:
    return [{"role": "user", "content": list(content)}]


TEXT = {"type": "input_text", "text": QUESTION}

# what is wrong -> (the body's fields, the parameter the error must name)
BAD_BODIES = {
    "input as a number": ({"input": 42}, "input"),
    "no input items": ({"input": []}, "input"),
    "temperature as a string": ({"temperature": "hot"}, "temperature"),
    "max_output_tokens 0": ({"max_output_tokens": 0}, "max_output_tokens"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    # smollm2's template reads no reasoning_effort (tests/test_server_reasoning.py: those that do)
    "reasoning": ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    "an unknown item type": (
        {"input": [*_user(TEXT), {"type": "web_search_call", "id": "ws_1"}]},
        "input[1]",
    ),
    "an input_file part": (
        {"input": _user(TEXT, {"type": "input_file", "file_id": "f1"})},
        "input[0].content[1]",
    ),
    # smollm2 takes no images: the error names the part the client sent, after instructions
    "an image to a text model": (
        {
            "instructions": INSTRUCTIONS,
            "input": _user(TEXT, {"type": "input_image", "image_url": png_data_url(8, 8)}),
        },
        "input[0].content[1]",
    ),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_bad_request_is_400_naming_the_parameter(server, client, case):
    fields, param = BAD_BODIES[case]
    body = {"model": "smollm2", "input": QUESTION, "max_output_tokens": MAX, **fields}
    status, reply = server.post("/v1/responses", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply
    assert reply["error"]["type"] == "invalid_request_error"
    # the same through the client, and the server goes on serving
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**body)
    assert error.value.body["param"] == param
    assert _create(client, input=QUESTION, max_output_tokens=2).usage.output_tokens == 2


# -- images on a model that takes them ----------------------------------------------------------


@pytest.fixture(scope="module")
def vl_client():
    args = ["-m", str(tiny_vl_checkpoint()), "-a", "tiny-vl", "-np", "2"]
    return shared_server(args, ()).client()


def test_input_image_equals_chat_image_url(vl_client):
    side = PATCH * MERGE
    url, text = png_data_url(2 * side, 3 * side, seed=5), "what is this?"
    chat = vl_client.chat.completions.create(
        model="tiny-vl",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        temperature=0,
        max_tokens=8,
    )
    content = [{"type": "input_text", "text": text}, {"type": "input_image", "image_url": url}]
    response = vl_client.responses.create(
        model="tiny-vl",
        input=[{"role": "user", "content": content}],
        temperature=0,
        max_output_tokens=8,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    # the image is read: without it the prompt is shorter
    text_only = vl_client.responses.create(
        model="tiny-vl", input=text, temperature=0, max_output_tokens=1
    )
    assert text_only.usage.input_tokens < response.usage.input_tokens
