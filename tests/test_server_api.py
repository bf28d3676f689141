"""The OpenAI API of a real `kestrel serve` process (smollm2), through the real `openai` client:
text equal to the Python API's, streaming, usage, logprobs, n, stop, errors, auth, CORS."""

import openai
import pytest

from kestrel.sampling import SamplingParams
from server_fixtures import ALLOWED_ORIGIN

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    from kestrel.llm import LLM

    return LLM("smollm2", ctx_size=1024, progress=False)


def test_chat_matches_python_api_streaming_and_not(client, llm):
    expected = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12, logprobs=2))[0]
    out = expected.outputs[0]
    response = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == out.text and out.text
    assert choice.finish_reason == out.finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(out.token_ids)
    assert (
        response.usage.total_tokens
        == response.usage.prompt_tokens + response.usage.completion_tokens
    )
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)], abs=1e-5
    )
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        for c in content
    )
    assert "".join(c.token for c in content).startswith(out.text)

    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [out.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out.token_ids)


def test_completions_match_python_api_streaming_and_not(client, llm):
    prompt = "The history of the Roman Empire"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=10, logprobs=3))[0].outputs[
        0
    ]
    response = client.completions.create(
        model="smollm2", prompt=prompt, temperature=0, max_tokens=10, logprobs=3
    )
    choice = response.choices[0]
    assert choice.text == out.text and choice.finish_reason == "length" == out.finish_reason
    assert response.usage.completion_tokens == 10
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)], abs=1e-5
    )
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    assert choice.logprobs.text_offset[0] == 0

    chunks = list(
        client.completions.create(
            model="smollm2", prompt=prompt, temperature=0, max_tokens=10, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == out.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_seed_and_stop(client):
    kwargs = dict(
        model="smollm2",
        messages=QUESTION,
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=8,
        logprobs=True,
    )
    first, again = (
        client.chat.completions.create(**kwargs),
        client.chat.completions.create(**kwargs),
    )
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
    stopped = client.chat.completions.create(
        model="smollm2", messages=QUESTION, temperature=0, stop=[" is"], max_completion_tokens=12
    )
    assert stopped.choices[0].message.content == "The capital of France"
    assert stopped.choices[0].finish_reason == "stop"


def test_max_tokens_is_clamped_to_the_context(server, client, llm):
    # the server runs with -c 1024: a 1,000-token prompt leaves room for the rest only
    prompt = " ".join(["hello"] * 1000)
    n_prompt = len(llm.tokenizer(prompt)["input_ids"])
    response = client.completions.create(
        model="smollm2",
        prompt=prompt,
        temperature=0,
        max_tokens=500,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.prompt_tokens == n_prompt
    assert response.usage.completion_tokens == 1024 - n_prompt
    assert response.choices[0].finish_reason == "length"


def test_prompt_over_the_context_is_400_context_length_exceeded(server):
    status, body = server.post("/v1/completions", {"model": "smollm2", "prompt": "word " * 2000})
    assert status == 400
    assert (
        body["error"]["code"] == "context_length_exceeded"
        and body["error"]["type"] == "invalid_request_error"
    )


BAD_CHAT_BODIES = [
    (b"{not json", None),
    ({"model": "smollm2"}, "messages"),
    ({"model": "smollm2", "messages": []}, "messages"),
    ({"model": "smollm2", "messages": "hi"}, "messages"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "smollm2", "messages": QUESTION, "temperature": "hot"}, "temperature"),
    ({"model": "smollm2", "messages": QUESTION, "temperature": -0.5}, "temperature"),
    ({"model": "smollm2", "messages": QUESTION, "top_p": 0}, "top_p"),
    ({"model": "smollm2", "messages": QUESTION, "top_p": 1.5}, "top_p"),
    ({"model": "smollm2", "messages": QUESTION, "n": 0}, "n"),
    ({"model": "smollm2", "messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"model": "smollm2", "messages": QUESTION, "max_tokens": "ten"}, "max_tokens"),
    ({"model": "smollm2", "messages": QUESTION, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"model": "smollm2", "messages": QUESTION, "top_logprobs": 3}, "top_logprobs"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT_BODIES)
def test_bad_requests_are_400_naming_the_param(server, body, param):
    status, reply = server.post("/v1/chat/completions", body)
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_errors_parse_in_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert missing.value.code == "model_not_found"


def test_api_key_guards_every_route_but_health(server):
    assert server.get("/health", headers={})[0] == 200
    for path in ("/v1/models", "/metrics", "/openapi.json"):
        assert server.get(path, headers={})[0] == 401
        assert server.get(path, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert server.get(path)[0] == 200
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/completion",
        "/tokenize",
        "/detokenize",
    ):
        assert server.post(path, {}, headers={})[0] == 401
    assert server.get("/v1/models", headers={"X-Api-Key": server.api_key})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_cors_only_for_listed_origins(server):
    import httpx

    def preflight(origin):
        return httpx.options(
            f"{server.url}/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )

    assert preflight(ALLOWED_ORIGIN).headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers
    other = httpx.get(
        f"{server.url}/v1/models", headers={**server.headers(), "Origin": "http://evil.example"}
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_models_and_llama_server_routes(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    status, tokens = server.post("/tokenize", {"content": "Hello world"})
    assert status == 200 and tokens["tokens"]
    status, text = server.post("/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200 and text["content"] == "Hello world"
    prompt = "The history of the Roman Empire"
    status, native = server.post(
        "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0}
    )
    openai_text = (
        client.completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
        .choices[0]
        .text
    )
    assert status == 200 and native["content"] == openai_text
    assert (
        native["stop"] is True
        and native["tokens_predicted"] == 8
        and native["stop_type"] == "limit"
    )


def test_metrics_count_requests_tokens_and_latency(server, client):
    before = server.metrics()
    client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=4)
    after = server.metrics()
    assert after["kestrel_prompt_tokens_total"] > before["kestrel_prompt_tokens_total"]
    assert after["kestrel_generation_tokens_total"] >= before["kestrel_generation_tokens_total"] + 4
    assert (
        after["kestrel_time_to_first_token_seconds_count"]
        == before["kestrel_time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["kestrel_inter_token_latency_seconds_count"]
        >= before["kestrel_inter_token_latency_seconds_count"] + 3
    )
    key = 'kestrel_http_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["kestrel_running_sequences"] == 0 and after["kestrel_queue_depth"] == 0
    assert after["kestrel_kv_tokens_in_use"] == 0
