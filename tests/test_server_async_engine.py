"""The in-process EngineClient on a tiny random llama: outputs equal the Engine's, admission
control, abort frees the KV before the next step, and a dying loop fails every stream (never
hangs)."""

import asyncio

import pytest
from tests.reference import tiny_llama

from kestrel.config import build_config
from kestrel.engine.client import (
    EngineDeadError,
    GenerateRequest,
    InProcessEngineClient,
    OverloadedError,
)
from kestrel.engine.engine import Engine
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams

PROMPTS = [[(i * 37 + k) % 5000 + 100 for i in range(6 + k)] for k in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def _engine(model, tokenizer, max_num_seqs=2, max_queue_depth=3) -> Engine:
    config = build_config(
        max_num_seqs=max_num_seqs, max_queue_depth=max_queue_depth, prefill_chunk_size=4
    )
    return Engine(model, tokenizer, config)


def _offline(engine: Engine, prompt) -> list[int]:
    engine.add_request("offline", prompt, GREEDY)
    ids = []
    while engine.has_unfinished():
        ids += [t for out in engine.step() for t in out.new_token_ids]
    return ids


async def _tokens(stream) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]


def test_outputs_equal_the_engines_and_capacity_is_enforced(model, smollm2_tokenizer):
    expected = [_offline(_engine(model, smollm2_tokenizer), p) for p in PROMPTS]

    async def run():
        engine = InProcessEngineClient(_engine(model, smollm2_tokenizer))
        await engine.start()
        assert engine.capacity == 3
        with pytest.raises(InvalidRequestError):
            await engine.add([GenerateRequest("empty", [], GREEDY)])
        assert engine.num_unfinished == 0
        streams = [
            await engine.add([GenerateRequest(f"r{i}", p, GREEDY)]) for i, p in enumerate(PROMPTS)
        ]
        with pytest.raises(OverloadedError):
            await engine.add([GenerateRequest("overflow", PROMPTS[0], GREEDY)])
        results = await asyncio.gather(*(_tokens(s) for s in streams))
        assert engine.num_unfinished == 0
        engine.stop()
        return results

    assert asyncio.run(run()) == expected


def test_abort_frees_the_kv_before_the_next_step(model, smollm2_tokenizer):
    async def run():
        engine = InProcessEngineClient(_engine(model, smollm2_tokenizer))
        await engine.start()
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        stream = await engine.add([GenerateRequest("a", PROMPTS[0], long)])
        async for out in stream:
            if out.new_token_ids:
                break
        engine.abort(stream)
        steps = engine.stats.steps
        stats = await engine.call(lambda e: (len(e.scheduler.running), e.runner.kv_tokens_in_use()))
        assert stats == (0, 0)
        assert engine.stats.steps - steps <= 1  # at most the step already under way
        assert engine.stats.finished.get("abort") == 1 and engine.num_unfinished == 0
        engine.stop()

    asyncio.run(run())


def test_a_dying_loop_fails_every_stream_and_refuses_new_requests(model, smollm2_tokenizer):
    deaths = []

    def poison(stage, request):
        if stage == "loop" and request.request_id == "poison":
            raise RuntimeError("loop bug")

    async def run():
        engine = InProcessEngineClient(_engine(model, smollm2_tokenizer, max_queue_depth=4))
        engine.engine.fault_hook = poison
        engine.on_death = deaths.append
        await engine.start()
        slow = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        other = await engine.add([GenerateRequest("other", PROMPTS[0], slow)])
        await engine.add([GenerateRequest("poison", PROMPTS[1], slow)])
        outputs = [out async for out in other]
        assert isinstance(outputs[-1].error, EngineDeadError) and outputs[-1].finished
        with pytest.raises(EngineDeadError):
            await engine.add([GenerateRequest("late", PROMPTS[2], slow)])
        await asyncio.sleep(0)

    asyncio.run(run())
    assert len(deaths) == 1 and "loop bug" in str(deaths[0])
