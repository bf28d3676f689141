"""The server under load, each on a private `kestrel serve` process (tiny random-weight model): KV
exhaustion (`--kv-cache-tokens`), backpressure (503 + Retry-After for the overflow only), engine
death with requests in flight, and SIGTERM under load (503 first, in-flight requests finish,
exit 0, no child left). Tests wait for states (/metrics), and size what must be prompt in engine
steps measured on this machine (`step_seconds`), so a busy machine fails none of them."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from server_fixtures import HANG_S, child_pids, start_server, step_seconds, tiny_model, wait_healthy

pytestmark = pytest.mark.slow

LOOP_MARK = "__KILL_THE_LOOP__"


def _args(*extra):
    return ["-m", tiny_model(), "-a", "tiny", "-c", "2048", "-b", "32", *extra]


@pytest.fixture(scope="module")
def servers():
    """Started side by side so their loads overlap: (kv-bounded, backpressure, engine-death)."""
    kv = start_server(_args("-np", "8", "--kv-cache-tokens", "320"), wait=False)
    small = start_server(_args("-np", "2", "--max-queue-depth", "3"), wait=False)
    dying = start_server(
        _args("--no-restart-engine"), [("KESTREL_TEST_FAULTS", f"loop:{LOOP_MARK}")], wait=False
    )
    try:
        for server in (kv, small, dying):
            wait_healthy(server)
        yield kv, small, dying
    finally:
        for server in (kv, small, dying):
            server.stop()


async def _post(client, server, body, path="/v1/completions"):
    started = time.monotonic()
    response = await client.post(server.url + path, json=body)
    return response, time.monotonic() - started


async def _until_running(client, server, count: int, timeout: float) -> None:
    """Until /metrics shows `count` running sequences (admitted: prefilling or decoding)."""

    async def running() -> float:
        lines = (await client.get(server.url + "/metrics")).text.splitlines()
        return next(
            float(n.split()[1]) for n in lines if n.startswith("kestrel_running_sequences ")
        )

    async def poll():
        while await running() != count:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout)


def _gather(server, bodies):
    async def run():
        limits = httpx.Limits(max_connections=len(bodies) + 4)
        async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as client:
            return await asyncio.gather(*(_post(client, server, b) for b in bodies))

    return asyncio.run(run())


# -- 10. KV exhaustion ----------------------------------------------------------------------------


def test_more_work_than_kv_capacity_completes_and_equals_solo_runs(servers):
    server, _, _ = servers
    prompts = [" ".join(f"bird{i}x{j}" for j in range(8 + 6 * i)) for i in range(8)]
    bodies = [
        {"model": "tiny", "prompt": p, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    solo = [_gather(server, [b])[0][0].json()["choices"][0]["text"] for b in bodies]
    before = server.metrics()["kestrel_preemptions_total"]
    replies = _gather(server, bodies)  # ~8 x 100 tokens of KV wanted, 320 held
    assert [r.status_code for r, _ in replies] == [200] * 8
    assert [r.json()["choices"][0]["text"] for r, _ in replies] == solo
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r, _ in replies)
    metrics = server.metrics()
    assert metrics["kestrel_preemptions_total"] > before  # it was over capacity, and recovered
    assert metrics["kestrel_kv_tokens_in_use"] == 0 and metrics["kestrel_queue_depth"] == 0


def test_a_prompt_over_the_kv_capacity_is_400(servers):
    server, _, _ = servers
    status, body = server.post("/v1/completions", {"model": "tiny", "prompt": "word " * 400})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"


# -- 11. backpressure -----------------------------------------------------------------------------


def test_overflow_gets_503_with_retry_after_at_once_and_the_rest_succeed(servers):
    _, server, _ = servers
    step = step_seconds(server, "tiny", batch=2)
    capacity = 2 + 3  # -np 2 --max-queue-depth 3
    body = {"model": "tiny", "prompt": "Tell a story", "max_tokens": 400, "ignore_eos": True}
    replies = _gather(server, [body] * (5 * capacity))
    accepted = [(r, t) for r, t in replies if r.status_code == 200]
    refused = [(r, t) for r, t in replies if r.status_code != 200]
    assert len(accepted) == capacity  # nothing finished before the burst was in
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r, _ in accepted)
    assert {r.status_code for r, _ in refused} == {503}
    assert all(r.headers["retry-after"] == "1" for r, _ in refused)
    assert all(r.json()["error"]["type"] == "service_unavailable" for r, _ in refused)
    latencies = sorted(t for _, t in refused)
    # the median refusal, client-timed: at once, not when a slot frees (400 steps)
    assert latencies[len(latencies) // 2] < max(0.1, 10 * step), (latencies, step)


# -- 9. engine death with requests in flight ------------------------------------------------------


async def _stream_outcome(client, server) -> str:
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": 1500, "ignore_eos": True}
    try:
        async with client.stream(
            "POST", server.url + "/v1/completions", json={**body, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    return "error event"
                if line == "data: [DONE]":
                    return "done"
    except httpx.HTTPError:
        return "closed"
    return "closed"


def test_engine_death_fails_in_flight_requests_turns_503_and_exits_nonzero(servers):
    _, _, server = servers
    # "never a hang": far less than the 1500 steps the streams would run if the death were missed
    prompt = max(10.0, 100 * step_seconds(server, "tiny", batch=4))

    async def run():
        async with httpx.AsyncClient(timeout=prompt) as client:
            streams = [asyncio.create_task(_stream_outcome(client, server)) for _ in range(4)]
            await _until_running(client, server, 4, prompt)  # they are in flight
            poison = {"model": "tiny", "prompt": f"{LOOP_MARK} x", "max_tokens": 4}
            killed = asyncio.create_task(_post(client, server, poison))
            outcomes = await asyncio.gather(*streams)
            return outcomes, killed

    started = time.monotonic()
    outcomes, _ = asyncio.run(run())
    assert set(outcomes) <= {"error event", "closed"}, outcomes  # never a hang, never "done"
    assert time.monotonic() - started < prompt
    assert server.process.wait(prompt) != 0  # a supervisor restarts it
    assert "the engine loop died" in server.log()


# -- 12. graceful shutdown ------------------------------------------------------------------------


def test_sigterm_under_load_drains_then_exits_zero(servers):
    # the drain gets ten times what the in-flight work (6 x 500 tokens) takes on this machine now
    step = step_seconds(servers[0], "tiny", batch=6)
    drain = max(60.0, 10 * 500 * step)
    server = start_server(_args("-np", "6", "--shutdown-timeout", f"{drain:.0f}"))
    children = child_pids(server.process.pid)
    body = {"model": "tiny", "prompt": "Tell a story", "max_tokens": 500, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=drain + 60) as client:
            in_flight = [
                asyncio.create_task(_post(client, server, {**body, "prompt": f"story {i}"}))
                for i in range(6)
            ]
            await _until_running(client, server, 6, drain)
            server.process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            while (health := await client.get(server.url + "/health")).status_code == 200:
                await asyncio.sleep(0.01)
            health_after = time.monotonic() - sent
            assert health.status_code == 503 and health.json()["status"] == "draining"
            late, _ = await _post(client, server, body)  # during the drain: an answer, not refused
            return await asyncio.gather(*in_flight), health_after, late

    finished, health_after, late = asyncio.run(run())
    assert health_after < max(1.0, 10 * step), (health_after, step)
    assert late.status_code == 503 and late.headers["retry-after"]
    assert all(r.status_code == 200 for r, _ in finished)
    assert all(r.json()["usage"]["completion_tokens"] == 500 for r, _ in finished)
    assert server.process.wait(max(30.0, 300 * step)) == 0  # once drained, not at the deadline
    assert "SIGTERM: draining" in server.log()
    assert not any(os.path.exists(f"/proc/{child}") for child in children)
