"""Engine death and shutdown on private server processes: never alive-but-dead, exit codes a
supervisor can act on. (The reliability and overload tests extend these; the hook is the test-only
"loop" fault.)"""

import signal
import time

import pytest

from server_fixtures import start_server, step_seconds, wait_healthy

pytestmark = pytest.mark.slow

LOOP_MARKER = "__KESTREL_FAULT_LOOP__"
ENV = [("KESTREL_TEST_FAULTS", f"loop:{LOOP_MARKER}")]
ARGS = ["-m", "smollm2", "-c", "512"]
NO_RESTART = ["--no-restart-engine"]  # engine restarts: test_server_restart.py


@pytest.fixture(scope="module")
def servers():
    """(stays up when the engine dies, exits when it dies), neither restarting it: loaded side
    by side."""
    staying = start_server([*ARGS, *NO_RESTART, "--no-exit-on-engine-failure"], ENV, wait=False)
    exiting = start_server([*ARGS, *NO_RESTART], ENV, wait=False)
    try:
        wait_healthy(staying)
        wait_healthy(exiting)
        yield staying, exiting
    finally:
        staying.stop()
        exiting.stop()


def _chat(server, text: str, **extra):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }
    return server.post("/v1/chat/completions", body)


def _poll(predicate, timeout: float = 60.0) -> bool:
    """Whether `predicate` came true (polled; the timeout only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_dead_engine_turns_unhealthy_and_refuses_requests(servers):
    server, _ = servers
    assert _chat(server, "Hello")[0] == 200
    step = step_seconds(server, "smollm2")  # seconds per engine step on this machine now
    status, body = _chat(server, f"{LOOP_MARKER} hello")
    assert status == 503 and "engine stopped" in body["error"]["message"]
    assert _poll(lambda: server.get("/health")[0] == 503)
    started = time.monotonic()
    status, body = _chat(server, "Hello")
    assert status == 503 and time.monotonic() - started < max(1.0, 10 * step)  # at once
    assert server.metrics()["kestrel_engine_alive"] == 0
    assert server.process.poll() is None  # --no-exit-on-engine-failure
    # SIGTERM still shuts it down cleanly, with exit code 0
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0


def test_dead_engine_exits_nonzero_by_default(servers):
    _, server = servers
    assert _chat(server, "Hello")[0] == 200
    try:
        assert _chat(server, f"{LOOP_MARKER} hello")[0] == 503
    except OSError:
        pass  # the process may close the connection first: it is exiting
    assert server.process.wait(30) != 0
    assert "the engine loop died" in server.log()
