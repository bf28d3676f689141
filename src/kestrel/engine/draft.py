"""Speculative decoding with a draft model: a smaller model with the same tokenizer proposes the
next k tokens of every speculating sequence; the target verifies them in one forward
(engine/paged_runner.py), so the output is the target's alone.

The draft runs on its own paged runner and pool (CUDA graphs for its rounds), one shadow request
per target request; the proposer plans the draft's blocks as the scheduler plans the target's (its
own block manager, the only one to write to it). Each step a shadow catches up on the tokens the
target added since (the accepted draft tokens and the one after them; the whole prompt the first
time), in the same forward for every sequence, then decodes k - 1 more, batched: k forwards of the
draft per step. Its proposals are greedy (the draft's argmax), a deterministic proposal, so the
target's verification (sampling.verify_rows) is exact under temperature too. Where the target
rejected a draft token the shadow steps back to the last token both agree on: its blocks past it
go back and its offset returns there, the same rollback as the target's.

Keys behind a sliding window stay in the draft's pool until its sequence ends (a rollback must
find every key the query at its new end sees), and the draft holds no KV bound: a sequence whose
tokens outgrow the draft's context stops speculating.
"""

from dataclasses import replace

import torch

from kestrel.cache.blocks import BlockManager, KVMemory
from kestrel.config import Config
from kestrel.engine.paged_runner import PagedRunner, pool_serves
from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk, SchedulerOutput, take_blocks
from kestrel.sampling import SamplingParams

DRAFT_MEMORY_SHARE = (
    0.1  # of the GPU's free memory, for the draft's pool (built before the target's)
)
GREEDY = SamplingParams(temperature=0.0)


