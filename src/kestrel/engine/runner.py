"""The runner owns the device: per-sequence caches, batch packing, the forward, and sampling.

`Runner` is what every runner shares and the engine calls: `kv_memory` (what the scheduler builds
its block manager from), `step` (run one `SchedulerOutput`), `release` a finished request's device
state, and the one sampler over a step's rows (engine/step_sampler.py). A runner never writes to
the block manager: each chunk brings its block table, planned by the scheduler. Two runners fill
in where keys live and how a step is packed, side by side: the reference runner
(engine/reference_runner.py, dense caches, the test oracle) and the paged runner
(engine/paged_runner.py, a pool of blocks, the one that serves).

A step that raises is undone (every cache restored from its checkpoint) and retried one request at
a time, so a fault fails only the request that caused it and the batch goes on.

A request with images (`Request.multimodal`, a kestrel.models.qwen_vl_processor.MultimodalPrompt) has them
encoded once, at its first prefill chunk; each prefill chunk then carries its M-RoPE ids and the
features of its image tokens, and decode needs nothing more (text follows `cache.rope_delta`).

An embedding request (`Request.pooling`) runs its prompt in the same steps and chunks as any
other, samples nothing, and gets the L2-normalized pool of its final-norm hidden states: the last
prompt token's, or the mean over its tokens, summed chunk by chunk so that it equals one pass.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kestrel.cache.blocks import KVMemory
from kestrel.cache.sequence import SequenceCache
from kestrel.engine.grammar import GrammarMasks
from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kestrel.engine.step_sampler import StepResult, StepSampler
from kestrel.models.base import CausalLM
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.qwen_vision import VisionFeatures

log = logging.getLogger("kestrel.runner")


def pooled_rows(chunk: ScheduledChunk, start: int) -> range:
    """The rows of a chunk packed from `start` whose hidden states its request pools: every row
    for mean pooling, the prompt's last for last pooling, none for a generation request."""
    pooling, n = chunk.request.pooling, chunk.num_tokens
    if pooling == "mean":
        return range(start, start + n)
    if pooling == "last" and chunk.completes:
        return range(start + n - 1, start + n)
    return range(0)


