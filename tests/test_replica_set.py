"""`ReplicaSetClient` over two real engines of a tiny random llama, each in an `EngineActor` run
in this process (what Ray carries across processes, minus Ray: the Ray path itself is
tests/test_server_replicas.py). A dead replica's unstarted requests finish on the other with the
tokens one engine gives, its started ones end with EngineDeadError, it is restarted; an abort
that overtakes its add never runs."""

import asyncio
import os
import time

import pytest
from tests.reference import tiny_llama

from kestrel.config import build_config
from kestrel.engine.client import EngineDeadError, GenerateRequest
from kestrel.engine.engine import Engine
from kestrel.engine.process import EngineInfo
from kestrel.engine.ray_replicas import EngineActor
from kestrel.engine.replicas import ReplicaSetClient
from kestrel.sampling import SamplingParams

PREFIX = [(i * 37) % 5000 + 100 for i in range(12)]  # three 4-token blocks, shared
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


class LocalReplica:
    """The `Replica` transport over an EngineActor in this process; `kill()` ends it as a
    killed actor ends: its pending poll raises, nothing more comes back."""

    def __init__(self, build):
        self.actor = EngineActor(build)
        self.pid = os.getpid()
        self.killed = asyncio.Event()

    async def ready(self) -> EngineInfo:
        return self.actor.info()[0]

    def add(self, requests) -> None:
        self.actor.add(requests)

    def abort(self, request_ids) -> None:
        self.actor.abort(request_ids)

    async def control(self, method, args):
        result, error = await asyncio.to_thread(self.actor.control, method, args)
        if error is not None:
            raise error
        return result

    async def outputs(self):
        poll = asyncio.ensure_future(asyncio.to_thread(self.actor.outputs))
        killed = asyncio.ensure_future(self.killed.wait())
        await asyncio.wait({poll, killed}, return_when=asyncio.FIRST_COMPLETED)
        killed.cancel()
        if self.killed.is_set():
            raise RuntimeError("the replica was killed")
        return [tuple(item[1:]) for item in poll.result()]

    def kill(self) -> None:
        self.killed.set()


def replica_set(model, tokenizer) -> ReplicaSetClient:
    config = build_config(max_num_seqs=1, max_queue_depth=8, prefill_chunk_size=4, block_size=4)

    def spawn(index: int) -> LocalReplica:
        return LocalReplica(lambda: Engine(model, tokenizer, config))

    replicas = [spawn(0), spawn(1)]
    return ReplicaSetClient(replicas, spawn, replicas[0].actor.info()[0], tokenizer)


def offline(model, tokenizer, prompt) -> list[int]:
    engine = Engine(model, tokenizer, build_config(prefill_chunk_size=4))
    engine.add_request("offline", prompt, SHORT)
    ids = []
    while engine.has_unfinished():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    return ids


async def collect(stream) -> tuple[list[int], BaseException | None]:
    ids, error = [], None
    async for output in stream:
        ids += output.new_token_ids
        error = output.error or error
    return ids, error


def test_a_dead_replicas_unstarted_requests_finish_on_the_other(model, smollm2_tokenizer):
    prompts = [PREFIX + [200 + k] for k in range(3)]
    expected = [offline(model, smollm2_tokenizer, p) for p in prompts]

    async def run():
        client = replica_set(model, smollm2_tokenizer)
        await client.start()
        long = await client.add([GenerateRequest("long", PREFIX + [300], LONG)])
        streams = [
            await client.add([GenerateRequest(f"r{k}", p, SHORT)]) for k, p in enumerate(prompts)
        ]
        assert [s.in_flight for s in client.replica_status()] == [4, 0]  # the shared prefix
        first = await anext(aiter(long))  # "long" runs (-np 1); the others wait behind it
        assert first.new_token_ids
        client._slots[0].replica.kill()
        results = [await collect(s) for s in streams]
        long_ids, long_error = await collect(long)
        deadline = time.monotonic() + 60
        while client.replica_status()[0].status != "ok" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        status = client.replica_status()
        client.stop()
        return results, long_error, status

    results, long_error, status = asyncio.run(run())
    assert results == [(ids, None) for ids in expected]
    assert isinstance(long_error, EngineDeadError)
    assert [(s.status, s.restarts) for s in status] == [("ok", 1), ("ok", 0)]
    assert status[1].routed == 3  # the re-sent ones


def test_an_abort_that_overtakes_its_add_never_runs(model, smollm2_tokenizer):
    actor = EngineActor(lambda: Engine(model, smollm2_tokenizer, build_config()))
    intake = actor.info()[0].intake(smollm2_tokenizer)
    actor.abort(["early"])
    actor.add([intake.build("early", PREFIX, SHORT, None, False)])
    actor.add([intake.build("later", PREFIX, SHORT, None, False)])
    finished = set()
    deadline = time.monotonic() + 60
    while "later" not in finished and time.monotonic() < deadline:
        for item in actor.outputs():
            finished |= {o.request_id for o in item[1] if o.finished}
    assert finished == {"later"}
