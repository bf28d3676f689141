"""The host tier's storage (--kv-offloading-size): per layer K and V of `num_slots` blocks in host
memory, shaped as the device pool's blocks, and the copies between them (cache/host_tier.py says
which and when).

On CUDA the host blocks are pinned and the copies run on a side stream, in the order given; the
compute stream waits for them with an event before its next forward, so the host thread never
waits on a copy and decode keeps its pace. On the CPU they are plain tensors and copies run at once.
"""

import torch

from kestrel.cache.host_tier import BlockCopy
from kestrel.cache.paged import BlockPool

GIB = 2**30


class HostPool:
    """Host blocks for a `BlockPool`'s layers (the layers that store keys; values too where the
    pool has them). An FP8 pool's blocks are copied as stored: its scales are per layer and fixed,
    so a block read back is read with the scales it was written with."""

    def __init__(self, pool: BlockPool, num_slots: int):
        self.pool, self.num_slots = pool, num_slots
        device = _device_of(pool)
        pin = device.type == "cuda"

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.empty((num_slots, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

        self.k = [host(t) for t in pool.k]
        self.v = [host(t) for t in pool.v]
        self.stream = torch.cuda.Stream(device) if pin else None
        self.done = torch.cuda.Event() if pin else None

    @classmethod
    def sized(cls, pool: BlockPool, gib: float) -> "HostPool":
        """As many host blocks as `gib` GiB holds (all layers' K and V of one block each)."""
        per_block = BlockPool.bytes_per_block(pool.layout, pool.block_size, pool.dtype)
        slots = int(gib * GIB // max(per_block, 1))  # no KV layers (a pipeline stage): any count
        if slots < 1:
            raise ValueError(
                f"--kv-offloading-size {gib} GiB holds no KV block ({per_block / 2**20:.1f} MiB "
                "each); raise it or leave it at 0 (off)"
            )
        return cls(pool, slots)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def apply(self, copies: list[BlockCopy]) -> None:
        """Run `copies` in order: on CUDA on the side stream, after the work already queued (the
        keys evicted blocks hold were written by earlier steps), with the compute stream waiting
        for them before anything it queues next (a reused block's new keys, a restored block's
        reads)."""
        if not copies:
            return
        if self.stream is None:
            for copy in copies:
                self._copy(copy, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            for copy in copies:
                self._copy(copy, non_blocking=True)
            self.done.record(self.stream)
        compute.wait_event(self.done)

    def _copy(self, copy: BlockCopy, non_blocking: bool) -> None:
        for device, host in zip(self.pool.k + self.pool.v, self.k + self.v, strict=True):
            if device is None:
                continue
            if copy.to_host:
                host[copy.slot].copy_(device[copy.block], non_blocking=non_blocking)
            else:
                device[copy.block].copy_(host[copy.slot], non_blocking=non_blocking)


def _device_of(pool: BlockPool) -> torch.device:
    stored = [t for t in pool.k if t is not None]
    return stored[0].device if stored else torch.device("cpu")