class Runner:
    """A runner's shared part. Subclasses give `kv_memory`, `_cache` (a request's cache, made at
    its first chunk) and `_run` (one step's forward and sampling)."""

    speculates = False  # verifies speculative chunks (ScheduledChunk.draft)

    def __init__(self, model: CausalLM, device: torch.device):
        self.model = model
        self.device = device
        self.caches: dict[str, SequenceCache] = {}
        self.sampler = StepSampler(device)  # seeded requests' generators live there
        self.image_features: dict[str, object] = {}  # request id -> VisionFeatures (prefill)
        # request id -> ((H,) float32 sum of the hidden states pooled so far, how many)
        self.pooled: dict[str, tuple[torch.Tensor, int]] = {}
        # structured output's masks; the Engine sets it (it has the tokenizer)
        self.grammar: GrammarMasks | None = None
        # test-only fault injection: called as hook(stage, request) at "forward" and "sample"
        self.fault_hook: Callable[[str, Request], None] | None = None
        self.lora = None  # the engine's LoRAManager (kestrel.lora); None: no adapters

    def kv_memory(self, kv_capacity: int | None) -> KVMemory:
        """The KV memory the scheduler plans with, at most `kv_capacity` tokens (None: all)."""
        raise NotImplementedError

    def step(self, plan: SchedulerOutput) -> list[StepResult]:
        """One scheduled step: preempted requests' caches dropped (they are recomputed), the
        recurrent states the scheduler keeps copied, then the chunks run."""
        for request in plan.preempted:
            self.evict(request.request_id)
        self._copy_states(plan.snapshots)
        self._copy_blocks(plan.host_copies)
        return self.execute(plan.chunks) if plan.chunks else []

    def _copy_states(self, snapshots: list[tuple[int, int]]) -> None:
        """Copy each (state slot, snapshot slot) pair; only a pool of recurrent states has any."""
        assert not snapshots, "this runner keeps no recurrent-state slots"

    def _copy_blocks(self, copies: list) -> None:
        """Run the host tier's block copies in order; only a runner with a host pool has any."""
        assert not copies, "this runner keeps no host tier"

    def execute(self, chunks: list[ScheduledChunk]) -> list[StepResult]:
        """The chunks' step, undone and retried one chunk at a time if it raises."""
        saved = [self._cache(c).checkpoint() for c in chunks]
        try:
            return self._run(chunks)
        except Exception as error:
            for chunk, state in zip(chunks, saved, strict=True):
                self.caches[chunk.request.request_id].restore(state)
            if len(chunks) == 1:
                log.exception("request %s failed in the forward", chunks[0].request.request_id)
                return [StepResult(chunks[0].request, error=error)]
            return [result for chunk in chunks for result in self.execute([chunk])]

    def _cache(self, chunk: ScheduledChunk) -> SequenceCache:
        """The cache of the chunk's request, made at its first chunk."""
        raise NotImplementedError

    def _run(self, chunks: list[ScheduledChunk]) -> list[StepResult]:
        raise NotImplementedError

    def _forward(self, batch: ForwardBatch, num_sampling: int):
        """(S, V) logits of the sampling rows, which lead `logits_rows`, and (P, H) hidden states
        of the pooled rows after them: the head runs only where a token is drawn."""
        hidden = self.model.hidden(batch)
        return self.model.logits(hidden[:num_sampling]), hidden[num_sampling:]

    def _finish(self, chunks, sampled: list[StepResult], hidden) -> list[StepResult]:
        """The sampled results, then one per chunk that samples nothing (with its vector when an
        embedding request's prompt is in)."""
        vectors = self._pool(chunks, hidden)
        return sampled + [
            StepResult(c.request, embedding=vectors.get(c.request.request_id))
            for c in chunks
            if not c.samples
        ]

    def _pool(self, chunks: list[ScheduledChunk], hidden) -> dict[str, list[float]]:
        """Add each chunk's pooled rows of (P, H) `hidden` to its request's sum; the vectors of
        the requests whose prompt is now in (the mean, L2-normalized)."""
        sums, at = {}, 0
        for chunk in chunks:
            n, request_id = len(pooled_rows(chunk, 0)), chunk.request.request_id
            if n:
                total, count = self.pooled.get(request_id, (0.0, 0))
                sums[request_id] = (total + hidden[at : at + n].float().sum(0), count + n)
                at += n
        self.pooled.update(sums)  # all at once: a step that raised before adds nothing
        vectors = {}
        for chunk in chunks:
            if chunk.request.pooling is not None and chunk.completes:
                total, count = self.pooled.pop(chunk.request.request_id)
                vectors[chunk.request.request_id] = F.normalize(total / count, dim=0).tolist()
        return vectors

    def _advance(self, chunks: list[ScheduledChunk]) -> None:
        """The step ran: each cache holds its chunk's keys."""
        for chunk in chunks:
            self.caches[chunk.request.request_id].advance(chunk.num_tokens)
            if chunk.request.num_computed + chunk.num_tokens >= len(chunk.request.prompt_ids):
                self.image_features.pop(chunk.request.request_id, None)  # the prompt is in

    def _encode_images(self, chunks: list[ScheduledChunk]) -> None:
        """The images of every request in the step that has some still to prefill, encoded in
        one vision forward (batched across requests, once per request); each request's rows
        stay until its prompt is in."""
        todo = [c.request for c in chunks if self._images_pending(c.request)]
        if not todo:
            return
        dtype = next(self.model.parameters()).dtype
        pixels = torch.cat([r.multimodal.pixel_values for r in todo]).to(self.device, dtype)
        features = self.model.encode_images(
            pixels, torch.cat([r.multimodal.image_grid_thw for r in todo])
        )
        rows = [sum(end - start for start, end in r.multimodal.image_spans) for r in todo]
        deepstack = [layer.split(rows) for layer in features.deepstack]
        for i, (request, embeds) in enumerate(zip(todo, features.embeds.split(rows), strict=True)):
            layers = [per_request[i] for per_request in deepstack]
            self.image_features[request.request_id] = VisionFeatures(embeds, layers)

    def _images_pending(self, request: Request) -> bool:
        prompt, first = request.multimodal, request.num_computed
        if prompt is None or request.request_id in self.image_features:
            return False
        # images already in the cache (a prefix hit, or earlier chunks) are not encoded again
        return first < len(prompt.token_ids) and any(end > first for _, end in prompt.image_spans)

    def _image_inputs(self, request: Request, cache: SequenceCache, n: int):
        """(3, n) M-RoPE ids and the image rows of a multimodal request's next n tokens; (None,
        None) once its prompt is in (text RoPE ids are then position + rope_delta)."""
        prompt, first = request.multimodal, request.num_computed
        cache.rope_delta = prompt.rope_delta
        prompt_len = len(prompt.token_ids)
        if first >= prompt_len:
            return None, None
        features = self.image_features.get(request.request_id)  # from _encode_images
        rope, images = prompt.chunk_inputs(features, first, min(n, prompt_len - first))
        if first + n > prompt_len:  # generated tokens recomputed with the prompt: text
            tail = torch.arange(prompt_len, first + n) + prompt.rope_delta
            rope = torch.cat([rope, tail.expand(3, -1)], dim=1)
        return rope.to(self.device), images

    # -- sampling: one batch of rows (engine/step_sampler.py), both runners -------------------

    def _sample_batch(
        self, requests: list[Request], raw: torch.Tensor, logits: torch.Tensor
    ) -> list[StepResult]:
        """A token per request from its row of (S, V) `logits` (grammar-masked)."""
        return self.sampler.sample(requests, raw, logits, self._sample_faults(requests))

    def _verify(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[StepResult]:
        """Each speculative chunk's tokens from its k + 1 rows of (R, V) `logits`; its cache's
        offset steps back over its rejected draft tokens."""
        errors = self._sample_faults([c.request for c in chunks])
        results = self.sampler.verify(chunks, logits, errors)
        for chunk, result in zip(chunks, results, strict=True):
            if result.tokens is not None:
                rejected = len(chunk.draft) + 1 - len(result.tokens)
                self.caches[chunk.request.request_id].offset -= rejected
        return results

    def _sample_faults(self, requests: list[Request]) -> dict[str, BaseException]:
        """{request id: error} of the requests whose sampling the test fault hook fails."""
        errors = {}
        for request in requests if self.fault_hook else []:
            try:
                self.fault_hook("sample", request)
            except Exception as error:
                log.exception("request %s failed in sampling", request.request_id)
                errors[request.request_id] = error
        return errors

    # -- structured output ----------------------------------------------------------------------

    def _start_masks(self, requests: list[Request]):
        if self.grammar is None:
            if any(r.params.structured_output for r in requests):
                raise ValueError("structured output needs the engine's tokenizer")
            return None
        return self.grammar.start(requests)

    def _apply_masks(self, masks, logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the masked logits, {request id: error} of grammars that failed) of a step."""
        if masks is None:
            return logits, {}
        step = masks.result()
        return self.grammar.apply(step, logits), step.errors

    def _accept(self, results: list[StepResult], failed: dict) -> list[StepResult]:
        """The step's results with grammar failures as errors; sampled tokens noted for the
        grammars (fed to them while the next forward runs)."""
        results = [
            StepResult(r.request, error=failed[r.request.request_id])
            if r.request.request_id in failed
            else r
            for r in results
        ]
        if self.grammar is not None:
            self.grammar.accept([(r.request, r.token) for r in results if r.token is not None])
        return results

    def _set_lora(self, chunks: list[ScheduledChunk], pad: Callable | None = None) -> None:
        """Each packed row's LoRA slot for the forward (0: the base model), every chunk's
        adapter placed in a slot first if needed; `pad(column)`: the rows as a graph lays
        them out."""
        if self.lora is None:
            return
        slots = [self.lora.slot_for(c.request.request_id, c.request.lora_key) for c in chunks]
        column = [s for s, c in zip(slots, chunks, strict=True) for _ in range(c.num_tokens)]
        self.lora.set_step(pad(column) if pad else column)

    def release(self, request_id: str) -> None:
        if self.lora is not None:
            self.lora.release(request_id)
        self.caches.pop(request_id, None)
        self.sampler.release(request_id)
        self.image_features.pop(request_id, None)
        self.pooled.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.release(request_id)

    def evict(self, request_id: str) -> None:
        """Drop a preempted request's cache and pooled sum (it is recomputed); its sampler state
        stays."""
        if self.lora is not None:
            self.lora.release(request_id)
        self.caches.pop(request_id, None)
        self.pooled.pop(request_id, None)

    def kv_tokens_in_use(self) -> int:
        return sum(cache.live_tokens for cache in self.caches.values())


def run_step(scheduler: Scheduler, runner: Runner) -> list[StepResult]:
    """One scheduled step run, and each request's `num_computed` advanced. The caller appends the
    sampled tokens, finishes requests and releases them (the Engine, `kestrel bench`, tests)."""
    plan = scheduler.schedule()
    results = runner.step(plan)
    if not plan.chunks:
        return []
    failed = {r.request.request_id for r in results if r.error}
    accepted = {r.request.request_id: len(r.tokens) - 1 for r in results if r.tokens}
    scheduler.computed(plan.chunks, failed, accepted)
    return results
