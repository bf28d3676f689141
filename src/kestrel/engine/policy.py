"""Scheduling policies (vLLM's `--scheduling-policy`): which waiting request is admitted next, and
which running one is preempted when the KV blocks run out. Plain Python.

The scheduler keeps both of its lists in the policy's order and reads only their ends: the head
of `waiting` is admitted next, `running` is planned front to back, and its last request is the
first preempted. A policy is therefore only where a request goes in each list.

- `fcfs`: arrival order. Running requests keep their admission order, so the newest is preempted,
  and a preempted request goes back to the head of the queue.
- `priority`: vLLM's. A lower `priority` runs sooner, equals by arrival; the lowest priority (the
  largest value, the latest among equals) is preempted first, so a request is never preempted to
  make room for one ranked below it. Aging bounds starvation: a request's effective priority
  improves by 1 for every `aging_interval` seconds since it arrived. Every request ages at the
  same rate, so that order is fixed (rank = priority + arrival / interval): a request of
  priority p arriving at time t runs before any request of priority q arriving after
  t + (p - q) * interval.
"""

import bisect
from collections import deque

from kestrel.config import SchedulerConfig
from kestrel.engine.request import Request


class SchedulingPolicy:
    """Where a request goes in the scheduler's `waiting` and `running` lists."""

    name: str

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        """A new request joins the queue."""
        raise NotImplementedError

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request waits again, to be recomputed."""
        raise NotImplementedError

    def admit(self, running: list[Request], request: Request) -> None:
        """A waiting request starts running."""
        raise NotImplementedError


class FcfsPolicy(SchedulingPolicy):
    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        # the newest is preempted first, so older ones preempted after it end up ahead of it
        waiting.appendleft(request)

    def admit(self, running: list[Request], request: Request) -> None:
        running.append(request)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def __init__(self, aging_interval: float | None = None):
        """`aging_interval`: seconds per step of effective priority gained; None: no aging."""
        self.aging_interval = aging_interval

    def rank(self, request: Request) -> tuple[float, float]:
        """Smaller runs sooner: (effective priority, arrival), the effective priority less the
        same `now / aging_interval` for every request."""
        aged = request.arrival_time / self.aging_interval if self.aging_interval else 0.0
        return request.priority + aged, request.arrival_time

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        bisect.insort(waiting, request, key=self.rank)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        bisect.insort(waiting, request, key=self.rank)  # by its rank, as when it arrived

    def admit(self, running: list[Request], request: Request) -> None:
        bisect.insort(running, request, key=self.rank)


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    if config.scheduling_policy == "priority":
        return PriorityPolicy(config.priority_aging_interval)
    return FcfsPolicy()
