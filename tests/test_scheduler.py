"""The scheduler alone: plain Python requests in, a plan out; no model, no torch."""

import subprocess
import sys

import pytest

from kestrel.cache.blocks import KVMemory
from kestrel.config import SchedulerConfig
from kestrel.engine.request import Request
from kestrel.engine.scheduler import QueueFullError, Scheduler


def make_request(i: int, prompt_len: int, max_kv_size=None, keep=0) -> Request:
    return Request(
        f"r{i}", list(range(prompt_len)), None, max_tokens=8, max_kv_size=max_kv_size, keep=keep
    )


def run_step(scheduler: Scheduler):
    """Apply a plan as the engine would: cache the tokens, sample one token where a chunk ends."""
    plan = scheduler.schedule()
    for chunk in plan.chunks:
        samples = chunk.samples
        chunk.request.num_computed += chunk.num_tokens
        if samples:
            chunk.request.output_ids.append(0)
    return plan


def test_scheduler_does_not_import_torch():
    code = "import sys, kestrel.engine.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decodes_go_first_and_prefill_fills_the_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk_size=16))
    s.add(make_request(0, 4))
    run_step(s)  # r0 prefilled, now decoding
    s.add(make_request(1, 100))
    plan = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 1), ("r1", 16)]


def test_long_prefill_does_not_starve_decodes():
    s = Scheduler(SchedulerConfig(max_num_seqs=3, prefill_chunk_size=8))
    for i in range(2):
        s.add(make_request(i, 3))
    run_step(s)
    s.add(make_request(2, 1000))
    for _ in range(10):
        plan = run_step(s)
        ids = [c.request.request_id for c in plan.chunks]
        assert ids[:2] == ["r0", "r1"] and ids[2] == "r2"


def test_at_most_max_num_seqs_and_the_rest_wait():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=64))
    for i in range(5):
        s.add(make_request(i, 4))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 3


def test_queue_is_bounded():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_queue_depth=2))
    s.add(make_request(0, 4))
    s.add(make_request(1, 4))
    with pytest.raises(QueueFullError):
        s.add(make_request(2, 4))


def test_chunks_respect_the_kv_bound():
    s = Scheduler(SchedulerConfig(prefill_chunk_size=512))
    s.add(make_request(0, 2000, max_kv_size=256, keep=4))
    plan = run_step(s)
    assert plan.chunks[0].num_tokens == 252


def test_abort_removes_waiting_and_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=1))
    s.add(make_request(0, 4))
    s.add(make_request(1, 4))
    run_step(s)
    assert s.abort("r1").finish_reason == "abort"
    assert s.abort("r0").finish_reason == "abort"
    assert not s.has_work()


def test_bounded_requests_get_whole_chunks_or_wait():
    # the second bounded prompt would only get a partial chunk: it waits for a whole one instead,
    # so its chunk boundaries (and so its output) do not depend on what else runs
    s = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk_size=16, max_batched_tokens=24))
    s.add(make_request(0, 40, max_kv_size=20, keep=4))
    s.add(make_request(1, 40, max_kv_size=20, keep=4))
    plan = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("r0", 16)]
    sizes = set()
    while s.running and any(r.is_prefilling for r in s.running):
        sizes |= {c.num_tokens for c in run_step(s).chunks if c.request.request_id == "r1"}
    assert sizes <= {16, 8, 1}  # 40 = 16 + 16 + 8, then decodes


def test_a_hybrid_prompt_chunk_ends_where_its_recurrent_state_is_kept():
    """With recurrent layers and prefix caching, a prompt's chunks end at its last full block
    (all but its last token: 12 of 14), where the state is kept for later hits; the next
    request with that prefix starts there."""
    memory = KVMemory(64, 4, prefix_caching=True, state_slots=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8), memory)
    sizes, copies = [], []
    for request in (make_request(0, 14), make_request(1, 20)):
        s.add(request)
        while not request.output_ids:
            plan = s.schedule()
            copies += plan.snapshots  # the runner copies them before the step
            sizes.append([c.num_tokens for c in plan.chunks if c.request is request])
            sampled = [c.request for c in plan.chunks if c.samples]
            s.computed(plan.chunks, set())
            for r in sampled:
                r.output_ids.append(0)
    assert sizes == [[8], [4], [2], [4], [4]]  # r1: from r0's 12 tokens, to its own 16, then 4
    assert request.num_cached_tokens == 12
    snapshots = [snapshot for _, snapshot in copies + s.schedule().snapshots]
    assert len(set(snapshots)) == 2 and min(snapshots) > 4  # one each, past the running slots
    plain = Scheduler(SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8), KVMemory(64, 4))
    plain.add(make_request(2, 14))
    assert [c.num_tokens for c in plain.schedule().chunks] == [8]


def test_no_more_sequences_run_than_there_are_recurrent_state_slots():
    s = Scheduler(SchedulerConfig(max_num_seqs=4), KVMemory(64, 4, state_slots=2))
    for i in range(3):
        s.add(make_request(i, 4))
    run_step(s)
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_every_planned_chunk_carries_its_table_holding_its_positions():
    """The plan is the runner's only view of KV memory: each chunk brings its request's table
    (the manager's own), already trimmed and holding blocks for the chunk's positions, and a
    state slot where the model has recurrent layers."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, prefill_chunk_size=8), KVMemory(64, 4, state_slots=4)
    )
    for i, length in enumerate((14, 3)):
        s.add(make_request(i, length, max_kv_size=10, keep=1))
    for _ in range(6):
        plan = s.schedule()
        for chunk in plan.chunks:
            table, request = chunk.table, chunk.request
            assert table is s.blocks.tables[request.request_id] and table.state_slot
            end = request.num_computed + chunk.num_tokens
            assert table.held[-1][0] == (end - 1) // 4  # the chunk's last position has its block
            assert table.live_tokens(request.num_computed) + chunk.num_tokens <= 10
        s.computed(plan.chunks, set())
        for chunk in plan.chunks:
            if chunk.samples:
                chunk.request.output_ids.append(0)
