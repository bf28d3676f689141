"""The scheduling policies (engine/policy.py) through the scheduler alone: plain Python requests with
set priorities and arrival times, fabricated model outputs (test_scheduler_kv's FakeModel)."""

import random

import pytest

from kestrel.config import SchedulerConfig
from kestrel.engine.policy import PriorityPolicy
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler
from kestrel.errors import InvalidRequestError
from test_scheduler_kv import FakeModel


def make_request(i: int, priority: int, arrival: float, prompt_len=4, max_tokens=5) -> Request:
    prompt = [(7 * i + j) % 50 for j in range(prompt_len)]
    return Request(
        f"r{i}", prompt, None, max_tokens, priority=priority, arrival_time=float(arrival)
    )


def scheduler(policy: str, aging=None, **config) -> Scheduler:
    return Scheduler(
        SchedulerConfig(scheduling_policy=policy, priority_aging_interval=aging, **config)
    )


def run(s: Scheduler, steps: int = 10_000, arrive=None) -> list[str]:
    """Step to the end (`arrive(step)` adds requests before each step); the ids in the order
    they first ran."""
    model, started = FakeModel(), []
    for step in range(steps):
        if arrive is not None:
            arrive(step)
        if not s.has_work():
            break
        plan = s.schedule()
        started += [
            c.request.request_id for c in plan.chunks if c.request.request_id not in started
        ]
        model.apply(s, plan)
    return started


# (priority, arrival) of r0..r3: the lowest value first, equals by arrival
QUEUE = [(5, 0), (1, 1), (1, 2), (0, 3)]


def test_priority_admits_the_lowest_value_first_and_equals_by_arrival():
    s = scheduler("priority", max_num_seqs=1, prefill_chunk_size=8)
    for i, (priority, arrival) in enumerate(QUEUE):
        s.add(make_request(i, priority, arrival))
    assert run(s) == ["r3", "r1", "r2", "r0"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    s = scheduler("fcfs", max_num_seqs=1, prefill_chunk_size=8)
    for i, (priority, arrival) in enumerate(QUEUE):
        s.add(make_request(i, priority, arrival))
    assert run(s) == ["r0", "r1", "r2", "r3"]


@pytest.mark.parametrize(
    ("policy", "kept", "preempted"), [("priority", "r1", "r0"), ("fcfs", "r0", "r1")]
)
def test_kv_pressure_preempts_the_lowest_priority_under_priority_and_the_newest_under_fcfs(
    policy, kept, preempted
):
    # r0 (priority 10) runs first, r1 (priority 0) joins a step later; 9 KV tokens hold one of
    # them whole
    s = scheduler(policy, max_num_seqs=2, prefill_chunk_size=8, kv_capacity=9)
    model = FakeModel()
    s.add(make_request(0, 10, 0))
    model.step(s)  # r0 prefilled: 4 tokens held
    s.add(make_request(1, 0, 1))
    model.step(s)  # r0 decodes one, r1 prefilled: 9 held
    model.step(s)  # both decode one: 11 > 9, so one goes
    assert [r.request_id for r in s.running] == [kept]
    assert s.waiting[0].request_id == preempted and s.waiting[0].num_computed == 0


def test_a_preempted_request_waits_by_its_priority():
    s = scheduler("priority", max_num_seqs=2, prefill_chunk_size=8, kv_capacity=9)
    model = FakeModel()
    s.add(make_request(0, 5, 0))
    s.add(make_request(1, 0, 1))
    model.step(s)  # r0 and r1 prefilled
    s.add(make_request(2, 1, 2, prompt_len=8, max_tokens=1))  # its chunk of 8 cannot fit yet
    s.add(make_request(3, 9, 3))
    model.step(s)  # r0 (priority 5) makes room for r1 and waits between r2 (1) and r3 (9)
    assert [r.request_id for r in s.running] == ["r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r0", "r3"]


def test_no_request_is_preempted_for_a_lower_priority_one_and_all_finish_with_their_solo_output():
    rng = random.Random(0)
    specs = [(rng.randrange(4), i, rng.randrange(3, 12), rng.randrange(5, 25)) for i in range(12)]
    requests = [make_request(i, p, t, n, m) for i, (p, t, n, m) in enumerate(specs)]
    s = scheduler("priority", max_num_seqs=4, prefill_chunk_size=8, kv_capacity=48)
    for r in requests:
        s.add(r)
    model, policy, preemptions = FakeModel(), PriorityPolicy(), 0
    while s.has_work():
        plan = s.schedule()
        for victim in plan.preempted:  # everyone still running ranks above it
            assert all(policy.rank(r) < policy.rank(victim) for r in s.running)
        preemptions += len(plan.preempted)
        model.apply(s, plan)
    assert preemptions > 0  # the case this test is about happened
    for r, (_, t, n, m) in zip(requests, specs, strict=True):
        solo = scheduler("fcfs", prefill_chunk_size=8)
        alone = make_request(int(r.request_id[1:]), 0, t, n, m)
        solo.add(alone)
        run(solo)
        assert r.output_ids == alone.output_ids


def _stream(s: Scheduler, low: Request):
    """`low` first, then one priority-0 request a step (each needs several steps), for 60 steps."""

    def arrive(step: int) -> None:
        if step == 0:
            s.add(low)
        if step < 60:
            s.add(make_request(100 + step, 0, step + 1, max_tokens=3))

    return arrive


def test_without_aging_a_stream_of_higher_priorities_starves_a_low_one():
    s = scheduler("priority", max_num_seqs=1, prefill_chunk_size=8, max_queue_depth=1000)
    low = make_request(0, 5, 0)
    started = run(s, 60, _stream(s, low))
    assert "r0" not in started and len(started) > 10


def test_aging_runs_a_low_priority_before_anything_that_arrives_priority_times_interval_later():
    # r0 (priority 5, arrived at 0) against priority-0 requests arriving at 1, 2, 3, ...: with 1
    # second per step of aging, those arriving after 5 rank below it
    s = scheduler("priority", aging=1.0, max_num_seqs=1, prefill_chunk_size=8, max_queue_depth=1000)
    started = run(s, 60, _stream(s, make_request(0, 5, 0)))
    ahead = started[: started.index("r0")]
    assert ahead == ["r100", "r101", "r102", "r103"]  # arrived at 1..4, before 0 + 5 * 1.0


@pytest.mark.parametrize(
    ("settings", "param"),
    [
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"priority_aging_interval": 0}, "priority_aging_interval"),
        ({"priority_aging_interval": -1.0}, "priority_aging_interval"),
    ],
)
def test_bad_scheduler_settings_name_themselves(settings, param):
    with pytest.raises(InvalidRequestError) as error:
        SchedulerConfig(**settings)
    assert error.value.param == param
