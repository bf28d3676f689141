"""Where a `kestrel bench` workload's time goes: wall time per kind of step (prefill-only, mixed,
decode-only) and, for one step of each kind, the GPU kernels that took longest (torch.profiler).

    python benchmarks/profile_steps.py --shape nemotron-h-8b --num-requests 64 --output-tokens 32

Takes the `kestrel bench` flags; prints one JSON line per step kind, then the kernel tables.
"""

import argparse
import json
import time
from collections import defaultdict
from contextlib import nullcontext

import torch

from kestrel.bench.offline import add_bench_args, bench_config, load_model, make_kestrel_runner
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler
from kestrel.flags import add_engine_args
from kestrel.sampling import SamplingParams


def step_kind(plan) -> str:
    decode = sum(1 for c in plan.chunks if c.num_tokens == 1)
    if decode == len(plan.chunks):
        return "decode"
    return "prefill" if decode == 0 else "mixed"


def kernel_table(prof, rows: int) -> str:
    """The `rows` kernels that took longest, under a line counting every kernel launched."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time_total for e in events)
    span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
    return f"{len(events)} kernels, busy {busy:.0f} us of a {span:.0f} us span\n{table}"


def main() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_bench_args(p)
    p.add_argument("--table-rows", type=int, default=20, help="kernels listed per step kind")
    args = p.parse_args()
    if args.max_batched_tokens is None:
        args.max_batched_tokens = 8192
    device = torch.device("cuda")
    model, config, _ = load_model(args, device, torch.bfloat16)
    n = args.num_requests
    runner = make_kestrel_runner(args, model, config, device, args.max_num_seqs)
    conf = bench_config(args, args.max_num_seqs)
    scheduler = Scheduler(conf.scheduler, runner.kv_memory(None))
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(0, 1000, (args.prompt_tokens,), generator=g).tolist()
        scheduler.add(Request(f"p{i}", prompt, params, args.output_tokens))
    times, profiled = defaultdict(list), {}
    while scheduler.has_work():
        plan = scheduler.schedule()
        kind = step_kind(plan)
        profile = kind not in profiled and len(times[kind]) == 2  # the third of its kind
        torch.cuda.synchronize()
        start = time.perf_counter()
        cuda = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=cuda) if profile else nullcontext() as prof:
            results = runner.step(plan)
            torch.cuda.synchronize()
        if profile:
            profiled[kind] = kernel_table(prof, args.table_rows)
        times[kind].append((time.perf_counter() - start, sum(c.num_tokens for c in plan.chunks)))
        scheduler.computed(plan.chunks, set())
        for result in results:
            if result.token is not None:
                result.request.output_ids.append(result.token)
                if len(result.request.output_ids) >= result.request.max_tokens:
                    result.request.finish("length")
        for request in scheduler.remove_finished():
            runner.release(request.request_id)
    for kind, steps in times.items():
        total = sum(t for t, _ in steps)
        tokens = sum(k for _, k in steps)
        each = [round(t, 3) for t, _ in steps[:12]]  # the first steps pay for compiling
        print(
            json.dumps(dict(kind=kind, steps=len(steps), seconds=total, tokens=tokens, each=each))
        )
    for kind, table in profiled.items():
        print(f"--- {kind} step ---\n{table}")


if __name__ == "__main__":
    main()