class DraftRunner(PagedRunner):
    """The draft model's paged runner: no prefix cache, no window eviction, a bounded pool."""

    def kv_memory(self, kv_capacity: int | None) -> KVMemory:
        # no eviction behind a window: a rollback finds every key its new end sees
        return replace(super().kv_memory(kv_capacity), evict_window=None)

    def _profile_num_blocks(self) -> int:
        """On CUDA every running sequence's whole context within a share of the free memory (the
        target's pool, sized after, takes what is left); on the CPU as the target's."""
        if self.device.type != "cuda":
            return super()._profile_num_blocks()
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = self._bytes_per_block()
        wanted = self.max_num_seqs * (self.table_width - 1)
        return max(2, min(wanted, int(free * DRAFT_MEMORY_SHARE // per_block))) + 1

    def rewind(self, request_id: str, end: int) -> None:
        """The sequence's cache goes back to position `end` (its keys after it are dropped)."""
        self.caches[request_id].offset = end


class DraftProposer:
    """Proposes up to k tokens per sequence with a draft model (the scheduler's `proposer`)."""

    def __init__(self, runner: DraftRunner, k: int, max_len: int):
        self.runner, self.k, self.max_len = runner, k, max_len
        self.shadows: dict[str, Request] = {}
        self.blocks = BlockManager.of(runner.kv_memory(None))  # the draft pool's blocks

    def propose_all(self, requests: list[Request], most: list[int]) -> list[list[int]]:
        """Per request, up to min(k, most) tokens to follow its tokens ([]: none)."""
        wanted: dict[str, int] = {}
        for request, m in zip(requests, most, strict=True):
            m = min(self.k, m)
            if self._ready(request, m):
                wanted[request.request_id] = m
        drafts = {request_id: self._head(request_id) for request_id in wanted}
        active = [self.shadows[r] for r in wanted if len(drafts[r]) < wanted[r]]
        while active:
            self._before_round(active)
            for shadow, token in self._round(active):
                if token is None:  # failed: no proposal, and its draft cache starts over
                    drafts[shadow.request_id] = []
                    self.release(shadow.request_id)
                    continue
                shadow.output_ids.append(token)
                drafts[shadow.request_id].append(token)
            active = [
                s
                for s in active
                if s.request_id in self.shadows and len(drafts[s.request_id]) < wanted[s.request_id]
            ]
        return [drafts.get(request.request_id, []) for request in requests]

    def _ready(self, request: Request, m: int) -> bool:
        """Whether the request gets m proposals this step, its shadow then synced to it."""
        if m <= 0 or len(request.prompt_ids) + len(request.output_ids) + m > self.max_len:
            self.release(request.request_id)
            return False
        self._sync(request)
        return True

    def _head(self, request_id: str) -> list[int]:
        """The proposals a request has before the rounds (none: the rounds make them all)."""
        return []

    def _before_round(self, active: list[Request]) -> None:
        """What the shadows need before a round (nothing: the draft takes only tokens)."""

    def _sync(self, request: Request) -> None:
        """The request's shadow holds its tokens, its computed keys cut back to the longest
        prefix its draft tokens share with them (at least one token pending)."""
        ids = request.prompt_ids + request.output_ids
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            self.shadows[request.request_id] = Request(request.request_id, ids, GREEDY, 1 << 30)
            return
        known = len(shadow.prompt_ids)  # its tokens up to the last step: a prefix of `ids`
        drafted = shadow.output_ids[: max(0, shadow.num_computed - known)]
        agree = next(
            (i for i, (a, b) in enumerate(zip(drafted, ids[known:], strict=False)) if a != b),
            min(len(drafted), len(ids) - known),
        )
        end = min(shadow.num_computed, known + agree, len(ids) - 1)
        if end < shadow.num_computed:
            self.rollback(shadow, end)
        shadow.prompt_ids, shadow.output_ids = ids, []

    def rollback(self, shadow: Request, end: int) -> None:
        """The shadow's keys from position `end` on are dropped (the target rejected them): its
        blocks past `end` go back."""
        shadow.num_computed = end
        self.runner.rewind(shadow.request_id, end)
        self.blocks.table(shadow.request_id).truncate(end)

    def _round(self, active: list[Request]) -> list[tuple[Request, int | None]]:
        """One draft forward: each shadow's pending tokens, as many as the step's budget holds
        (a long prompt takes several rounds); (shadow, drafted token or None if it failed) of
        those whose pending tokens all went in."""
        budget, chunks = self.runner.token_budget, []
        for shadow in active:
            n = min(shadow.num_pending, budget)
            if n > 0:
                table = take_blocks(self.blocks, shadow, n)
                chunks.append(ScheduledChunk(shadow, n, table=table))
                budget -= n
        results = self.runner.step(SchedulerOutput(chunks))
        self.blocks.commit()
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        out = []
        for result in results:
            if result.error is not None:
                out.append((result.request, None))
            elif result.token is not None:
                out.append((result.request, result.token))
        return out

    def release(self, request_id: str) -> None:
        """Forget a request's shadow (it finished, or stopped speculating)."""
        if self.shadows.pop(request_id, None) is not None:
            self.runner.release(request_id)
            self.blocks.release(request_id)


def draft_proposer(draft, device: torch.device, config: Config, max_len: int, vocab_size: int):
    """The proposer over a loaded draft model; ValueError naming --draft-model when it cannot
    propose for this target."""
    text = draft.config.text_config if getattr(draft, "multimodal", False) else draft.config
    if text.vocab_size > vocab_size:
        raise ValueError(
            f"--draft-model: its vocabulary ({text.vocab_size}) is larger than the model's "
            f"({vocab_size}); the draft must share the model's tokenizer"
        )
    if not pool_serves(draft) or any(draft.state_layout()):
        raise ValueError(
            "--draft-model: a draft must keep only attention caches (recurrent state cannot be "
            "rolled back)"
        )
    k = config.speculation.num_speculative_tokens
    return DraftProposer(draft_runner(draft, device, config, max_len), k, max_len)


def draft_runner(
    draft, device: torch.device, config: Config, max_len: int, **kwargs
) -> DraftRunner:
    """The runner of a draft model for this target's scheduler limits."""
    k = config.speculation.num_speculative_tokens
    sched = config.scheduler
    cache = replace(config.cache, prefix_caching=False, num_blocks=None)
    return DraftRunner(
        draft,
        device,
        max_num_seqs=sched.max_num_seqs,
        token_budget=sched.token_budget,
        max_model_len=max_len + k + 1,
        cache=cache,
        cuda_graphs=config.model.cuda_graphs,
        speculative_tokens=k,  # catch-up chunks of up to k + 1 tokens run in graphs too
        **kwargs,
    )
