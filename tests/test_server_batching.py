"""Continuous batching through a real server: concurrent streams equal solo runs, a fault in one
request's forward fails only that request, and a dropped stream is aborted and frees its KV."""

import asyncio
import time

import openai
import pytest

from server_fixtures import FAULT_MARKER, shared_server

pytestmark = pytest.mark.slow

PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def solo(server):
    """Each prompt's temperature-0 text, alone on the server."""
    client = server.client()
    return {p: _create(client, p).choices[0].message.content for p in PROMPTS}


def _create(client, prompt, **kwargs):
    return client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        **kwargs,
    )


async def _stream_text(client, prompt) -> str:
    stream = await client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    return "".join(
        [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    )


async def _concurrently(server, prompts):
    async with server.async_client() as client:
        return await asyncio.gather(
            *(_stream_text(client, p) for p in prompts), return_exceptions=True
        )


def _wait_idle(server, baseline_kv: float, timeout: float = 60.0) -> dict:
    """The metrics once idle (polled; the timeout only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = server.metrics()
        idle = metrics["kestrel_running_sequences"] == 0 and metrics["kestrel_queue_depth"] == 0
        if (
            idle and metrics["kestrel_kv_tokens_in_use"] == baseline_kv
        ) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_eight_concurrent_streams_equal_each_alone(server, solo):
    steps_before = server.metrics()["kestrel_engine_steps_total"]
    texts = asyncio.run(_concurrently(server, PROMPTS))
    assert texts == [solo[p] for p in PROMPTS]
    # batched: far fewer steps than 8 requests run one after another
    assert server.metrics()["kestrel_engine_steps_total"] - steps_before < 4 * (MAX_TOKENS + 1)


def test_forward_fault_fails_only_its_request(server, solo):
    poisoned = f"{FAULT_MARKER} Write one sentence."
    texts = asyncio.run(_concurrently(server, PROMPTS[:7] + [poisoned]))
    assert texts[:7] == [solo[p] for p in PROMPTS[:7]]
    assert isinstance(texts[7], openai.APIError) and "InjectedFault" in texts[7].message
    with pytest.raises(openai.InternalServerError) as failed:
        _create(server.client(), poisoned)
    assert failed.value.code == "internal_error" and failed.value.type == "server_error"
    assert server.get("/health", headers={})[0] == 200
    assert _create(server.client(), PROMPTS[0]).choices[0].message.content == solo[PROMPTS[0]]
    assert "InjectedFault" in server.log() and "failed in the forward" in server.log()


def test_dropped_stream_is_aborted_and_frees_its_kv(server):
    baseline = _wait_idle(server, 0)
    assert baseline["kestrel_kv_tokens_in_use"] == 0
    stream = server.client().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=1000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    assert next(chunks).choices[0].delta.content  # the first token: it is running now
    assert server.metrics()["kestrel_running_sequences"] == 1
    stream.close()  # the client drops the connection
    after = _wait_idle(server, 0)
    assert after["kestrel_running_sequences"] == 0 and after["kestrel_kv_tokens_in_use"] == 0
    aborted = 'kestrel_requests_finished_total{reason="abort"}'
    assert after[aborted] == baseline.get(aborted, 0) + 1
    generated = (
        after["kestrel_generation_tokens_total"] - baseline["kestrel_generation_tokens_total"]
    )
    assert generated < 100  # stopped long before max_tokens


def test_client_timeout_on_a_non_streaming_request_aborts_it(server):
    baseline = _wait_idle(server, 0)
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=1.0).chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Tell me a very long story."}],
            max_tokens=1000,
            extra_body={"ignore_eos": True},
        )
    after = _wait_idle(server, 0)
    assert after["kestrel_running_sequences"] == 0 and after["kestrel_kv_tokens_in_use"] == 0
    aborted = 'kestrel_requests_finished_total{reason="abort"}'
    assert after[aborted] == baseline.get(aborted, 0) + 1
