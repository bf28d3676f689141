"""The paged runner: the runner contract (engine/runner.py: execute / release, fault isolation,
the one sampler) over a paged KV pool and a recurrent-state pool, one attention kernel for every batch shape, sampling on
the device and CUDA graphs for decode steps.

It serves every family on CUDA and on the CPU (PyTorch fallbacks, no graphs there); the CPU is
also how its packing and paging are tested against the reference runner without a GPU.

Speculative decoding: a chunk with a draft (ScheduledChunk.draft) feeds its pending token and the
k proposed ones like a small prefill chunk, in the same forward as every other chunk, and its
k + 1 rows are all sampled: sampling.verify_rows keeps the proposed tokens the model would have
produced, and the cache's offset steps back over the rejected ones (the scheduler gives back
their blocks); a later token writes over their keys before any query may see them.
"""

import itertools
import logging
import math
import os
from array import array
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from kestrel.cache.blocks import BlockManager, KVMemory, evict_window
from kestrel.cache.host_pool import HostPool
from kestrel.cache.host_tier import BlockCopy
from kestrel.cache.paged import (
    BlockPool,
    PagedAttention,
    PagedSequenceCache,
    PoolStates,
    StatePool,
    kv_cache_dtype,
)
from kestrel.config import CacheConfig, Config
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.engine.runner import Runner, pooled_rows
from kestrel.engine.scheduler import ScheduledChunk, take_blocks
from kestrel.engine.step_sampler import StepResult
from kestrel.kernels import cpu_native
from kestrel.kernels.attention import tile_rows
from kestrel.models.batch import ForwardBatch, ImageRows
from kestrel.sampling import SamplingParams

log = logging.getLogger("kestrel.paged_runner")

# cache kinds the paged pools hold: per-token keys (full, sliding, the MLA latent), recurrent
# state (a slot per sequence) or nothing
POOL_KINDS = {"full", "sliding", "latent", "recurrent", "none"}
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
VERIFY_GRAPH_TOKENS = 256  # the verify graphs' most rows (their logits stay in the graph pool)
# pipeline parallel: a micro-batch's fewest tokens, by default (where a forward stops being bound
# by reading the weights, which every micro-batch reads again), and the most per stage
MICROBATCH_TOKENS = {"cuda": 128, "cpu": 16}
MICROBATCHES_PER_STAGE = 2


class TokenColumns(NamedTuple):
    """A packed batch's per-token columns, in the one order the host lists, the device copy and
    the CUDA graphs' static inputs share: (T,) each."""

    ids: object
    positions: object
    slots: object  # each token's flat KV slot (PagedAttention.slot_mapping)
    rope_ids: object  # text RoPE ids: position + rope_delta
    chunk_ends: object  # the last position of each token's chunk


class PackedSeq(NamedTuple):
    """A sequence of a packed batch: its block table and its mask rule's inputs."""

    blocks: list[int]
    n_sink: int
    main_start: int
    live_start: int
    keep: int


class SeqColumns(NamedTuple):
    """A batch's per-sequence columns, named as PagedAttention's fields: (S,) each."""

    num_blocks: object
    n_sink: object
    main_start: object
    live_start: object
    keep: object

    @classmethod
    def of(cls, seqs: list[PackedSeq]) -> "SeqColumns":
        return cls(
            num_blocks=[len(s.blocks) for s in seqs],
            n_sink=[s.n_sink for s in seqs],
            main_start=[s.main_start for s in seqs],
            live_start=[s.live_start for s in seqs],
            keep=[s.keep for s in seqs],
        )


