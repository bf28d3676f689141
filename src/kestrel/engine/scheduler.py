"""Continuous batching: which requests run this step, and how many tokens each. Plain Python.

Each step has a token budget. Running decodes (one token each) go first, so a long prefill never
stalls them; prefill chunks of at most `prefill_chunk_size` fill the rest, so prefills never starve
either (the budget is at least one chunk plus one token per running sequence).

The scheduler owns KV memory: it builds the `BlockManager` (cache/blocks.py) from what the runner
says its memory is (`KVMemory`), and is the only one to write to it. Every chunk takes its blocks
before it is planned, trims and sliding windows included, and carries its request's block table to
the runner (`ScheduledChunk.table`), which only reads it. A waiting request starts only when its
first chunk's blocks are free, and when the running decodes outgrow the pool (or the running
prefills fill it between them, none able to go on) the last running requests in the policy's order
are preempted (under fcfs the newest, under priority the lowest priority: engine/policy.py): their
blocks go back (`SchedulerOutput.preempted`, the runner drops their caches) and they wait in the
queue (fcfs: at its front) to be recomputed from their tokens, prompt and output alike, so they
finish with the output they would have had (vLLM's recompute preemption). A step therefore never runs out of
blocks in the middle of a forward. A request that holds nothing (new, or preempted) starts from the
cached blocks of its longest cached prefix (cache/prefix.py), and each step's full blocks are
cached once the step ran (`computed`); a hybrid's recurrent state is kept at the same points
(`SchedulerOutput.snapshots`, copied by the runner before the step). The paged runner's pool is
the manager's blocks; the reference runner's memory is counted in one-token blocks
(`kv_capacity`, or unlimited).

Speculative decoding (`proposer`: engine/speculative.py's n-grams or engine/draft.py's draft model,
asked once a step for every decode): a decode that may speculate is planned as a chunk of 1 + k
tokens, its pending token then the k proposed ones (`ScheduledChunk.draft`), blocks taken for all
of them. After the step `computed` keeps only the accepted ones: the
rejected tokens' positions go back (blocks holding only them are returned), so nothing of them
stays where later tokens look. A decode speculates only where that is exact: no trim in the step
(a trim for 1 + k tokens would hide keys one token would still see), no recurrent state (it
cannot be rolled back), no grammar, and room in the step's budget and the pool.
"""

from collections import deque
from dataclasses import dataclass, field

from kestrel.cache.blocks import BlockManager, BlockTable, KVMemory, tokens_to_trim
from kestrel.config import SchedulerConfig
from kestrel.engine.policy import make_policy
from kestrel.engine.request import Request, Status
from kestrel.errors import InvalidRequestError


class QueueFullError(Exception):
    """The waiting queue is at `max_queue_depth`; the server answers 503 with Retry-After."""


@dataclass
class ScheduledChunk:
    """Feed `num_tokens` of `request`'s pending tokens; `completes` when they reach its last token,
    and then a generation request `samples` (an embedding request gets its vector instead)."""

    request: Request
    num_tokens: int
    draft: list[int] = field(default_factory=list)  # proposed tokens fed after the pending one
    # the request's blocks, already holding the chunk's positions (the runner reads it)
    table: BlockTable | None = None

    @property
    def completes(self) -> bool:
        return self.num_tokens - len(self.draft) == self.request.num_pending

    @property
    def samples(self) -> bool:
        return self.completes and self.request.pooling is None


