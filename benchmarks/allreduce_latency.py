"""The all-reduce of one decode token's hidden state on two GPUs: NCCL (`dist.all_reduce`, what
tensor parallel uses) against a one-shot all-reduce over torch's symmetric memory (peer-to-peer
loads, no NVLink multicast), each inside a CUDA graph as in decode. Prints one JSON line of
microseconds per all-reduce, and whether both sums are equal.

    python benchmarks/allreduce_latency.py     # needs two GPUs

Why: `-tp 2` decodes Llama-3.1-8B only 1.21x faster than one GPU (docs/performance/h200.md); its step
does 64 of these all-reduces. Not yet run: written for the next session with two GPUs.
"""

import json
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTHS = (4096, 8192)  # Llama-3.1-8B's and -70B's hidden size


def timed(fn, iters: int = 64, replays: int = 5) -> float:
    """Microseconds per call, from `replays` replays of a graph of `iters` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters / replays


def one_shot(x: torch.Tensor):
    """A function that sums x over the ranks into a new tensor, through symmetric memory."""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    shared = symm_mem.empty(*x.shape, device=x.device, dtype=x.dtype)
    symm_mem.rendezvous(shared, group)
    out = torch.empty_like(x)

    def reduce() -> torch.Tensor:
        shared.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(shared, "sum", group, out)
        return out

    return reduce


def rank_main(rank: int, port: int) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl", init_method=address, rank=rank, world_size=2, device_id=device)
    row = {}
    for width in WIDTHS:
        x = torch.randn(1, width, device=device, dtype=torch.bfloat16)
        row[f"nccl_{width}_us"] = round(timed(lambda x=x: dist.all_reduce(x.clone())), 2)
        try:
            reduce = one_shot(x)
            row[f"one_shot_{width}_us"] = round(timed(reduce), 2)
            want = x.clone()
            dist.all_reduce(want)
            row[f"one_shot_{width}_equal"] = torch.equal(reduce(), want)
        except Exception as error:  # noqa: BLE001 (report it: this torch may not have the op)
            row[f"one_shot_{width}_error"] = f"{type(error).__name__}: {error}"[:300]
    if rank == 0:
        print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2, join=True)


if __name__ == "__main__":
    main()
