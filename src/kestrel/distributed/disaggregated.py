"""Disaggregated prefill and decode (`kestrel serve --disaggregate`): two engines of one model,
each in a process of its own and on a device of its own, so that long prompts never stall the
decode steps of running requests (SGLang's and vLLM's P/D, on one machine).

- The prefill engine runs a request's prompt and samples its first token, then finishes it with
  the finish reason "handoff" (`Request.handoff`) and sends its KV blocks, with the first
  token, the offset and the block table's logical ids, to the decode engine (`PrefillRole`).
- The decode engine receives them into its own pool: it takes a block for each, writes the K/V
  and the block table, and queues the request as one whose prompt is computed, so it decodes
  from the first token on (`DecodeRole`). If its pool has no room, the request is recomputed
  there from its prompt and first token, as after a preemption: same tokens, more work.
- The router (server/pd_router.py) pairs them behind the one endpoint: every request goes to
  the prefill engine; on its "handoff" output the router streams the first token and hands the
  request to the decode engine, which tells it to receive (distributed/kv_transfer.py).

`build_role` builds one role's Engine in its process: the model on the role's device, then the
two-rank transfer group joined. Models whose cache the paged pool holds are served; recurrent
state (hybrid models) does not travel yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from kestrel.cache.blocks import KVPoolExhaustedError
from kestrel.config import Config, SpeculativeConfig
from kestrel.distributed.kv_transfer import (
    DECODE_RANK,
    PREFILL_RANK,
    KVHandoff,
    KVTransfer,
    KVTransferError,
)
from kestrel.engine.engine import Engine
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.request import Request
from kestrel.engine.scheduler import SchedulerOutput
from kestrel.errors import KestrelError
from kestrel.loading import resolve_device

log = logging.getLogger("kestrel.disaggregated")

PREFILL, DECODE = "prefill", "decode"


def role_devices(config: Config) -> dict[str, torch.device]:
    """Each role's device: --prefill-device / --decode-device, else --device's; decode on the
    next GPU when there is one."""
    parallel = config.parallel
    prefill = _indexed(resolve_device(parallel.prefill_device or config.model.device))
    if parallel.decode_device:
        decode = _indexed(resolve_device(parallel.decode_device))
    elif prefill.type == "cuda" and torch.cuda.device_count() > 1:
        decode = torch.device("cuda", (prefill.index + 1) % torch.cuda.device_count())
    else:
        decode = prefill
    return {PREFILL: prefill, DECODE: decode}


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:0, so that two names of one GPU compare equal."""
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def shares_gpu(devices: dict[str, torch.device]) -> bool:
    return devices[PREFILL] == devices[DECODE] and devices[PREFILL].type == "cuda"


def role_config(config: Config, role: str, devices: dict[str, torch.device]) -> Config:
    """The role's engine config: its device; the prefill engine drafts nothing (it never
    decodes). Both on one GPU, the prefill engine takes half of --gpu-memory-utilization and
    the decode engine, sized after it, the rest."""
    model = replace(config.model, device=str(devices[role]))
    speculation = config.speculation if role == DECODE else SpeculativeConfig()
    cache = config.cache
    if role == PREFILL and shares_gpu(devices):
        cache = replace(cache, gpu_memory_utilization=cache.gpu_memory_utilization / 2)
    return replace(config, model=model, speculation=speculation, cache=cache)


def build_role(
    build_engine: Callable[[Config, str], Engine],
    config: Config,
    log_level: str,
    role: str,
    init_method: str,
) -> Engine:
    """One role's Engine (in its own process): `build_engine(config, log_level)` on the role's
    device, then the hand-off group joined at `init_method` (both roles must get there)."""
    devices = role_devices(config)
    peer = DECODE if role == PREFILL else PREFILL
    rank = PREFILL_RANK if role == PREFILL else DECODE_RANK

    def join() -> KVTransfer:
        return KVTransfer.join(rank, devices[role], devices[peer], init_method)

    def build() -> Engine:
        engine = build_engine(role_config(config, role, devices), log_level)
        check_servable(engine)
        return engine

    if role == DECODE and shares_gpu(devices):
        # the pools are sized from free memory: the decode engine's after the prefill
        # engine's (which joins only once built), from what that one left
        transfer = join()
        engine = build()
    else:
        engine = build()
        transfer = join()
    log.info("%s engine on %s; KV hand-off over %s", role, devices[role], transfer.backend)
    engine.role = PrefillRole(transfer) if role == PREFILL else DecodeRole(transfer)
    return engine


def check_servable(engine: Engine) -> None:
    """KestrelError unless the engine's KV lives in the paged pool and nothing else does."""
    runner = engine.runner
    if not isinstance(runner, PagedRunner) or runner.states is not None:
        raise KestrelError(
            "--disaggregate hands KV blocks from the prefill engine to the decode engine: "
            "this model's cache is not all in the paged pool (recurrent state, or a cache "
            "kind the pool does not hold)"
        )