@dataclass
class SchedulerOutput:
    """One step's plan, the scheduler's whole contract with the runner."""

    chunks: list[ScheduledChunk]
    preempted: list[Request] = field(default_factory=list)  # free their caches before the step
    # (state slot, snapshot slot): recurrent states to copy before the step (prefix caching)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    # the host tier's block copies (evicted blocks out, hits back in), in order, before the step
    host_copies: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: KVMemory | None = None):
        """`memory`: the runner's KV memory (`runner.kv_memory`); by default `kv_capacity`
        one-token blocks."""
        self.config = config
        self.blocks = BlockManager.of(memory or KVMemory(config.kv_capacity))
        self.policy = make_policy(config)
        # both in the policy's order: waiting[0] is admitted next, running[-1] preempted first
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preempted = 0  # over the scheduler's life (a metric)
        self.proposer = None  # speculative decoding's (engine/speculative.py); None: off
        self.max_adapters: int | None = None  # LoRA slots (--max-loras); None: no adapters
        self.num_draft_tokens = self.num_accepted_tokens = 0  # over its life (metrics)

    def add(self, request: Request) -> None:
        """Queue a request; InvalidRequestError if it could not fit the KV memory even alone."""
        total = len(request.prompt_ids) + request.max_tokens
        peak = self.blocks.peak_blocks(total, request.max_kv_size, request.keep)
        if not self.blocks.fits_alone(peak):
            raise InvalidRequestError(
                f"the request needs up to {peak * self.blocks.block_size} KV tokens; the KV "
                f"cache holds {self.blocks.token_capacity} (lower max_tokens or the prompt)",
                param="max_tokens",
            )
        if len(self.waiting) >= self.config.max_queue_depth:
            raise QueueFullError(f"queue full ({self.config.max_queue_depth} waiting)")
        self.policy.enqueue(self.waiting, request)

    def adopt(self, request_id: str, logical: list[int]) -> BlockTable:
        """A free block for each of a handed-over sequence's `logical` blocks (disaggregated
        decode: its KV arrives from another engine); KVPoolExhaustedError, nothing taken, when
        the pool has too few."""
        table = self.blocks.table(request_id)
        try:
            table.held = tuple((lg, self.blocks.allocate()) for lg in logical)
        except Exception:
            self.blocks.release(request_id)
            raise
        return table

    def schedule(self) -> SchedulerOutput:
        budget = self.config.token_budget
        kv = _KVPlan(self.blocks)
        chunks, preempted = [], []
        drafts = self._propose_all()
        for request in list(self.running):  # decodes first, in the policy's order
            if request.is_prefilling or budget <= 0:
                continue
            if preempted and request.status is Status.WAITING:
                continue  # preempted earlier in this loop, to make room for an older one
            draft = self._fit_draft(kv, request, drafts.get(request.request_id, []), budget)
            if not self._make_room(kv, request, 1 + len(draft), preempted):
                break  # it was the last: preempted itself
            chunks.append(ScheduledChunk(request, 1 + len(draft), draft))
            budget -= 1 + len(draft)
        for request in self.running:  # then prefill chunks, in the same order
            if request.is_prefilling and budget > 0:
                budget -= self._prefill(kv, request, budget, chunks)
        if not chunks and self.running:
            budget -= self._unstall(kv, budget, chunks, preempted)
        most = min(self.config.max_num_seqs, self.blocks.max_sequences or self.config.max_num_seqs)
        while self.waiting and len(self.running) < most:
            request = self.waiting[0]  # the policy's next: starts when its first chunk fits
            if request in preempted or not self._adapter_fits(request):
                break
            self._reuse_prefix(request)
            first = self._chunk(request)
            if kv.fit(request, first) < first:
                kv.free(request)
                request.num_computed = 0
                break
            self._count_prefix(request)
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.policy.admit(self.running, request)
            if budget > 0:
                budget -= self._prefill(kv, request, budget, chunks)
        for chunk in chunks:
            chunk.table = self.blocks.tables[chunk.request.request_id]
        blocks = self.blocks
        return SchedulerOutput(chunks, preempted, blocks.take_snapshots(), blocks.take_copies())

    def _adapter_fits(self, request: Request) -> bool:
        """Whether a LoRA slot is left for the request's adapter: at most `max_adapters`
        distinct adapters run at once (the device's slots)."""
        if not request.lora_key or self.max_adapters is None:
            return True
        running = {r.lora_key for r in self.running if r.lora_key}
        return request.lora_key in running or len(running) < self.max_adapters

    def _propose_all(self) -> dict[str, list[int]]:
        """Per request id, the tokens each running decode that may speculate would feed after
        its pending one, never past max_tokens (one call: a draft model proposes for all of them
        in the same forwards)."""
        if self.proposer is None:
            return {}
        todo = [r for r in self.running if not r.is_prefilling and self._may_speculate(r)]
        most = [r.max_tokens - len(r.output_ids) - 1 for r in todo]
        drafts = self.proposer.propose_all(todo, most)
        return {r.request_id: draft for r, draft in zip(todo, drafts, strict=True) if draft}

    def _fit_draft(self, kv: "_KVPlan", request: Request, draft: list[int], budget: int):
        """The part of `draft` the step feeds: within its budget, and only where verifying it
        is exact and it fits the pool now ([]: a plain decode)."""
        draft = draft[: budget - 1]
        # speculation never preempts: it leaves a block for each running sequence's next token
        if draft and not self.blocks.fits(kv.needed(request, 1 + len(draft)) + len(self.running)):
            return []
        if draft and request.max_kv_size:
            live = self.blocks.table(request.request_id).live_tokens(request.num_computed)
            if tokens_to_trim(live, 1 + len(draft), request.max_kv_size, request.keep):
                return []  # a trim for 1 + k tokens would hide keys one token still sees
        return draft

    def _may_speculate(self, request: Request) -> bool:
        limit = self.blocks.prefix_tokens  # past it, keys depend on the chunks (LongRoPE)
        return (
            not self.blocks.state_slots  # recurrent state cannot be rolled back
            and request.params.structured_output is None  # grammars advance token by token
            and request.multimodal is None
            and (limit is None or len(request.all_ids) + self.proposer.k <= limit)
        )

    def _reuse_prefix(self, request: Request) -> None:
        """Start a request that holds nothing from the cached blocks of its longest cached
        prefix (a new request, or a preempted one being recomputed)."""
        if request.num_computed or not request.cache_prompt:
            return
        limit, images = request.prefix_limit(), request.image_keys
        hit = self.blocks.lookup(request.all_ids, limit, images, request.lora_key)
        if hit.tokens:
            self.blocks.attach(self.blocks.table(request.request_id), hit)
            request.num_computed = hit.tokens
        if request.num_cached_tokens is None:  # a retried admission finds them on the device
            host = len(hit.from_host) * self.blocks.block_size
            request.num_host_cached_tokens = max(request.num_host_cached_tokens, host)

    def _count_prefix(self, request: Request) -> None:
        """A request starts: its prompt's lookup and hit go to the metrics (the first time)."""
        if request.num_cached_tokens is not None:
            return
        request.num_cached_tokens = min(request.num_computed, len(request.prompt_ids))
        prefix = self.blocks.prefix
        if prefix is not None and request.cache_prompt:
            prefix.queried_tokens += len(request.prompt_ids)
            prefix.hit_tokens += request.num_cached_tokens
        if self.blocks.host is not None:
            host = min(request.num_host_cached_tokens, request.num_cached_tokens)
            self.blocks.host.hit_tokens += host

    def computed(
        self, chunks: list[ScheduledChunk], failed: set[str], accepted: dict[str, int] | None = None
    ) -> None:
        """The step ran: each chunk's tokens are in its cache, and the blocks they filled are
        cached for later prompts (not those of chunks that failed: their keys were undone).
        `accepted`: per request id, how many of its chunk's draft tokens were accepted; the
        rest are rolled back (a chunk with a draft missing from it: none accepted)."""
        for chunk in chunks:
            request = chunk.request
            kept = self._keep_accepted(chunk, (accepted or {}).get(request.request_id, 0))
            request.num_computed += chunk.num_tokens - len(chunk.draft) + len(kept)
            table = self.blocks.tables.get(request.request_id)
            if table is not None and chunk.draft:
                table.truncate(request.num_computed)
            if table is not None and request.request_id not in failed:
                self.blocks.publish(
                    table,
                    request.num_computed,
                    request.prompt_ids,
                    request.output_ids + kept,  # the accepted tokens join the output after
                    request.image_keys,
                    snapshot=request.num_computed == self._snapshot_at(request),
                    root=request.lora_key,
                )

    def _keep_accepted(self, chunk: ScheduledChunk, accepted: int) -> list[int]:
        """The chunk's accepted draft tokens, counted in its request's speculation totals."""
        if chunk.draft:
            chunk.request.num_draft_tokens += len(chunk.draft)
            chunk.request.num_accepted_tokens += accepted
            self.num_draft_tokens += len(chunk.draft)
            self.num_accepted_tokens += accepted
        return chunk.draft[:accepted]

    def _chunk(self, request: Request) -> int:
        """The request's next prefill chunk; it ends where its recurrent state is to be
        snapshotted when it would cross that point."""
        n = min(request.num_pending, request.max_chunk(self.config.prefill_chunk_size))
        at = self._snapshot_at(request)
        if request.num_computed < at < request.num_computed + n:
            return at - request.num_computed
        return n

    def _snapshot_at(self, request: Request) -> int:
        """Where a hybrid model's request keeps its recurrent state for later prefix hits: the
        end of the last full block a hit on its tokens may cover (0: nowhere)."""
        if not self.blocks.snapshots or not request.cache_prompt:
            return 0
        limit = request.prefix_limit()
        return limit - limit % self.blocks.block_size

    def _prefill(self, kv: "_KVPlan", request: Request, budget: int, chunks: list) -> int:
        """Plan the request's next prompt chunk within budget and capacity; tokens planned."""
        n = self._chunk(request)
        fit = kv.fit(request, min(n, budget))
        if request.max_kv_size and fit < n:
            # under a KV bound chunk boundaries decide which keys stay visible: a chunk cut
            # short by other requests' work would make output depend on the batch
            return 0
        if fit > 0:
            chunks.append(ScheduledChunk(request, fit))
            kv.grow(request, fit)
        return fit

    def _unstall(self, kv: "_KVPlan", budget: int, chunks: list, preempted: list) -> int:
        """Nothing was planned though requests run: all of them are prefilling and their partial
        prompts fill the pool, so none would ever finish. The last in the policy's order are
        preempted until the first one's next chunk fits, and it is planned; tokens planned."""
        first = self.running[0]  # a decode would have been planned, or preempted itself
        n = min(self._chunk(first), budget)
        if not self._make_room(kv, first, n, preempted):
            return 0
        chunks.append(ScheduledChunk(first, n))
        return n

    def _make_room(self, kv: "_KVPlan", request: Request, n: int, preempted: list) -> bool:
        """Preempt the last running requests in the policy's order (the newest, or the lowest
        priority) until `request` can grow by n tokens; False if `request` itself had to go.
        Those after `request` are not yet planned this step, so none loses a planned chunk."""
        while kv.fit(request, n) < n:
            victim = self.running[-1]
            self._preempt(kv, victim, preempted)
            if victim is request:
                return False
        kv.grow(request, n)
        return True

    def _preempt(self, kv: "_KVPlan", request: Request, preempted: list) -> None:
        self.running.remove(request)
        kv.free(request)
        request.num_computed = 0  # recomputed from prompt + output when it runs again
        request.status = Status.WAITING
        self.policy.requeue(self.waiting, request)
        preempted.append(request)
        self.num_preempted += 1

    def remove_finished(self) -> list[Request]:
        """The finished requests, their blocks given back (the caller drops their caches)."""
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        for request in done:
            self.blocks.release(request.request_id)
        return done

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is, its blocks given back; the caller drops its cache."""
        self.blocks.release(request_id)
        for queue in (self.waiting, self.running):
            for request in list(queue):
                if request.request_id == request_id:
                    queue.remove(request)
                    request.finish("abort")
                    return request
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class _KVPlan:
    """This step's blocks: each planned chunk takes its blocks from the manager at once (its
    request's table trimmed and extended), so later chunks see only what is left."""

    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        blocks.commit()  # the last step ran: what it gave back may be handed out again

    def needed(self, request: Request, n: int) -> int:
        table = self.blocks.table(request.request_id)
        return table.blocks_needed(request.num_computed, n, request.max_kv_size, request.keep)

    def fit(self, request: Request, n: int) -> int:
        """The most of n tokens `request` may add with the blocks free now."""
        most = -(-n // self.blocks.block_size) + 1  # n tokens never take more new blocks
        if self.blocks.fits(most) or self.blocks.fits(self.needed(request, n)):
            return n
        low, high = 0, n  # blocks needed only grow with the tokens: the largest that fits
        while low < high:
            mid = (low + high + 1) // 2
            if self.blocks.fits(self.needed(request, mid)):
                low = mid
            else:
                high = mid - 1
        return low

    def grow(self, request: Request, n: int) -> None:
        take_blocks(self.blocks, request, n)

    def free(self, request: Request) -> None:
        self.blocks.release(request.request_id)


def take_blocks(blocks: BlockManager, request: Request, n: int) -> BlockTable:
    """`request`'s table made ready for its next `n` tokens: trimmed to its KV bound, holding
    blocks for their positions and (with recurrent layers) a state slot."""
    table = blocks.table(request.request_id)
    table.make_room(request.num_computed, n, request.max_kv_size, request.keep)
    table.reserve(request.num_computed, n)
    if blocks.state_slots:
        blocks.state_slot(request.request_id)
    return table