@dataclass
class Packed:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    rope_ids: list[int] = field(default_factory=list)  # text RoPE ids: position + rope_delta
    slots: list[int] = field(default_factory=list)
    tiles: list[tuple[int, int, int]] = field(default_factory=list)  # (seq, start, len)
    seqs: list[PackedSeq] = field(default_factory=list)
    state_slots: list[int] = field(default_factory=list)  # per sequence (0: no recurrent state)
    rows: list[int] = field(default_factory=list)  # sampling rows (one per plain chunk)
    verify_rows: list[int] = field(default_factory=list)  # speculative chunks' k + 1 rows each
    pool_rows: list[int] = field(default_factory=list)  # embedding requests' pooled rows
    # multimodal prompt chunks: (start, (3, len) M-RoPE ids) and (start, ImageRows)
    explicit_rope: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    images: list[tuple[int, ImageRows]] = field(default_factory=list)

    def part(self, lo: int, hi: int) -> "Packed":
        """Tokens [lo, hi) as a batch of their own, rows counted from lo. A chunk cut in two keeps
        its sequence's block table in both parts: the first part's queries cannot see the keys
        the second writes (they come later), and the second reads the first's from the pool."""
        kept = [s for s, start, n in self.tiles if start < hi and start + n > lo]
        tiles = []
        for i, s in enumerate(kept):
            _, start, n = self.tiles[s]
            first = max(start, lo)
            tiles.append((i, first - lo, min(start + n, hi) - first))
        rows = lambda r: [i - lo for i in r if lo <= i < hi]  # noqa: E731
        tokens = TokenColumns(*(column[lo:hi] for column in self.token_columns()))
        return Packed(
            **tokens._asdict(),
            tiles=tiles,
            seqs=[self.seqs[s] for s in kept],
            state_slots=[self.state_slots[s] for s in kept],
            rows=rows(self.rows),
            verify_rows=rows(self.verify_rows),
            pool_rows=rows(self.pool_rows),
        )

    def token_columns(self) -> TokenColumns:
        return TokenColumns(self.ids, self.positions, self.slots, self.rope_ids, self.chunk_ends)


