"""No silent ignoring, through the real `openai` client against a real `kestrel serve`: a named
field kestrel does not implement is a 400 naming it (at its default it is fine), `model` may be
omitted (the served model answers) but an unknown one is a 404, `client.models.retrieve` works,
and --alias names are listed as `aliases` and accepted."""

import openai
import pytest

from server_fixtures import start_server, tiny_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJRU5ErkJggg=="


# (keyword arguments of chat.completions.create, the param the 400 names)
UNSUPPORTED_CHAT = [
    ({"tool_choice": "required"}, "tool_choice"),  # without tools (test_server_tools.py)
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"store": True}, "store"),
    ({"metadata": {"team": "a"}}, "metadata"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),  # SmolLM2's template reads no such argument
    ({"prediction": {"type": "content", "content": "Paris"}}, "prediction"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    (
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
        "chat_template_kwargs.enable_thinking",
    ),
    ({"stream_options": {"include_obfuscation": True}, "stream": True}, None),
]


@pytest.mark.parametrize(("kwargs", "param"), UNSUPPORTED_CHAT)
def test_unsupported_chat_fields_are_400_naming_them(client, kwargs, param):
    param = param or "stream_options.include_obfuscation"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=4, **kwargs)
    assert error.value.param == param and param in error.value.message


@pytest.mark.parametrize(
    ("message", "param"),
    [
        (
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
            "messages[0].tool_calls[0].function",
        ),
        ({"role": "tool", "content": "42", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        (
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": IMAGE, "detail": "high"}}],
            },
            "messages[0].content[0].image_url.detail",
        ),
    ],
)
def test_unsupported_message_fields_are_400_naming_them(client, message, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="smollm2", messages=[message, *QUESTION])
    assert error.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"suffix": " and that is all."}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"best_of": 2, "n": 3}, "best_of"),
        ({"extra_body": {"min_tokens": 5}}, "min_tokens"),
        ({"echo": True, "logprobs": 2}, "echo"),
    ],
)
def test_unsupported_completion_fields_are_400_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smollm2", prompt="Once upon", max_tokens=4, **kwargs)
    assert error.value.param == param


@pytest.mark.parametrize("echo", [False, True])
def test_prompt_token_ids_outside_the_vocabulary_are_400(client, echo):
    # found by the schema fuzzer: echo decoded a negative id before the engine refused it
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smollm2", prompt=[[1, -271]], max_tokens=1, echo=echo)
    assert "token ids must be in [0, " in error.value.message


def test_fields_at_their_default_values_are_accepted(client):
    """What a client sends when it means "off" is honoured trivially: no 400, same answer."""
    plain = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=12
    )
    defaults = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        store=False,
        service_tier="auto",
        user="someone",
        extra_body={"use_beam_search": False, "future_field_we_do_not_know": 1},
    )
    assert defaults.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(
        model="smollm2", prompt="Once upon", max_tokens=4, temperature=0, suffix="", best_of=1
    )
    assert completion.choices[0].text


def test_best_of_equal_to_n_returns_every_choice(client):
    completion = client.completions.create(
        model="smollm2", prompt="Once upon", max_tokens=6, temperature=0, n=2, best_of=2
    )
    texts = [c.text for c in completion.choices]
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0]


def test_n_above_one_with_greedy_gives_n_equal_choices(client):
    reply = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=10, n=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) == 1


def test_a_request_without_model_is_served_by_the_loaded_model(server, client):
    named = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=10
    )
    status, body = server.post(
        "/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 10}
    )
    assert status == 200, body
    assert body["model"] == "smollm2"
    assert body["choices"][0]["message"]["content"] == named.choices[0].message.content
    status, body = server.post("/v1/completions", {"prompt": "Once upon", "max_tokens": 3})
    assert status == 200 and body["model"] == "smollm2" and body["choices"][0]["text"]


def test_an_unknown_model_is_404_and_retrieve_answers_as_openai(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert missing.value.code == "model_not_found"
    model = client.models.retrieve("smollm2")
    assert (model.id, model.object, model.owned_by) == ("smollm2", "model", "kestrel")
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-9")
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"


def test_alias_names_are_listed_and_accepted():
    model = tiny_model()
    server = start_server(["-m", model, "--alias", "first,second", "-c", "256"])
    try:
        client = server.client()
        [card] = client.models.list().data
        assert card.id == "first"
        assert "second" in card.aliases and model in card.aliases
        assert client.models.retrieve("second").id == "first"
        reply = client.completions.create(model="second", prompt="hi", max_tokens=2)
        assert reply.model == "second"
        status, body = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["model"] == "first"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="third", prompt="hi", max_tokens=2)
    finally:
        server.stop()


def test_alias_flag_spellings_and_environment():
    import argparse

    from kestrel.server.args import add_serve_args, apply_llama_env, served_names

    def names(argv, environ):
        parser = argparse.ArgumentParser()
        add_serve_args(parser)
        apply_llama_env(parser, environ)
        return served_names(parser.parse_args(argv))

    assert names(["-m", "dir/m.gguf"], {}) == ("dir/m.gguf", {"dir/m.gguf", "m.gguf"})
    assert names(["-m", "m.gguf", "--served-model-name", "a, b"], {}) == ("a", {"m.gguf", "b"})
    assert names(["-m", "m.gguf"], {"LLAMA_ARG_ALIAS": "x,y"}) == ("x", {"m.gguf", "y"})
    assert names(["-m", "m.gguf", "-a", "z"], {"LLAMA_ARG_ALIAS": "x"})[0] == "z"
