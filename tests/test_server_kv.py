"""Long prompts on gemma3-270m (sliding-window layers): a bounded KV cache with chunked prefill
serves a 2,000-token prompt and a follow-up turn; without a bound the same prompt is a clean 400."""

import pytest

from server_fixtures import start_server, wait_healthy

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m"
KV_BOUND = 256
LONG_PROMPT = " ".join(
    f"Fact {i}: the river number {i} flows into lake {i * 7 % 13}." for i in range(120)
)


@pytest.fixture(scope="module")
def servers():
    """(bounded, unbounded): loaded side by side to overlap the two model loads."""
    bounded = start_server(
        ["-m", MODEL, "--max-kv-size", str(KV_BOUND), "--prefill-chunk-size", "64"], wait=False
    )
    unbounded = start_server(["-m", MODEL, "--ctx-size", "1024"], wait=False)
    try:
        wait_healthy(bounded)
        wait_healthy(unbounded)
        yield bounded, unbounded
    finally:
        bounded.stop()
        unbounded.stop()


def _complete(client, prompt: str):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)


def test_long_prompt_and_follow_up_under_a_kv_bound(servers):
    server, _ = servers
    client = server.client()
    status, tokens = server.post("/tokenize", {"content": LONG_PROMPT})
    assert status == 200 and len(tokens["tokens"]) >= 2000
    before = server.metrics()

    first = _complete(client, LONG_PROMPT)
    assert first.choices[0].text.strip() and first.usage.prompt_tokens >= 2000
    after_first = server.metrics()
    trimmed = (
        after_first["kestrel_kv_trimmed_tokens_total"] - before["kestrel_kv_trimmed_tokens_total"]
    )
    # every token beyond the bound was trimmed (the prompt and all but the last token generated)
    assert trimmed >= first.usage.prompt_tokens + first.usage.completion_tokens - 1 - KV_BOUND

    follow_up = f"{LONG_PROMPT}{first.choices[0].text}\nQuestion: which lake does river 5 flow into?\nAnswer:"
    second = _complete(client, follow_up)
    assert second.choices[0].text.strip() and second.usage.prompt_tokens > first.usage.prompt_tokens
    after = server.metrics()
    assert after["kestrel_kv_trimmed_tokens_total"] > after_first["kestrel_kv_trimmed_tokens_total"]
    assert after["kestrel_kv_tokens_in_use"] == 0 and after["kestrel_running_sequences"] == 0

    # the server keeps answering
    assert _complete(client, "The history of the Roman Empire").choices[0].text
    assert server.get("/health")[0] == 200


def test_per_request_kv_bound_below_the_servers(servers):
    server, _ = servers
    before = server.metrics()["kestrel_kv_trimmed_tokens_total"]
    status, body = server.post(
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": LONG_PROMPT[:1200],
            "max_tokens": 4,
            "temperature": 0,
            "max_kv_size": 64,
        },
    )
    assert status == 200 and body["choices"][0]["text"]
    trimmed = server.metrics()["kestrel_kv_trimmed_tokens_total"] - before
    assert trimmed >= body["usage"]["prompt_tokens"] + 3 - 64


def test_same_prompt_without_a_kv_bound_is_400_context_length_exceeded(servers):
    _, server = servers
    status, body = server.post(
        "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8}
    )
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"]
    metrics = server.metrics()
    assert metrics["kestrel_kv_tokens_in_use"] == 0 and metrics["kestrel_queue_depth"] == 0
    assert server.get("/health")[0] == 200