@dataclass
class GraphInputs:
    """The input tensors of one graph width's CUDA graphs, for up to `big` sequences (a graph
    reads its inputs where they were at capture: they live as long as it does)."""

    tokens: torch.Tensor  # (5, big * width): TokenColumns' rows
    tile_len: torch.Tensor  # (big * tiles,): each query tile's tokens (0: padding)
    seqs: torch.Tensor  # (6, big): SeqColumns' rows, then each recurrent-state slot
    table: torch.Tensor  # (big, table width): block tables
    rows: torch.Tensor  # (big * width,): every row (all of them give logits)
    tile_seq: torch.Tensor  # (big * tiles,): each tile's sequence (constant)
    tile_start: torch.Tensor  # (big * tiles,): each tile's first row (constant)
    hidden: torch.Tensor  # (big * width, H): an MTP draft's rows' hidden states
    tile_tokens: int  # query tokens per tile
    tiles: int  # query tiles per sequence

    @classmethod
    def allocate(cls, width, big, tile_tokens, table_width, hidden_size, dtype, device):
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=device)  # noqa: E731
        tiles = -(-width // tile_tokens)
        tile = torch.arange(big * tiles, device=device)
        seq = tile // tiles
        return cls(
            tokens=zeros(len(TokenColumns._fields), big * width),
            tile_len=zeros(big * tiles),
            seqs=zeros(len(SeqColumns._fields) + 1, big),
            table=zeros(big, table_width),
            rows=torch.arange(big * width, device=device),
            tile_seq=seq,
            tile_start=seq * width + tile % tiles * tile_tokens,
            hidden=torch.zeros(big * width, hidden_size, dtype=dtype, device=device),
            tile_tokens=tile_tokens,
            tiles=tiles,
        )


def pool_serves(model) -> bool:
    """Whether the paged pools hold every layer's cache."""
    return {spec.kind for spec in model.cache_specs()} <= POOL_KINDS


def make_runner(model, device: torch.device, config: Config, max_model_len: int) -> Runner:
    """The paged runner for models the pools serve, on CUDA and the CPU (KV and recurrent state
    written in place, prefixes cached); the reference runner otherwise."""
    if pool_serves(model):
        sched = config.scheduler
        return PagedRunner(
            model,
            device,
            max_num_seqs=sched.max_num_seqs,
            token_budget=sched.token_budget,
            max_model_len=max_model_len,
            cache=config.cache,
            cuda_graphs=config.model.cuda_graphs,
            kv_capacity=config.scheduler.kv_capacity,
            speculative_tokens=config.speculation.num_speculative_tokens
            if config.speculation.speculative
            else 0,
            keep_hidden=config.speculation.speculative == "mtp",
            microbatch_tokens=config.parallel.pp_microbatch_tokens
            or MICROBATCH_TOKENS.get(device.type, MICROBATCH_TOKENS["cpu"]),
        )
    return ModelRunner(model, device)


SSM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PagedRunner(Runner):
    speculates = True

    def __init__(
        self,
        model,
        device: torch.device,
        max_num_seqs: int,
        token_budget: int,
        max_model_len: int,
        cache: CacheConfig | None = None,
        cuda_graphs: bool = True,
        kv_capacity: int | None = None,
        speculative_tokens: int = 0,
        keep_hidden: bool = False,
        microbatch_tokens: int = MICROBATCH_TOKENS["cpu"],
    ):
        """`kv_capacity` (tokens) bounds the pool below what memory allows; `speculative_tokens`
        (k, 0: none) adds CUDA graphs for steps of chunks of up to 1 + k tokens (verify steps).
        `keep_hidden`: each step hands every chunk's final hidden states to `hidden_out` (an MTP
        draft catches up on them: engine/mtp.py). A pipeline stage's eager steps of at least
        twice `microbatch_tokens` go through the stages as micro-batches."""
        super().__init__(model, device)
        self.microbatch_tokens = microbatch_tokens
        self.keep_hidden = keep_hidden
        # hidden_out(chunks, per chunk its rows' (n, H) hidden states, results), after each step
        self.hidden_out = None
        # an MTP draft's runner: hidden_in(chunks) -> (T, H), the hidden state each row takes
        self.takes_hidden = getattr(model, "takes_hidden", False)
        self.hidden_in = None
        self.cache_config = cache or CacheConfig()
        self.cuda_graphs = cuda_graphs
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.layout = model.kv_layout()  # per layer KVShape, None: no KV
        self.specs = model.cache_specs()
        bs = self.cache_config.block_size
        # + k: a verify step's padded rows may sit past the context
        self.table_width = (max_model_len + speculative_tokens + bs - 1) // bs + 2
        self.verify_width = 1 + speculative_tokens
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_cache_dtype(self.cache_config.kv_cache_dtype, self.dtype)
        self.use_triton = device.type == "cuda"
        self.states = self._state_pool(model)
        # the PyTorch attention gathers a sequence's keys once per tile: one tile per chunk
        heads = model.config.get_text_config().num_attention_heads
        self.tile_tokens = self._tile_tokens(heads) if self.use_triton else token_budget
        if self.use_triton or cpu_native.available():  # fused norms/RoPE/MLP, one qkv matmul
            from kestrel.models.layers.fused import fuse_model

            fuse_model(model)
        num_blocks = self.cache_config.num_blocks or self._profile_num_blocks()
        if kv_capacity:
            num_blocks = min(num_blocks, -(-kv_capacity // bs) + 1)
        self._use_pool(num_blocks)
        self.host_pool = self._host_tier()
        # (width, batch size) -> graph, logits, hidden states
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.static: dict[int, GraphInputs] = {}  # width -> its graphs' input tensors
        if device.type == "cuda" and cuda_graphs:
            self._capture_graphs()

    def _tile_tokens(self, num_heads: int) -> int:
        """Prompt tokens per query tile: the widest GQA group times these fill a kernel tile."""
        shapes = [shape for shape in self.layout if shape]
        if not shapes:
            return self.token_budget
        group = num_heads // min(shape.heads for shape in shapes)
        group_pad = 1 << math.ceil(math.log2(group))
        width = max(shape.values for shape in shapes)
        itemsize = torch.finfo(self.dtype).bits // 8
        return max(1, tile_rows(width, itemsize) // group_pad)

    # -- memory -------------------------------------------------------------------------------

    def _state_pool(self, model) -> StatePool | None:
        """A recurrent-state slot per running sequence (+ the scratch slot), allocated before the
        KV pool is sized from what memory is left."""
        layout = model.state_layout()
        if not any(layout):
            return None
        ssm_dtype = SSM_DTYPES.get(self.cache_config.mamba_ssm_cache_dtype)
        if ssm_dtype is None:
            raise ValueError(
                f"mamba_ssm_cache_dtype {self.cache_config.mamba_ssm_cache_dtype!r}; "
                f"supported: {', '.join(SSM_DTYPES)}"
            )
        per_slot = StatePool.bytes_per_slot(layout, self.dtype, ssm_dtype)
        log.info("recurrent state: %d slots of %.1f MiB", self.max_num_seqs, per_slot / 2**20)
        # + with prefix caching, as many snapshots of cached prompts' state (cache/blocks.py)
        snapshots = self.max_num_seqs if self.cache_config.prefix_caching else 0
        slots = 1 + self.max_num_seqs + snapshots
        return StatePool(layout, slots, self.dtype, self.device, ssm_dtype)

    def _use_pool(self, num_blocks: int) -> None:
        """A pool of `num_blocks` (block 0: scratch) and the memory it offers the scheduler."""
        bs = self.cache_config.block_size
        self.pool = BlockPool(self.layout, num_blocks, bs, self.kv_dtype, self.device)
        self.memory = KVMemory(
            num_blocks - 1,
            bs,
            evict_window(self.specs),
            first_id=1,
            prefix_caching=self.cache_config.prefix_caching,
            prefix_tokens=self.model.chunk_invariant_tokens(),
            state_slots=self.max_num_seqs if self.states is not None else 0,
        )

    def kv_memory(self, kv_capacity: int | None) -> KVMemory:
        """The pool's blocks (already bounded by `kv_capacity`), recurrent-state slots and the
        host tier's slots."""
        return self.memory

    def _host_tier(self) -> HostPool | None:
        """--kv-offloading-size: host blocks for the prefix cache's evicted blocks, their count
        in the memory the scheduler plans with (None: off, or nothing cached to offload)."""
        gib = self.cache_config.kv_offloading_size
        if not gib or not self.memory.prefix_caching:
            return None
        host = HostPool.sized(self.pool, gib)
        self.memory = replace(self.memory, host_slots=host.num_slots)
        log.info("KV host tier: %d blocks (%.1f GiB)", host.num_slots, host.nbytes / 2**30)
        return host

    def _copy_blocks(self, copies: list[BlockCopy]) -> None:
        if copies:  # evicted blocks out, host hits back in, before the forward
            self.host_pool.apply(copies)

    def _profile_num_blocks(self) -> int:
        """Blocks that fit in --gpu-memory-utilization of the card after the weights and the
        activations of the largest step (measured by running one). On the CPU, room for every
        running sequence's whole context within a quarter of the machine's memory (the pool's
        pages are mapped as they are first written)."""
        if self.device.type != "cuda":
            return self._cpu_num_blocks()
        torch.cuda.synchronize()
        # weights replaced at load (fused copies) stay reserved by PyTorch's cache and would
        # count as used: hand them back before reading what is free
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._run_probe_step()
        torch.cuda.synchronize()
        activations = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        graphs = 512 << 20 if self.cuda_graphs else 0
        utilization = self.cache_config.gpu_memory_utilization
        budget = total * utilization - (total - free) - activations - graphs
        per_block = self._bytes_per_block()
        blocks = int(budget // per_block)
        if blocks < 2:
            raise RuntimeError(
                f"no memory left for the KV cache ({budget / 2**30:.2f} GiB); "
                "raise --gpu-memory-utilization"
            )
        log.info(
            "KV pool: %d blocks of %d tokens (%.1f GiB)",
            blocks,
            self.cache_config.block_size,
            blocks * per_block / 2**30,
        )
        return blocks

    def _cpu_num_blocks(self) -> int:
        per_block = self._bytes_per_block()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        wanted = self.max_num_seqs * (self.table_width - 1)
        return max(2, min(wanted, memory // 4 // per_block)) + 1  # + the scratch block

    def _bytes_per_block(self) -> int:
        return BlockPool.bytes_per_block(self.layout, self.cache_config.block_size, self.kv_dtype)

    def _run_probe_step(self) -> None:
        """One forward of the largest step (token_budget prompt tokens) over a pool just big
        enough for it; the pool is dropped afterwards."""
        n = self.token_budget
        self._use_pool(-(-n // self.cache_config.block_size) + 2)
        self.pool.calibrated = True  # zeros are no sample of keys: the real pool's first chunk is
        probe = Request("profile", [0] * n, SamplingParams(max_tokens=1), 1)
        # the probe's own plan over the probe pool; no scheduler sees it
        table = take_blocks(BlockManager.of(self.memory), probe, n)
        with torch.inference_mode():
            self.model(self._pack_batch([ScheduledChunk(probe, n, table=table)]))
        self.release("profile")
        self.pool = self.memory = None

    # -- the step -----------------------------------------------------------------------------

    def _cache(self, chunk: ScheduledChunk) -> PagedSequenceCache:
        """The request's cache over the pool, placed by the chunk's block table (the
        scheduler's), from where its prefix hit left it."""
        request, table = chunk.request, chunk.table
        cache = self.caches.get(request.request_id)
        if cache is None:
            cache = PagedSequenceCache(self.specs, table)
            cache.offset = request.num_computed
            if self.states is not None:  # the table's slot, from the hit's snapshot or zeros
                self.states.start(table.state_slot, table.state_from)
            self.caches[request.request_id] = cache
        assert cache.blocks is table, "a request's table changed under its cache"
        return cache

    def _copy_states(self, snapshots: list[tuple[int, int]]) -> None:
        for slot, snapshot in snapshots:  # before any state moves on
            self.states.copy(slot, snapshot)

    # -- disaggregated prefill/decode: a sequence's blocks out of one pool, into another ----

    def export_blocks(self, held: tuple[tuple[int, int], ...]) -> list[torch.Tensor | None]:
        """Per layer K then V of a sequence's `held` (logical, physical) blocks, each
        (n, block_size, Hkv, D), a copy; None for a layer without them."""
        physical = torch.tensor([p for _, p in held], dtype=torch.long, device=self.device)
        # gathered as bytes: exact for every pool dtype (FP8 has few index kernels)
        return [
            s if s is None else s.view(torch.uint8)[physical].view(s.dtype)
            for s in self.pool.k + self.pool.v
        ]

    def import_blocks(self, held: tuple[tuple[int, int], ...], kv: list) -> None:
        """Write `kv` (as `export_blocks` gives it) into the `held` blocks the scheduler took."""
        physical = torch.tensor([p for _, p in held], dtype=torch.long, device=self.device)
        for store, blocks in zip(self.pool.k + self.pool.v, kv, strict=True):
            if store is not None:
                bits = blocks.to(self.device, store.dtype).view(torch.uint8)
                store.view(torch.uint8).index_copy_(0, physical, bits)

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> list[StepResult]:
        packed = self._pack_host(chunks)
        decode = all(c.num_tokens == 1 and c.samples for c in chunks) and not packed.images
        decode = decode and not packed.explicit_rope
        graph = self._graph_for(chunks, packed)
        micro_batches = [] if graph is not None else self._micro_batches(packed)
        sampling = [c.request for c in chunks if c.samples and not c.draft]
        speculative = [c for c in chunks if c.draft]
        masks = self._start_masks(sampling)  # on the host, while the device runs the forward
        if graph is not None:
            self._set_lora(chunks, lambda c: _padded(c, packed.tiles, *graph, False))
            logits, rows = self._replay(packed, *graph, chunks)
            hidden = None  # nothing pooled
        elif micro_batches:
            logits, hidden = self._forward_stages(micro_batches, decode)
        else:
            self._set_lora(chunks)
            batch = self._to_batch(packed, tile_tokens=1 if decode else None)
            batch.keep_hidden = self.keep_hidden
            if self.takes_hidden:
                batch.prev_hidden = self.hidden_in(chunks)
            logits, hidden = self._forward(batch, len(packed.rows) + len(packed.verify_rows))
            rows = batch.hidden, [(start, n) for _, start, n in packed.tiles]
        self._advance(chunks)
        plain, verify = logits[: len(sampling)], logits[len(sampling) :]
        masked, failed = self._apply_masks(masks, plain)
        results = self._sample_batch(sampling, plain, masked) + self._verify(speculative, verify)
        results = self._finish(chunks, self._accept(results, failed), hidden)
        if self.keep_hidden:
            all_rows, spans = rows
            self.hidden_out(chunks, [all_rows[s : s + n] for s, n in spans], results)
        return results

    def _micro_batches(self, p: Packed) -> list[Packed]:
        """A pipeline stage's step cut into micro-batches of about equal tokens, each at least
        `microbatch_tokens` (up to MICROBATCHES_PER_STAGE per stage), a chunk cut where a
        boundary falls in it (so one long prompt's chunk overlaps too); [] when the step stays
        whole (too few tokens, no pipeline, images, or an MTP draft's hidden states)."""
        stages = getattr(getattr(self.model, "pipeline", None), "stages", 1)
        total = len(p.ids)
        count = min(stages * MICROBATCHES_PER_STAGE, total // self.microbatch_tokens)
        if stages == 1 or count < 2 or p.images or p.explicit_rope:
            return []
        if self.keep_hidden or self.takes_hidden:
            return []
        bounds = [total * k // count for k in range(count + 1)]
        return [p.part(lo, hi) for lo, hi in itertools.pairwise(bounds)]

    def _forward_stages(self, parts: list[Packed], decode: bool):
        """`_forward` of micro-batches, their rows joined as one batch's: the sampling rows (plain
        chunks', then speculative chunks'), then the pooled rows."""
        batches = [self._to_batch(part, tile_tokens=1 if decode else None) for part in parts]
        sampled, verified, pooled = [], [], []
        for part, h in zip(parts, self.model.pipeline(batches), strict=True):
            plain, verify = len(part.rows), len(part.verify_rows)
            sampled.append(h[:plain])
            verified.append(h[plain : plain + verify])
            pooled.append(h[plain + verify :])
        return self.model.logits(torch.cat(sampled + verified)), torch.cat(pooled)

    def _pack_batch(self, chunks) -> ForwardBatch:
        return self._to_batch(self._pack_host(chunks), None)

    def _pack_host(self, chunks: list[ScheduledChunk]) -> Packed:
        """The batch's index lists on the host, read from each chunk's block table."""
        self._encode_images(chunks)
        p = Packed()
        for s, chunk in enumerate(chunks):
            request, n = chunk.request, chunk.num_tokens
            if self.fault_hook:
                self.fault_hook("forward", request)
            cache = self._cache(chunk)  # its table holds the chunk's positions (planned)
            start = len(p.ids)
            p.ids.extend(_pending_ids(request, n - len(chunk.draft)) + chunk.draft)
            p.positions.extend(range(cache.offset, cache.offset + n))
            p.chunk_ends.extend([cache.offset + n - 1] * n)
            if request.multimodal is not None:
                rope, images = self._image_inputs(request, cache, n)
                if rope is not None:
                    p.explicit_rope.append((start, rope))
                if images is not None:
                    p.images.append((start, images))
            first_id = cache.offset + cache.rope_delta
            p.rope_ids.extend(range(first_id, first_id + n))
            p.slots.extend(cache.slots(cache.offset, n))
            blocks, n_sink, main_start = cache.table()
            p.seqs.append(
                PackedSeq(
                    blocks=blocks,
                    n_sink=n_sink,
                    main_start=main_start,
                    live_start=cache.live_start,
                    keep=cache.keep,
                )
            )
            p.state_slots.append(cache.state_slot)
            p.tiles.append((s, start, n))
            if chunk.draft:
                p.verify_rows.extend(range(start, start + n))
            elif chunk.samples:
                p.rows.append(start + n - 1)
            p.pool_rows.extend(pooled_rows(chunk, start))
        return p

    def _to_batch(self, p: Packed, tile_tokens: int | None) -> ForwardBatch:
        tile_tokens = tile_tokens or self.tile_tokens
        batch = build_batch(
            p, self.pool, tile_tokens, self.device, use_triton=self.use_triton, states=self.states
        )
        # an FP8 pool's scales come from the first batch it stores (pipeline micro-batches: the
        # first of them); the batches after read and write with those
        batch.attention.calibrate, self.pool.calibrated = not self.pool.calibrated, True
        return batch

    # -- CUDA graphs (decode and verify steps) -----------------------------------------------

    def _capture_graphs(self) -> None:
        """Graphs of `width` tokens per sequence for `b` sequences: width 1 for decode steps, and
        with speculation 1 + k for verify steps (chunks of fewer tokens are padded to it; their
        extra rows write the scratch block and are never read), while b * width stays within
        VERIFY_GRAPH_TOKENS. A verify chunk's query tiles hold min(tile_tokens, the next power
        of two >= width) tokens each."""
        sizes = [b for b in GRAPH_SIZES if b <= self.max_num_seqs] or [1]
        if self.max_num_seqs > sizes[-1]:
            sizes.append(self.max_num_seqs)
        widths = {1: sizes}
        w = self.verify_width
        if w > 1:
            widths[w] = [b for b in sizes if b * w <= VERIFY_GRAPH_TOKENS] or [1]
        self.graph_pool = torch.cuda.graph_pool_handle()
        for width, batch_sizes in widths.items():
            try:
                self._capture_width(width, batch_sizes)
            except Exception:
                if width == 1:
                    raise
                log.warning("verify steps run without CUDA graphs", exc_info=True)
                self.graphs = {key: g for key, g in self.graphs.items() if key[0] == 1}

    def _capture_width(self, width: int, sizes: list[int]) -> None:
        # an eager step's query tiles (a power of two: the attention kernel's rows), no wider
        # than the graph's chunks
        tile_tokens = min(self.tile_tokens, 1 << (width - 1).bit_length())
        hidden_size = self.model.config.get_text_config().hidden_size
        self.static[width] = GraphInputs.allocate(
            width=width,
            big=sizes[-1],
            tile_tokens=tile_tokens,
            table_width=self.table_width,
            hidden_size=hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in reversed(sizes):
                batch = self._static_batch(width, b)
                self.model(batch)  # warm-up outside the graph (Triton compiles here)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.graph_pool, stream=stream):
                    logits = self.model(batch)
                self.graphs[width, b] = (graph, logits, batch.hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _static_batch(self, width: int, b: int) -> ForwardBatch:
        g = self.static[width]
        tokens = TokenColumns(*(row[: b * width] for row in g.tokens))
        *per_seq, state_slots = (row[:b] for row in g.seqs)
        tiles = b * g.tiles
        meta = PagedAttention(
            pool=self.pool,
            slot_mapping=tokens.slots,
            positions=tokens.positions,
            tile_seq=g.tile_seq[:tiles],
            tile_start=g.tile_start[:tiles],
            tile_len=g.tile_len[:tiles],
            block_tables=g.table[:b],
            **SeqColumns(*per_seq)._asdict(),
            tile_tokens=g.tile_tokens,
            use_triton=True,
        )
        groups = None if self.states is None else []  # none: a hybrid never verifies drafts
        if self.states is not None and width == 1:  # every row a sequence of one token
            groups = [(g.tile_seq[:b, None], PoolStates(self.states, state_slots))]
        return ForwardBatch(
            input_ids=tokens.ids,
            positions=tokens.positions,
            chunks=[],
            logits_rows=g.rows[: b * width],  # every row's logits
            rope_positions=tokens.rope_ids,
            chunk_ends=tokens.chunk_ends,
            state_groups=groups,
            keep_hidden=self.keep_hidden,
            prev_hidden=g.hidden[: b * width] if self.takes_hidden else None,
            attention=meta,
        )

    def _graph_for(self, chunks: list[ScheduledChunk], p: Packed) -> tuple[int, int] | None:
        """(width, batch size) of the graph that runs this step; None: it runs eagerly. Every
        chunk must sample (a one-token chunk cut from a prompt or a recompute, or an embedding
        prompt, samples nothing), all of them text, and fit the width."""
        if not self.graphs or p.images or p.explicit_rope or not all(c.samples for c in chunks):
            return None
        if not self.pool.calibrated:  # the eager step sets an FP8 pool's scales
            return None
        widest = max(c.num_tokens for c in chunks)
        return next(
            ((w, b) for w, b in sorted(self.graphs) if w >= widest and b >= len(chunks)), None
        )

    def _replay(self, p: Packed, width: int, size: int, chunks: list[ScheduledChunk]):
        """The step through its graph: (rows, V) logits, the plain chunks' last rows first, then
        every row of each speculative chunk (as the eager step's `rows` order them); and the
        graph's (T, H) hidden states with each chunk's (start, length) in them."""
        b, g = len(p.seqs), self.static[width]
        blocks_width = max(len(s.blocks) for s in p.seqs)
        # the per-token rows, the per-tile lengths, the per-sequence rows, then the block table
        host = array("q")
        for column, repeat in zip(p.token_columns(), PADDING_REPEATS, strict=True):
            host.extend(_padded(column, p.tiles, width, size, repeat))
        tt = g.tile_tokens
        for *_, n in p.tiles:  # a chunk shorter than the width leaves its last tiles empty
            host.extend(min(max(n - j * tt, 0), tt) for j in range(g.tiles))
        host.extend([0] * ((size - b) * g.tiles))
        pad = [0] * (size - b)
        for column in (*SeqColumns.of(p.seqs), p.state_slots):
            host.extend(column)
            host.extend(pad)
        for s in p.seqs:
            host.extend(s.blocks)
            host.extend([0] * (blocks_width - len(s.blocks)))
        host = torch.frombuffer(host, dtype=torch.long)
        n, tiles = len(TokenColumns._fields) * size * width, size * g.tiles
        g.tokens[:, : size * width].copy_(
            host[:n].view(len(TokenColumns._fields), -1), non_blocking=True
        )
        g.tile_len[:tiles].copy_(host[n : n + tiles], non_blocking=True)
        n += tiles
        g.seqs[:, :size].copy_(host[n : n + 6 * size].view(6, size), non_blocking=True)
        g.table[:b, :blocks_width].copy_(host[n + 6 * size :].view(b, -1), non_blocking=True)
        spans = [(s * width, c.num_tokens) for s, c in enumerate(chunks)]
        if self.takes_hidden:  # each chunk's rows at the start of its `width` rows
            rows = [s + i for s, n in spans for i in range(n)]
            index = torch.tensor(rows, device=self.device)
            g.hidden.index_copy_(0, index, self.hidden_in(chunks))
        graph, logits, hidden = self.graphs[width, size]
        graph.replay()
        if width == 1:
            return logits[:b], (hidden, spans)
        last = [s * width + c.num_tokens - 1 for s, c in enumerate(chunks) if not c.draft]
        verify = [
            s * width + i for s, c in enumerate(chunks) if c.draft for i in range(c.num_tokens)
        ]
        rows = torch.tensor(last + verify, device=logits.device)
        return logits.index_select(0, rows), (hidden, spans)


def build_batch(
    p: Packed, pool, tile_tokens: int, device, use_triton: bool, states: StatePool | None = None
) -> ForwardBatch:
    """The device batch of packed host lists, with one host->device copy of every index."""
    tiles = [
        (s, start + i, min(tile_tokens, n - i))
        for s, start, n in p.tiles
        for i in range(0, n, tile_tokens)
    ]
    width = max(len(s.blocks) for s in p.seqs)
    table = [s.blocks + [0] * (width - len(s.blocks)) for s in p.seqs]
    tile_columns = map(list, zip(*tiles, strict=False))
    rows = p.rows + p.verify_rows + p.pool_rows  # sampling rows first (Runner._forward)
    flat = [*p.token_columns(), rows, *tile_columns, *SeqColumns.of(p.seqs)]
    # recurrent-state groups: chunks of one length together (one-token chunks first), as (first
    # row, state slot) runs
    by_length = sorted(range(len(p.tiles)), key=lambda s: p.tiles[s][2]) if states else []
    flat += [[p.tiles[s][1] for s in by_length], [p.state_slots[s] for s in by_length]]
    # each part starts 16-byte aligned: Triton specializes kernels on pointer alignment
    padded = [part + [0] * (len(part) % 2) for part in flat]
    sizes = [len(x) for x in padded]
    host = array("q", [v for part in padded for v in part])
    for row in table:
        host.extend(row)
    dev = torch.frombuffer(host, dtype=torch.long).to(device, non_blocking=True)
    parts = [t[: len(f)] for t, f in zip(dev[: sum(sizes)].split(sizes), flat, strict=True)]
    tokens, parts = TokenColumns(*parts[:5]), parts[5:]
    (rows, tile_seq, tile_start, tile_len), parts = parts[:4], parts[4:]
    seqs, parts = SeqColumns(*parts[:5]), parts[5:]
    groups = None
    if states is not None:
        groups = state_groups(sorted(n for *_, n in p.tiles), states, *parts)
    meta = PagedAttention(
        pool=pool,
        slot_mapping=tokens.slots,
        positions=tokens.positions,
        tile_seq=tile_seq,
        tile_start=tile_start,
        tile_len=tile_len,
        block_tables=dev[sum(sizes) :].view(len(p.seqs), width),
        **seqs._asdict(),
        tile_tokens=tile_tokens,
        use_triton=use_triton,
    )
    rope = tokens.rope_ids
    if p.explicit_rope:  # multimodal prompt chunks: (3, T) M-RoPE ids
        rope = rope.expand(3, -1).clone()
        for start, chunk_ids in p.explicit_rope:
            rope[:, start : start + chunk_ids.shape[1]] = chunk_ids
    return ForwardBatch(
        input_ids=tokens.ids,
        positions=tokens.positions,
        chunks=[],
        logits_rows=rows,
        rope_positions=rope,
        images=ImageRows.packed(p.images, device),
        chunk_ends=tokens.chunk_ends,
        state_groups=groups,
        attention=meta,
    )


def state_groups(lengths: list[int], states: StatePool, starts, slots) -> list:
    """The recurrent layers' groups (layers/mamba.py): the chunks of each length together, their
    (b, m) rows and state slots sliced from the batch's one copy (`starts`, `slots`: per chunk,
    in the order of `lengths`, ascending)."""
    groups, i = [], 0
    for m, run in itertools.groupby(lengths):
        j = i + len(list(run))
        rows = starts[i:j, None] + torch.arange(m, device=starts.device)
        groups.append((rows, PoolStates(states, slots[i:j])))
        i = j
    return groups


# per TokenColumns column, whether a graph's padding rows repeat a chunk's last value (else 0)
PADDING_REPEATS = TokenColumns(
    ids=False, positions=True, slots=False, rope_ids=True, chunk_ends=True
)


def _padded(column: list[int], tiles, width: int, size: int, repeat: bool) -> list[int]:
    """A per-token column with each chunk (a tile: seq, start, n) padded to `width` rows and the
    batch to `size` chunks: padding repeats the chunk's last value (`repeat`) or is 0."""
    if width == 1:
        return column + [0] * (size - len(column))
    out = []
    for _, start, n in tiles:
        out += column[start : start + n]
        out += [column[start + n - 1] if repeat else 0] * (width - n)
    return out + [0] * ((size - len(tiles)) * width)


def _pending_ids(request: Request, n: int) -> list[int]:
    """The next n ids to feed, without copying the whole prompt + output (all_ids) per step."""
    start, prompt = request.num_computed, request.prompt_ids
    if start >= len(prompt):
        return request.output_ids[start - len(prompt) : start - len(prompt) + n]
    ids = prompt[start : start + n]
    return ids + request.output_ids[: n - len(ids)] if len(ids) < n else ids