class PrefillRole:
    """The prefill engine's side: a request runs as any other up to its first token; then its
    blocks leave for the decode engine (before they go back to this pool)."""

    def __init__(self, transfer: KVTransfer):
        self.transfer = transfer

    def admit(self, engine: Engine, request: Request) -> None:
        """Nothing to do: it prefills here."""

    def hand_off(self, engine: Engine, request: Request) -> None:
        runner: PagedRunner = engine.runner
        table = engine.scheduler.blocks.table(request.request_id)
        logical, blocks = [lg for lg, _ in table.held], runner.export_blocks(table.held)
        meta = {
            "first_token": request.output_ids[0],
            "offset": request.num_computed,
            "logical": logical,
            "live_start": table.live_start,
            "keep": table.keep,
            "full_view_until": table.full_view_until,
            "num_cached_tokens": request.num_cached_tokens,
            "scales": _scales(runner),
            "generator": _generator_state(runner, request.request_id),
        }
        self.transfer.send(KVHandoff(request.request_id, blocks, meta))


class DecodeRole:
    """The decode engine's side: a request handed to it brings its KV (received here, into
    this pool) and its first token; it decodes from there to its end."""

    def __init__(self, transfer: KVTransfer):
        self.transfer = transfer

    def admit(self, engine: Engine, request: Request) -> None:
        handoff = self.transfer.recv(expect=request.request_id)
        meta = handoff.meta
        request.handoff = False  # taken over: it finishes here
        request.output_ids = [meta["first_token"]]
        request.num_cached_tokens = meta["num_cached_tokens"]
        _catch_up_text(engine, request)
        _restore_generator(engine.runner, request, meta["generator"])
        try:
            self._import(engine, request, handoff)
        except KVPoolExhaustedError:
            log.warning("no room for the KV of %s: recomputed here", request.request_id)

    def hand_off(self, engine: Engine, request: Request) -> None:
        raise AssertionError("the decode engine hands nothing off")

    def _import(self, engine: Engine, request: Request, handoff: KVHandoff) -> None:
        runner: PagedRunner = engine.runner
        _check_layout(runner, handoff.blocks)
        meta = handoff.meta
        table = engine.scheduler.adopt(request.request_id, meta["logical"])
        # blocks the host tier took these from leave for host memory before they are written
        runner.step(SchedulerOutput([], host_copies=engine.scheduler.blocks.take_copies()))
        runner.import_blocks(table.held, handoff.blocks)
        table.live_start, table.keep = meta["live_start"], meta["keep"]
        table.full_view_until = meta["full_view_until"]
        if meta["scales"] is not None:  # FP8: the blocks are read with the scales they had
            _set_scales(runner, meta["scales"])
        request.num_computed = meta["offset"]


def _check_layout(runner: PagedRunner, blocks: list) -> None:
    """KVTransferError unless the blocks fit this pool's layers (the same model, block size and
    KV dtype on both sides)."""
    stores = runner.pool.k + runner.pool.v
    fits = len(blocks) == len(stores) and all(
        (s is None) == (b is None) and (s is None or s.shape[1:] == b.shape[1:])
        for s, b in zip(stores, blocks, strict=False)
    )
    if not fits:
        raise KVTransferError(
            "the prefill engine's KV blocks do not fit the decode engine's pool (the two "
            "must run the same model with the same --block-size and --kv-cache-dtype)"
        )


def _catch_up_text(engine: Engine, request: Request) -> None:
    """The decode engine's detokenizer and stop-string matcher take in the first token, and
    count as streamed what the prefill engine streamed of it (the same computation)."""
    state = engine.text[request.request_id]
    state.matcher.feed(state.detokenizer.push(request.output_ids[0]))
    state.emitted = len(state.matcher.streamable(False))


def _scales(runner: PagedRunner) -> list | None:
    """An FP8 pool's per-layer K and V scales (host copies); None for any other pool."""
    pool = runner.pool
    if pool.dtype != torch.float8_e4m3fn:
        return None
    return [None if s is None else s.cpu() for s in pool.k_scale + pool.v_scale]


def _set_scales(runner: PagedRunner, scales: list) -> None:
    pool = runner.pool
    for store, scale in zip(pool.k_scale + pool.v_scale, scales, strict=True):
        if store is not None:
            store.copy_(scale)
    pool.calibrated = True


def _generator_state(runner: PagedRunner, request_id: str) -> tuple[str, torch.Tensor] | None:
    """A seeded request's sampler state after its first draw: (device type, state)."""
    generator = runner.sampler.generators.get(request_id)
    return None if generator is None else (generator.device.type, generator.get_state())


def _restore_generator(runner: PagedRunner, request: Request, saved) -> None:
    """Its next draws go on from where the prefill engine's left off (a generator's state
    moves only between devices of one type; across types the seed starts over)."""
    generator = runner.sampler.generator(request)
    if generator is not None and saved is not None and saved[0] == generator.device.type:
        generator.set_state(saved[1])
