"""KV hand-off time of disaggregated prefill and decode, per 1,000 prompt tokens: a prefill
engine and a decode engine of one shape (random weights), each in its own process on its own
device, hand over a request's KV blocks through the real roles (distributed/disaggregated.py)
and transfer (distributed/kv_transfer.py: NCCL between two GPUs, gloo otherwise).

    python benchmarks/kv_handoff.py --shape llama3-8b --prefill-device cuda:0 \
        --decode-device cuda:1 --tokens 1024 4096
    python benchmarks/kv_handoff.py --shape llama3-8b --prefill-device cuda:0 \
        --decode-device cuda:0 --tokens 1024 4096          # both roles on one GPU (gloo)
    python benchmarks/kv_handoff.py --shape tiny --prefill-device cpu --decode-device cpu

The hand-off is timed from the prefill engine's first token (the blocks still in its pool) to
the blocks written in the decode engine's pool (the decode side waits in its receive, so no
routing time is counted). The peer in the same run is what the hand-off saves: the prefill of
those tokens, which a decode engine without the blocks would recompute. One JSON line per
prompt length (the median of --repeats), also appended to --out.
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp


def config_for(args, device: str):
    from kestrel.config import build_config

    block = 64
    return build_config(
        shape=args.shape,
        device=device,
        dtype=args.dtype,
        ctx_size=max(args.tokens) + block,
        max_num_seqs=1,
        prefill_chunk_size=max(args.tokens),
        num_blocks=max(args.tokens) // block + 4,  # fixed: two roles may share one GPU
        block_size=block,
        prefix_caching=False,  # every repeat prefills again
        cuda_graphs=False,
    )


def prompt(tokens: int, rep: int) -> list[int]:
    return [(i * 7 + rep) % 200 + 10 for i in range(tokens)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_main(args, init_method: str, clock) -> None:
    """Prefill each prompt and hand it off; `clock` gets (prefill seconds, hand-off start)."""
    from kestrel.distributed.disaggregated import PrefillRole
    from kestrel.distributed.kv_transfer import PREFILL_RANK, KVTransfer
    from kestrel.llm import load_engine
    from kestrel.sampling import SamplingParams

    engine, _ = load_engine(config_for(args, args.prefill_device), progress=False)
    device = engine.device

    class TimedPrefill(PrefillRole):
        def hand_off(self, engine, request):
            sync(device)
            self.handed = time.perf_counter()
            super().hand_off(engine, request)

    transfer = KVTransfer.join(PREFILL_RANK, device, torch.device(args.decode_device), init_method)
    engine.role = role = TimedPrefill(transfer)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for tokens in [args.tokens[0], *args.tokens]:  # the first: a warm-up
        for rep in range(args.repeats):
            request = engine.add_request(f"p{tokens}-{rep}", prompt(tokens, rep), params)
            request.handoff = True
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            clock.put((role.handed - start, role.handed))
    while transfer.in_flight():
        time.sleep(0.01)
    transfer.close()


def decode_main(args, init_method: str, clock, results) -> None:
    """Receive each hand-off into the pool, decode a token from it, time the hand-off."""
    from kestrel.distributed.disaggregated import DecodeRole
    from kestrel.distributed.kv_transfer import DECODE_RANK, KVTransfer
    from kestrel.llm import load_engine
    from kestrel.sampling import SamplingParams

    engine, _ = load_engine(config_for(args, args.decode_device), progress=False)
    device = engine.device
    transfer = KVTransfer.join(DECODE_RANK, device, torch.device(args.prefill_device), init_method)
    engine.role = DecodeRole(transfer)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for index, tokens in enumerate([args.tokens[0], *args.tokens]):
        runs = []
        for rep in range(args.repeats):
            request = engine.intake.build(f"p{tokens}-{rep}", prompt(tokens, rep), params)
            request.handoff = True
            engine.add(request)  # receives its KV into the pool
            sync(device)
            landed = time.perf_counter()
            prefill_s, handed = clock.get()
            runs.append((landed - handed, prefill_s))
            while engine.has_unfinished():
                engine.step()  # it decodes from the received blocks
        if index:
            results.put((tokens, runs, transfer.backend, bytes_per_token(engine)))
    results.put(None)
    transfer.close()


def bytes_per_token(engine) -> int:
    pool = engine.runner.pool
    stores = [t for t in pool.k + pool.v if t is not None]
    return sum(t[0, 0].numel() * t.element_size() for t in stores)


def record(args, tokens, runs, backend, per_token) -> dict:
    handoff = statistics.median(r[0] for r in runs)
    prefill = statistics.median(r[1] for r in runs)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "command": " ".join(["python", *sys.argv]),
        "shape": args.shape,
        "prefill_device": device_name(args.prefill_device),
        "decode_device": device_name(args.decode_device),
        "device": machine(args),
        "backend": backend,
        "tokens": tokens,
        "kv_bytes": per_token * tokens,
        "handoff_ms": round(handoff * 1e3, 3),
        "handoff_ms_per_1k_tokens": round(handoff * 1e3 * 1000 / tokens, 3),
        "handoff_gb_s": round(per_token * tokens / handoff / 1e9, 2),
        "prefill_ms": round(prefill * 1e3, 3),  # the peer: recomputing instead
        "handoff_vs_prefill": round(handoff / prefill, 3),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "commit": os.environ.get("KESTREL_COMMIT") or git.stdout.strip(),
    }


def machine(args) -> str:
    """The card, or the CPU and its core count."""
    if "cuda" in args.prefill_device + args.decode_device and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    return f"cpu: {model or platform.processor()} ({os.cpu_count()} cores)"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:1")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="a JSONL file to append the records to")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    clock, results = ctx.Queue(), ctx.Queue()
    roles = [
        ctx.Process(target=prefill_main, args=(args, init_method, clock)),
        ctx.Process(target=decode_main, args=(args, init_method, clock, results)),
    ]
    for process in roles:
        process.start()
    while (result := results.get()) is not None:
        line = json.dumps(record(args, *result))
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    for process in roles:
        process.join()


if __name__ == "__main__":
    main()
