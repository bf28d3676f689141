"""A generation request as the scheduler sees it: token counts and state, no tensors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler side stays free of torch
    from kestrel.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: the scheduler finds requests in its lists by `in`
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    max_kv_size: int | None = None  # per-sequence KV bound (tokens); None = unbounded
    keep: int = 0  # sink tokens kept at the front when trimming
    # a prompt with images (kestrel.models.qwen_vl_processor.MultimodalPrompt, whose token_ids are prompt_ids);
    # opaque here: only the runner reads it. None for text.
    multimodal: object | None = None
    # (first token, digest) of each image: images join the prefix-cache keys of their blocks
    image_keys: tuple[tuple[int, bytes], ...] = ()
    # "last" or "mean": an embedding request, whose result is its prompt's pooled hidden states
    # (prefill only, nothing sampled); None: a generation request
    pooling: str | None = None
    # a LoRA adapter's name (the request's `model`); None: the base model. `lora_key` is that
    # adapter's (set by the engine): its slot and the root of its prefix-cache keys
    lora: str | None = None
    lora_key: bytes = b""
    priority: int = 0  # under --scheduling-policy priority: lower runs sooner (vLLM's)
    # disaggregated prefill/decode: the prefill engine finishes it after its first token
    # ("handoff") and sends its KV; the decode engine takes it over from there
    handoff: bool = False
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens already written into the cache
    num_cached_tokens: int | None = None  # prompt tokens a prefix hit gave it (set at admission)
    num_host_cached_tokens: int = 0  # of its hit's tokens, those the host tier brought back
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed for it...
    num_accepted_tokens: int = 0  # ...and of those, accepted
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        """Known tokens not yet in the cache: the prompt's rest while prefilling, 1 when decoding."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def max_chunk(self, chunk_size: int) -> int:
        """Largest chunk this request may take. Under a KV bound at most max_kv_size - keep, and
        since chunk boundaries decide which keys stay visible, a recompute (after preemption)
        feeds its prompt in the chunks it first had and its output one token at a time, as it was
        first computed, so it ends with the same output."""
        if self.max_kv_size:
            prompt_left = len(self.prompt_ids) - self.num_computed
            if prompt_left <= 0:
                return 1
            return min(chunk_size, self.max_kv_size - self.keep, prompt_left)
        return chunk_size

    @property
    def cache_prompt(self) -> bool:
        """Whether it may reuse cached prefix blocks (llama-server's per-request opt-out). Mean
        pooling may not: it needs the hidden state of every prompt token."""
        return self.pooling != "mean" and getattr(self.params, "cache_prompt", True)

    def prefix_limit(self) -> int:
        """How many leading tokens a prefix hit may cover: all but the last (its logits are
        needed). Under a KV bound, none unless the prompt fits the bound, and at most the bound:
        until its first trim a sequence's keys are those of an unbounded one, but chunk
        boundaries decide which keys survive a trim, and a hit moves them."""
        limit = len(self.prompt_ids) + len(self.output_ids) - 1
        if self.max_kv_size:
            if len(self.prompt_ids) > self.max_kv_size:
                return 0
            limit = min(limit, self.max_kv_size)
        return limit

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
