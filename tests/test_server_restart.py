"""The engine comes back: an engine process killed with SIGKILL under load fails every in-flight
stream with an explicit error at once, the server restarts it (503 on /health meanwhile) and
serves the same greedy text again; past --max-engine-restarts it gives up and exits non-zero."""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from server_fixtures import child_pids, start_server, tiny_model, wait_healthy

pytestmark = pytest.mark.slow

STREAMS = 8


def engine_pid(server) -> int:
    """The server's one child process: its engine."""
    children = child_pids(server.process.pid)
    assert len(children) == 1, children
    return children.pop()


def greedy_text(server) -> str:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    status, reply = server.post("/v1/completions", body)
    assert status == 200, reply
    return reply["choices"][0]["text"]


async def stream_until_end(client, server, started: asyncio.Event, counter: list) -> str:
    """A long stream: sets `started` once all STREAMS have a token; its last event's kind."""
    body = {"model": "tiny", "prompt": "Tell me a story", "max_tokens": 3000, "stream": True}
    body["ignore_eos"] = True
    last, counted = "none", False
    async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            last = "error" if "error" in event else "chunk"
            if last == "chunk" and not counted:
                counted = True
                counter.append(1)
                if len(counter) == STREAMS:
                    started.set()
    return last


def test_killed_engine_fails_streams_restarts_and_gives_up_past_the_limit():
    started = time.monotonic()
    server = start_server(["-m", tiny_model(), "-a", "tiny", "-np", str(STREAMS),
                           "--max-engine-restarts", "1"])  # fmt: skip
    # back within 60 s, or within twice the first start on a machine too busy for that
    restart_bound = max(60.0, 2 * (time.monotonic() - started))
    try:
        before = greedy_text(server)

        async def kill_under_load():
            started, counter = asyncio.Event(), []
            async with httpx.AsyncClient(timeout=120) as client:
                streams = [
                    asyncio.create_task(stream_until_end(client, server, started, counter))
                    for _ in range(STREAMS)
                ]
                await asyncio.wait_for(started.wait(), 120)
                os.kill(engine_pid(server), signal.SIGKILL)
                killed = time.monotonic()
                outcomes = await asyncio.wait_for(asyncio.gather(*streams), 30)
                return outcomes, time.monotonic() - killed

        outcomes, seconds = asyncio.run(kill_under_load())
        assert outcomes == ["error"] * STREAMS and seconds < 5
        assert server.get("/health")[0] == 503  # restarting
        wait_healthy(server, timeout=restart_bound)
        assert greedy_text(server) == before
        os.kill(engine_pid(server), signal.SIGKILL)  # a second death within the window
        assert server.process.wait(60) != 0
        assert "giving up" in server.log()
    finally:
        server.stop()
