"""The KV hand-off seam of disaggregated prefill and decode: one request's KV blocks and what
goes with them, moved from the prefill engine's process to the decode engine's.

`KVTransfer` joins a two-rank torch.distributed group (rank 0: prefill, rank 1: decode) and
moves a `KVHandoff` with point-to-point sends: NCCL between two GPUs, gloo otherwise (the CPU,
or both roles on one GPU, where NCCL cannot pair two ranks; gloo then carries the blocks
through host memory). A hand-off crosses as three messages, in order: a header (the sizes of
the next two), the metadata (a pickle) and the payload (every block tensor's bytes, one
buffer), so the blocks arrive bit-exact whatever their dtype (FP8 included).

`send` does not block: the prefill engine goes on with its next step while the blocks travel,
and the buffers are kept until their sends complete. `recv` blocks, and the decode side calls
it only when told a hand-off was sent (the router forwards the prefill's "handoff" output), so
it never waits for one that is not coming.

A network transport (NIXL or Mooncake, as vLLM's and SGLang's P/D use, reading the prefill
pool's blocks over RDMA) plugs in here: a class with the same `send(KVHandoff)` /
`recv(expect) -> KVHandoff` / `close()`; the engines' roles (distributed/disaggregated.py) and
the router do not change.
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("kestrel.kv_transfer")

PREFILL_RANK, DECODE_RANK = 0, 1


class KVTransferError(RuntimeError):
    """A hand-off that cannot be delivered as sent (the wrong request, a layout the receiving
    pool does not have, a peer that is gone)."""


@dataclass
class KVHandoff:
    """One request's KV as it leaves the prefill pool: per layer K then V of its held blocks
    in table order ((n, block_size, Hkv, D) each; None for a layer that stores none), and
    `meta` (small, picklable: the first token, the offset, the logical block ids, ...)."""

    request_id: str
    blocks: list[torch.Tensor | None]
    meta: dict = field(default_factory=dict)

    def layout(self) -> list[tuple | None]:
        """(shape, dtype name) of each block tensor: what the receiver allocates."""
        return [None if t is None else (tuple(t.shape), str(t.dtype)) for t in self.blocks]


def choose_backend(device: torch.device, peer: torch.device) -> str:
    """NCCL between two different GPUs; gloo for the CPU and for two ranks on one GPU."""
    if device.type == "cuda" and peer.type == "cuda" and device != peer:
        return "nccl"
    return "gloo"


class KVTransfer:
    """This process's end of the hand-off group: `rank` 0 (prefill) sends, 1 (decode)
    receives; `device` is where this side's pool lives."""

    def __init__(self, rank: int, device: torch.device, backend: str):
        self.rank, self.peer = rank, 1 - rank
        self.device = device
        self.backend = backend
        # what travels: device tensors over NCCL, host tensors over gloo
        self.wire = device if backend == "nccl" else torch.device("cpu")
        # sends not known complete yet, as (works, their buffers): a thread waits on each in
        # turn (gloo tells a send's completion only to its wait) and drops its buffers
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._unfinished = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._finish_sends, name="kestrel-kv-send", daemon=True).start()

    @classmethod
    def join(
        cls,
        rank: int,
        device: torch.device,
        peer_device: torch.device,
        init_method: str,
        timeout_s: float = 600.0,
    ) -> KVTransfer:
        """Join the two-rank group at `init_method` (e.g. tcp://127.0.0.1:PORT) and exchange
        one message, so that NCCL's communicator exists before the first hand-off (its lazy
        creation would block a sender whose receiver is not yet listening)."""
        backend = choose_backend(device, peer_device)
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=2,
            timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
        transfer = cls(rank, device, backend)
        hello = torch.zeros(1, dtype=torch.int64, device=transfer.wire)
        if rank == PREFILL_RANK:
            dist.send(hello + 1, DECODE_RANK)
        else:
            dist.recv(hello, PREFILL_RANK)
        return transfer

    # -- prefill side ---------------------------------------------------------------------------

    def send(self, handoff: KVHandoff) -> None:
        """Start sending `handoff` (non-blocking; its buffers live until the sends complete)."""
        meta = dict(handoff.meta, request_id=handoff.request_id, layout=handoff.layout())
        meta_bytes = _as_bytes(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        payload = _pack([t for t in handoff.blocks if t is not None]).to(self.wire)
        header = torch.tensor([meta_bytes.numel(), payload.numel()], dtype=torch.int64)
        buffers = [header.to(self.wire), meta_bytes.to(self.wire), payload]
        with self._lock:
            self._unfinished += 1
        self._sends.put(([dist.isend(buffer, self.peer) for buffer in buffers], buffers))

    def in_flight(self) -> int:
        """Hand-offs whose sends have not completed yet."""
        with self._lock:
            return self._unfinished

    def _finish_sends(self) -> None:
        """Wait for each hand-off's sends, in order; a failed one is logged (its receiver
        then fails on its own)."""
        while True:
            works, buffers = self._sends.get()
            try:
                for work in works:
                    self._finish(work)
            except Exception:
                log.exception("a KV hand-off send failed")
            del buffers
            with self._lock:
                self._unfinished -= 1

    def _finish(self, work) -> None:
        """Return once `work` completed. NCCL's is polled: its wait would make this thread's
        stream (the device's default, the engine's) wait for the receiver."""
        if self.backend != "nccl":
            work.wait()
            return
        while not work.is_completed():
            time.sleep(0.0005)

    # -- decode side ----------------------------------------------------------------------------

    def recv(self, expect: str | None = None) -> KVHandoff:
        """The next hand-off (blocking), its blocks on this side's device; `expect`: the
        request id it must be for (hand-offs arrive in the order they were sent)."""
        header = torch.zeros(2, dtype=torch.int64, device=self.wire)
        dist.recv(header, self.peer)
        meta_size, payload_size = header.tolist()
        meta_bytes = torch.empty(meta_size, dtype=torch.uint8, device=self.wire)
        dist.recv(meta_bytes, self.peer)
        payload = torch.empty(payload_size, dtype=torch.uint8, device=self.wire)
        dist.recv(payload, self.peer)
        meta = pickle.loads(meta_bytes.cpu().numpy().tobytes())  # only ever our prefill's
        request_id, layout = meta.pop("request_id"), meta.pop("layout")
        if expect is not None and request_id != expect:
            raise KVTransferError(
                f"expected the KV of request {expect!r}, received that of {request_id!r}"
            )
        blocks = _unpack(payload.to(self.device), layout)
        return KVHandoff(request_id, blocks, meta)

    def close(self) -> None:
        """Leave the group (this side's process is ending)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def _as_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every tensor's bytes, one after another: (total bytes,) uint8."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unpack(payload: torch.Tensor, layout: list[tuple | None]) -> list[torch.Tensor | None]:
    """The tensors `_pack` joined, by their (shape, dtype name) (None stays None)."""
    entries = [
        None if e is None else (e[0], getattr(torch, e[1].removeprefix("torch."))) for e in layout
    ]
    sizes = [0 if e is None else torch.Size(e[0]).numel() * e[1].itemsize for e in entries]
    if sum(sizes) != payload.numel():
        raise KVTransferError(f"the payload has {payload.numel()} bytes, its layout {sum(sizes)}")
    out, at = [], 0
    for entry, size in zip(entries, sizes, strict=True):
        out.append(None if entry is None else payload[at : at + size].view(entry[1]).view(entry[0]))
        at += size
    return out
