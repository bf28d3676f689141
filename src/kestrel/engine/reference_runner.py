"""The reference runner: the test oracle every other path is compared with. Each sequence keeps
dense per-layer caches that grow by concatenation (cache/sequence.py), and a step packs its chunks
as `SeqChunk`s over them; plain PyTorch, no pool, no kernels, no graphs.

It keeps the `Runner` contract (engine/runner.py): fault isolation, the one sampler, grammars,
pooling, images and LoRA are the base's; what is its own is where keys live.
"""

import torch

from kestrel.cache.blocks import KVMemory, evict_window
from kestrel.cache.sequence import SequenceCache
from kestrel.engine.runner import Runner, pooled_rows
from kestrel.engine.scheduler import ScheduledChunk
from kestrel.engine.step_sampler import StepResult
from kestrel.models.batch import ForwardBatch, SeqChunk


class ModelRunner(Runner):
    """Dense caches that grow token by token; it decodes token by token (no speculation)."""

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> list[StepResult]:
        batch = self._pack(chunks)
        self._set_lora(chunks)
        sampling = [c.request for c in chunks if c.samples]
        masks = self._start_masks(sampling)  # on the host, while the forward runs
        logits, hidden = self._forward(batch, len(sampling))
        self._advance(chunks)
        masked, failed = self._apply_masks(masks, logits)
        results = self._sample_batch(sampling, logits, masked)
        return self._finish(chunks, self._accept(results, failed), hidden)

    def _pack(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        self._encode_images(chunks)
        ids, positions, seq_chunks, rows, pool_rows = [], [], [], [], []
        start = 0
        for chunk in chunks:
            request, n = chunk.request, chunk.num_tokens
            if self.fault_hook:
                self.fault_hook("forward", request)
            cache = self.caches[request.request_id]
            cache.make_room(n, request.max_kv_size, request.keep)
            ids.extend(request.all_ids[request.num_computed : request.num_computed + n])
            positions.extend(range(cache.offset, cache.offset + n))
            rope = images = None
            if request.multimodal is not None:
                rope, images = self._image_inputs(request, cache, n)
            seq_chunks.append(SeqChunk(cache, start, n, rope, images))
            if chunk.samples:
                rows.append(start + n - 1)
            pool_rows.extend(pooled_rows(chunk, start))
            start += n
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        rows = as_tensor(rows + pool_rows)  # sampling rows first (see _forward)
        return ForwardBatch(as_tensor(ids), as_tensor(positions), seq_chunks, rows)

    def _cache(self, chunk: ScheduledChunk) -> SequenceCache:
        request_id = chunk.request.request_id
        if request_id not in self.caches:
            self.caches[request_id] = SequenceCache(self.model.cache_specs())
        return self.caches[request_id]

    def kv_memory(self, kv_capacity: int | None) -> KVMemory:
        """This runner's caches grow token by token: one-token blocks, `kv_capacity` of them
        (None: unlimited)."""
        return KVMemory(kv_capacity, 1, evict_window(self.model.cache_specs()))
