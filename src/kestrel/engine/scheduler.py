"""Continuous batching: which requests run this step, and how many tokens each. Plain Python.

Each step has a token budget. Running decodes (one token each) go first, so a long prefill never
stalls them; prefill chunks of at most `prefill_chunk_size` fill the rest, so prefills never starve
either (the budget is at least one chunk plus one token per running sequence).
"""

from collections import deque
from dataclasses import dataclass

from kestrel.engine.request import Request, Status


class QueueFullError(Exception):
    """The waiting queue is at `max_queue_depth`; the server answers 503 with Retry-After."""


@dataclass
class SchedulerConfig:
    max_running: int = 8
    prefill_chunk_size: int = 512
    max_queue_depth: int = 64
    max_batched_tokens: int | None = None  # default: one chunk plus one token per running sequence

    @property
    def token_budget(self) -> int:
        return self.max_batched_tokens or self.prefill_chunk_size + self.max_running


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

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_queue_depth:
            raise QueueFullError(f"queue full ({self.config.max_queue_depth} waiting)")
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.token_budget
        chunks = []
        for request in self.running:  # decodes first
            if not request.is_prefilling and budget > 0:
                chunks.append(ScheduledChunk(request, 1))
                budget -= 1
        self._admit()
        for request in self.running:  # then prefill chunks, oldest first
            if request.is_prefilling and budget > 0:
                n = min(request.num_pending, request.max_chunk(self.config.prefill_chunk_size))
                if request.max_kv_size and n > budget:
                    # under a KV bound chunk boundaries decide which keys stay visible: a chunk
                    # cut short by other requests' work would make output depend on the batch
                    continue
                chunks.append(ScheduledChunk(request, min(n, budget)))
                budget -= min(n, budget)
        return SchedulerOutput(chunks)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            request = self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)

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
