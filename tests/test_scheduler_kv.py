"""The scheduler under a KV capacity (`--kv-cache-tokens`), with a fabricated model: plain Python.

The fake model's next token is a hash of every key its cache holds (each key a hash of its token
and the keys it saw), so a preempted request that is recomputed from the wrong tokens, in the wrong
order or, under a KV bound, in other chunks samples a different token. Under any
capacity every request must finish with the tokens it gets when it runs alone.
"""

import zlib

import pytest

from kestrel.config import SchedulerConfig
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler


def make_request(i: int, prompt_len: int, max_tokens: int, max_kv_size=None) -> Request:
    prompt = [(7 * i + j) % 50 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, None, max_tokens=max_tokens, max_kv_size=max_kv_size)


class FakeModel:
    """Per-request caches of keys (each a hash of its token and the keys before it); the next
    token hashes the cache (the whole history)."""

    def __init__(self):
        self.caches: dict[str, list[int]] = {}

    def step(self, scheduler: Scheduler) -> int:
        return self.apply(scheduler, scheduler.schedule())

    def apply(self, scheduler: Scheduler, plan) -> int:
        """Run a plan the scheduler made; KV tokens held after it."""
        for request in plan.preempted:
            self.caches.pop(request.request_id, None)
        for chunk in plan.chunks:
            r = chunk.request
            samples = chunk.samples
            cache = self.caches.setdefault(r.request_id, [])
            if r.max_kv_size:  # trim the front before the chunk, as SequenceCache.make_room
                del cache[: max(0, len(cache) + chunk.num_tokens - r.max_kv_size)]
            for token in r.all_ids[r.num_computed : r.num_computed + chunk.num_tokens]:
                # a token's key depends on the keys it sees, as a layer's output does: which
                # keys a trim left visible inside a chunk changes every later key
                cache.append(zlib.crc32(bytes([token, *cache])) % 50)
            r.num_computed += chunk.num_tokens
            if samples:
                r.output_ids.append(zlib.crc32(bytes(cache)) % 50)
                if len(r.output_ids) >= r.max_tokens:
                    r.finish("length")
        for r in scheduler.remove_finished():
            self.caches.pop(r.request_id, None)
        return scheduler.blocks.num_used  # KV tokens held: one-token blocks


def run(requests, **config) -> tuple[dict[str, list[int]], int, int]:
    """Run to the end: (outputs by id, most KV tokens held after a step, preemptions)."""
    scheduler, model = Scheduler(SchedulerConfig(**config)), FakeModel()
    for r in requests:
        scheduler.add(r)
    peak = preemptions = 0
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        before = {r.request_id for r in scheduler.running}
        peak = max(peak, model.step(scheduler))
        preemptions += len(before - {r.request_id for r in scheduler.running} - _done(requests))
    assert not scheduler.has_work(), "the scheduler stalled"
    return {r.request_id: r.output_ids for r in requests}, peak, preemptions


def _done(requests) -> set[str]:
    return {r.request_id for r in requests if r.finished}


def _solo(specs) -> dict[str, list[int]]:
    return {
        f"r{i}": run([make_request(i, *spec)], prefill_chunk_size=8)[0][f"r{i}"]
        for i, spec in enumerate(specs)
    }


SPECS = [(12, 20), (5, 30), (20, 10), (9, 25), (3, 40), (15, 15)]


@pytest.mark.parametrize("capacity", [45, 60, 100, None])
def test_under_any_capacity_all_finish_with_their_solo_output(capacity):
    requests = [make_request(i, *spec) for i, spec in enumerate(SPECS)]
    outputs, peak, preemptions = run(
        requests, max_num_seqs=6, prefill_chunk_size=8, kv_capacity=capacity
    )
    assert outputs == _solo(SPECS)
    if capacity is not None:
        assert peak <= capacity
    if capacity == 45:
        assert preemptions > 0  # the case this test is about actually happened


def test_prefills_that_fill_the_pool_between_them_preempt_rather_than_stall():
    # both prompts admitted by their first chunks, then their partial prompts fill the pool with
    # no decode to preempt for: the newer one makes room for the older
    specs = [(100, 5), (100, 5)]
    requests = [make_request(i, *spec) for i, spec in enumerate(specs)]
    outputs, peak, preemptions = run(
        requests, max_num_seqs=2, prefill_chunk_size=8, kv_capacity=120
    )
    assert outputs == _solo(specs) and peak <= 120
    assert preemptions > 0


def test_kv_bounded_requests_recompute_with_the_same_chunks():
    # KV-bounded (trimming) requests: their output depends on chunk boundaries, which recompute
    # must reproduce; their footprint is at most the bound
    specs = [(4, 24, 12), (6, 20, 12), (5, 22, 12)]  # decodes grow them to the bound
    requests = [make_request(i, *spec) for i, spec in enumerate(specs)]
    outputs, peak, preemptions = run(requests, max_num_seqs=3, prefill_chunk_size=8, kv_capacity=30)
    solo = {
        f"r{i}": run([make_request(i, *s)], prefill_chunk_size=8)[0][f"r{i}"]
        for i, s in enumerate(specs)
    }
    assert outputs == solo and peak <= 30 and preemptions > 0


def test_a_request_waits_until_its_first_chunk_fits():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8, kv_capacity=12))
    s.add(make_request(0, 10, 2))  # 12 tokens at most: each fits alone
    s.add(make_request(1, 10, 2))
    plan = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 8)]
    assert [r.request_id for r in s.running] == ["r0"] and len(s.waiting) == 1


def test_the_newest_running_request_is_preempted_and_queued_first():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=8, kv_capacity=9))
    model = FakeModel()
    s.add(make_request(0, 4, 5))  # 9 tokens at most: each fits alone
    s.add(make_request(1, 4, 5))
    model.step(s)  # both prefilled: 8 tokens held
    model.step(s)  # both decode one: 9 would be 10, so r1 goes
    assert [r.request_id for r in s.running] == ["r0"]
    assert s.waiting[0].request_id == "r1" and s.waiting[0].num_computed == 0
    assert s.waiting[0].output_ids  # kept: recomputed, not sampled again


def test_a_kv_bounded_recompute_feeds_its_prompt_in_its_chunks_then_one_token_at_a_time():
    # under a KV bound the keys a chunk's tokens see depend on its boundaries: a request
    # preempted after decoding 3 tokens is recomputed exactly as it was first computed
    request = make_request(0, 10, 5, max_kv_size=8)
    request.output_ids = [1, 2, 3]
    scheduler = Scheduler(SchedulerConfig(prefill_chunk_size=4))
    scheduler.add(request)
    sizes = []
    while request.num_computed < 13:
        (chunk,) = scheduler.schedule().chunks
        sizes.append(chunk.num_tokens)
        request.num_computed += chunk.num_tokens
    assert sizes == [4, 4, 2, 1, 1, 1]
