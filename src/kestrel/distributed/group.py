"""The tensor-parallel process group: which rank this process is, how many there are, and the two
collectives the parallel layers need. A process joins with the standard torch.distributed
rendezvous (`torchrun`'s RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or an explicit
init_method), over NCCL on CUDA and gloo on the CPU."""

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# how long leaving waits for the other ranks (NCCL's teardown is collective: one that is gone
# never arrives)
LEAVE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in a tensor-parallel group of `size` ranks."""

    rank: int
    size: int
    group: object = None  # the torch.distributed ProcessGroup (None: the default group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, in place."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (..., n) side by side along the last axis -> (..., size * n)."""
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def join(
    rank: int, size: int, device: torch.device, init_method: str = "env://", timeout_s: float = 60
) -> TPGroup:
    """Join the group of `size` ranks as `rank` (NCCL on CUDA, gloo elsewhere). A rank that
    does not arrive within `timeout_s` fails the others' collectives instead of hanging them."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )  # fmt: skip
    return TPGroup(rank, size)


def leave() -> None:
    """Destroy the process group. Every rank must call it, at about the same time: over NCCL
    the teardown is collective, and a rank that leaves alone waits for the others (up to
    LEAVE_TIMEOUT_S; then this process goes on without it)."""
    if not dist.is_initialized():
        return
    teardown = threading.Thread(target=dist.destroy_process_group, daemon=True)
    teardown.start()
    teardown.join(LEAVE_TIMEOUT_S)
    if teardown.is_alive():
        log.warning(
            "the other ranks did not leave the process group within %.0f s", LEAVE_TIMEOUT_S
        )
