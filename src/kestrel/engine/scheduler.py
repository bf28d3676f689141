"""Continuous batching: which requests run this step, and how many tokens each. Plain Python.

Each step has a token budget. Running decodes (one token each) go first, so a long prefill never
stalls them; prefill chunks of at most `prefill_chunk_size` fill the rest, so prefills never starve
either (the budget is at least one chunk plus one token per running sequence).

With a KV capacity (`kv_capacity`, tokens summed over running sequences) a waiting request starts
only when its first chunk fits, and when the running decodes outgrow it the newest running
requests are preempted: their caches are dropped (`SchedulerOutput.preempted`, the engine frees
them) and they wait at the front of the queue to be recomputed from their tokens, prompt and
output alike, so they finish with the output they would have had (vLLM's recompute preemption).
"""

from collections import deque
from dataclasses import dataclass, field

from kestrel.config import SchedulerConfig
from kestrel.engine.request import Request, Status


class QueueFullError(Exception):
    """The waiting queue is at `max_queue_depth`; the server answers 503 with Retry-After."""


@dataclass
class ScheduledChunk:
    """Feed `num_tokens` of `request`'s pending tokens; `samples` when they reach its last token."""

    request: Request
    num_tokens: int

    @property
    def samples(self) -> bool:
        return self.num_tokens == self.request.num_pending


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request] = field(default_factory=list)  # free their caches before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preempted = 0  # over the scheduler's life (a metric)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue_depth:
            raise QueueFullError(f"queue full ({self.config.max_queue_depth} waiting)")
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.token_budget
        kv = _KVLedger(self.config.kv_capacity, self.running)
        chunks, preempted = [], []
        for request in list(self.running):  # decodes first, oldest first
            if request.is_prefilling or budget <= 0:
                continue
            if preempted and request.status is Status.WAITING:
                continue  # preempted earlier in this loop, to make room for an older one
            if not self._make_room(kv, request, 1, preempted):
                break  # it was the newest: preempted itself
            chunks.append(ScheduledChunk(request, 1))
            budget -= 1
        for request in self.running:  # then prefill chunks, oldest first
            if request.is_prefilling and budget > 0:
                budget -= self._prefill(kv, request, budget, chunks)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]  # FIFO: starts when its first chunk fits
            first = min(request.num_pending, request.max_chunk(self.config.prefill_chunk_size))
            if request in preempted or kv.fit(request, first) < first:
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            if budget > 0:
                budget -= self._prefill(kv, request, budget, chunks)
        return SchedulerOutput(chunks, preempted)

    def _prefill(self, kv: "_KVLedger", request: Request, budget: int, chunks: list) -> int:
        """Plan the request's next prompt chunk within budget and capacity; tokens planned."""
        n = min(request.num_pending, request.max_chunk(self.config.prefill_chunk_size))
        fit = kv.fit(request, min(n, budget))
        if request.max_kv_size and fit < n:
            # under a KV bound chunk boundaries decide which keys stay visible: a chunk cut
            # short by other requests' work would make output depend on the batch
            return 0
        if fit > 0:
            chunks.append(ScheduledChunk(request, fit))
            kv.grow(request, fit)
        return fit

    def _make_room(self, kv: "_KVLedger", request: Request, n: int, preempted: list) -> bool:
        """Preempt the newest running requests until `request` can grow by n tokens; False if
        `request` itself had to go."""
        while kv.fit(request, n) < n:
            victim = self.running[-1]
            self._preempt(kv, victim, preempted)
            if victim is request:
                return False
        kv.grow(request, n)
        return True

    def _preempt(self, kv: "_KVLedger", request: Request, preempted: list) -> None:
        self.running.remove(request)
        kv.free(request)
        request.num_computed = 0  # recomputed from prompt + output when it runs again
        request.status = Status.WAITING
        self.waiting.appendleft(request)  # newest preempted first, so older ones end up ahead
        preempted.append(request)
        self.num_preempted += 1

    def remove_finished(self) -> list[Request]:
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is; the caller frees its cache."""
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    request.finish("abort")
                    return request
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def kv_tokens(request: Request, computed: int) -> int:
    """KV tokens a request's cache holds once `computed` tokens went in (bounded: trimmed)."""
    return min(computed, request.max_kv_size) if request.max_kv_size else computed


class _KVLedger:
    """This step's KV accounting: tokens held by running requests, plus what planned chunks add."""

    def __init__(self, capacity: int | None, running: list[Request]):
        self.capacity = capacity  # None: nothing to account (every method returns at once)
        self.used = (
            sum(kv_tokens(r, r.num_computed) for r in running) if capacity is not None else 0
        )
        self.planned: dict[str, int] = {}  # request id -> tokens scheduled this step

    def _computed(self, request: Request) -> int:
        return request.num_computed + self.planned.get(request.request_id, 0)

    def _growth(self, request: Request, n: int) -> int:
        done = self._computed(request)
        return kv_tokens(request, done + n) - kv_tokens(request, done)

    def fit(self, request: Request, n: int) -> int:
        """The most of n tokens `request` may add without passing the capacity."""
        if self.capacity is None:
            return n
        free = self.capacity - self.used
        # growth is min(n, room under the bound): if n does not fit, `free` tokens exactly do
        return n if self._growth(request, n) <= free else max(free, 0)

    def grow(self, request: Request, n: int) -> None:
        if self.capacity is None:
            return
        self.used += self._growth(request, n)
        self.planned[request.request_id] = self.planned.get(request.request_id, 0) + n

    def free(self, request: Request) -> None:
        if self.capacity is None:
            return
        self.used -= kv_tokens(request, self._computed(request))
        self.planned.pop(request.request_id, None)
