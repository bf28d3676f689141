"""Priority scheduling through real `kestrel serve` processes (tiny random-weight model) and the
`openai` client, the priority in `extra_body` as vLLM's clients send it: a high priority overtakes
a full queue of low ones; under KV pressure the lowest priority is preempted (the newest under
fcfs); `priority` on every generation route, and a 400 for a non-zero one under fcfs (vLLM's)."""

import asyncio

import pytest

from server_fixtures import HANG_S, start_server, tiny_model, wait_healthy

pytestmark = pytest.mark.slow

# each request alone fits the pool; two of them at full length (2 x ~160) do not
KV = ("-np", "2", "--kv-cache-tokens", "192", "--block-size", "16")


def _args(*extra):
    return ["-m", tiny_model(), "-a", "tiny", "-c", "2048", "-b", "32", *extra]


@pytest.fixture(scope="module")
def servers():
    """Started side by side so their loads overlap: (one slot under priority, KV-bounded under
    priority, the same under fcfs)."""
    queue = start_server(_args("-np", "1", "--scheduling-policy", "priority"), wait=False)
    kv = start_server(_args(*KV, "--scheduling-policy", "priority"), wait=False)
    fcfs = start_server(_args(*KV), wait=False)
    try:
        for server in (queue, kv, fcfs):
            wait_healthy(server)
        yield queue, kv, fcfs
    finally:
        for server in (queue, kv, fcfs):
            server.stop()


def _prompt(i: int) -> str:
    return " ".join(f"bird{i}x{j}" for j in range(8))


def _completion(client, i: int, max_tokens: int, priority: int | None, **extra):
    body = {"ignore_eos": True, **({} if priority is None else {"priority": priority})}
    return client.completions.create(
        model="tiny",
        prompt=_prompt(i),
        max_tokens=max_tokens,
        temperature=0,
        extra_body=body,
        **extra,
    )


async def _until(server, name: str, value: float) -> None:
    while (await asyncio.to_thread(server.metrics))[name] != value:
        await asyncio.sleep(0.02)


def test_a_high_priority_request_behind_a_full_queue_of_low_ones_finishes_first(servers):
    server, _, _ = servers
    finished = []

    async def timed(name, call):
        await call
        finished.append(name)

    async def scenario():
        async with server.async_client() as client:
            # the one slot is held by a long low-priority stream until the queue is set up
            blocker = await _completion(client, 0, 1500, 10, stream=True)
            await anext(aiter(blocker))
            lows = [
                asyncio.create_task(timed(f"low{i}", _completion(client, i, 16, 10)))
                for i in range(1, 5)
            ]
            await asyncio.wait_for(_until(server, "kestrel_queue_depth", 4), 60)
            chat = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "urgent"}],
                max_tokens=16,
                temperature=0,
                extra_body={"priority": -5, "ignore_eos": True},
            )
            high = asyncio.create_task(timed("high", chat))
            await asyncio.wait_for(_until(server, "kestrel_queue_depth", 5), 60)
            await blocker.close()  # the slot frees: the queue drains in priority order
            await asyncio.gather(high, *lows)

    asyncio.run(scenario())
    assert finished[0] == "high" and sorted(finished[1:]) == [f"low{i}" for i in range(1, 5)]


def _preemption_order(server, priorities: tuple) -> tuple[list[str], dict[str, str]]:
    """A low request ("first") and, once it streams, a high one ("second") that cannot both
    stay in the pool: the order they finish in, and each one's text."""
    finished, texts = [], {}

    async def first(client, started: asyncio.Event):
        stream = await _completion(client, 1, 120, priorities[0], stream=True)
        text = ""
        async for chunk in stream:
            started.set()
            text += chunk.choices[0].text
        finished.append("first")
        texts["first"] = text

    async def second(client, started: asyncio.Event):
        await started.wait()
        texts["second"] = (await _completion(client, 2, 120, priorities[1])).choices[0].text
        finished.append("second")

    async def scenario():
        async with server.async_client() as client:
            started = asyncio.Event()
            await asyncio.gather(first(client, started), second(client, started))

    asyncio.run(scenario())
    return finished, texts


@pytest.mark.parametrize(
    ("which", "priorities", "order"),
    [
        # priority: the older but lower-priority request makes room and finishes last
        ("priority", (10, 0), ["second", "first"]),
        # fcfs: the newest makes room, whatever it asked for
        ("fcfs", (None, None), ["first", "second"]),
    ],
)
def test_kv_pressure_preempts_the_lowest_priority_not_the_newest(servers, which, priorities, order):
    _, kv, fcfs = servers
    server = kv if which == "priority" else fcfs
    client = server.client()
    solo = {
        name: _completion(client, i, 120, priorities[k]).choices[0].text
        for k, (name, i) in enumerate([("first", 1), ("second", 2)])
    }
    before = server.metrics()["kestrel_preemptions_total"]
    finished, texts = _preemption_order(server, priorities)
    assert finished == order
    assert server.metrics()["kestrel_preemptions_total"] > before
    assert texts == solo  # the preempted one was recomputed to the same tokens


ROUTES = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"input": "Hi"},
}


@pytest.mark.parametrize("path", ROUTES)
def test_priority_is_honoured_under_priority_and_a_400_under_fcfs_unless_0(servers, path):
    _, kv, fcfs = servers
    body = {"model": "tiny", **ROUTES[path]}
    assert kv.post(path, {**body, "priority": 3})[0] == 200
    assert fcfs.post(path, {**body, "priority": 0})[0] == 200
    status, error = fcfs.post(path, {**body, "priority": 3})
    assert status == 400 and "--scheduling-policy priority" in str(error)
    if path != "/v1/messages":  # Anthropic's error body names no parameter
        assert error["error"]["param"] == "priority"
    assert kv.post(path, {**body, "priority": "high"})[0] == 400
    assert fcfs.get("/health")[0] == 200  # the server keeps serving


def test_a_bad_aging_interval_is_refused_at_start_naming_its_flag():
    bad = start_server(_args("--priority-aging-interval", "-1"), wait=False)
    assert bad.process.wait(HANG_S) == 1
    assert "--priority-aging-interval: must be a positive number of seconds" in bad.log()
