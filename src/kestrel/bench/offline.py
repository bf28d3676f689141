"""`kestrel bench`: offline throughput and single-stream latency, with the peer in the same run.

Models are a real checkpoint (`-m`) or random weights of a named shape (`--shape llama3-8b`).
Each measurement prints one JSON line (engine, shape, numbers, its roofline ceiling, command, GPU,
commit). Offline runs drive the scheduler and runner directly, ignoring EOS, with no detokenizer
(the peer's batch API does not detokenize either). `kestrel bench serve --url` measures an
OpenAI-compatible server under concurrent streaming clients (bench_serve.py).
"""

import contextlib
import gc
import json
import os
import subprocess
import sys
import time

import torch

from kestrel.bench.roofline import card_rates, ceilings, meta_model, of_ceiling
from kestrel.bench.serve import add_serve_bench_args
from kestrel.bench.workload import Workload
from kestrel.config import DRAFT_METHODS
from kestrel.weights.shapes import (
    decoder_config,
    random_model,
    randomize,
    shape_config,
    shape_tokenizer,
)


def source_name(model: str) -> str:
    from kestrel.weights.loader import resolve

    return resolve(model).name


def load_model(args, device, dtype):
    """(model, config, label): random weights of --shape, or the checkpoint of -m."""
    from kestrel.weights.loader import QUANTIZED_WEIGHTS, resolve
    from kestrel.weights.loader import load_model as load_checkpoint

    mtp = args.speculative == "mtp"  # with the multi-token-prediction layer that proposes
    if args.shape:
        model, config = random_model(args.shape, dtype, device, args.seed, mtp=mtp)
        return model, config, args.shape
    source = resolve(args.model)
    packed = QUANTIZED_WEIGHTS[args.quantized_weights]
    model = load_checkpoint(source, dtype, device, not args.no_progress, packed, mtp=mtp)
    return model, model.config, source.name


def environment(device) -> dict:
    commit = os.environ.get("KESTREL_COMMIT") or _git_commit()  # a copy's git may be stale
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {
        "command": "kestrel " + " ".join(sys.argv[1:]),
        "gpu": gpu,
        "device": str(device),
        "commit": commit,
        "torch": torch.__version__,
    }


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- kestrel ------------------------------------------------------------------------------------


def bench_config(args, max_num_seqs: int):
    """The engine flags' Config at this concurrency, every request queued at once."""
    from kestrel.config import config_from_args

    return config_from_args(args, max_num_seqs=max_num_seqs, max_queue_depth=1 << 30)


def make_kestrel_runner(args, model, config, device, max_num_seqs: int):
    from kestrel.engine.paged_runner import make_runner

    ctx = args.ctx_size or getattr(decoder_config(config), "max_position_embeddings", 4096)
    return make_runner(model, device, bench_config(args, max_num_seqs), ctx)


def drive(runner, prompts, outputs, args, max_num_seqs: int, progress: bool) -> dict:
    """Run every request to its output length through scheduler + runner; timings per request."""
    from tqdm import tqdm

    from kestrel.engine.request import Request
    from kestrel.engine.runner import run_step
    from kestrel.engine.scheduler import Scheduler
    from kestrel.engine.speculative import make_proposer
    from kestrel.sampling import SamplingParams

    config = bench_config(args, max_num_seqs)
    scheduler = Scheduler(config.scheduler, runner.kv_memory(config.scheduler.kv_capacity))
    if runner.speculates:
        scheduler.proposer = make_proposer(config.speculation)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=None)
    requests = [
        Request(f"b{i}", p, params, o, config.cache.max_kv_size, config.cache.keep)
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]
    for r in requests:
        scheduler.add(r)
    first, bar = {}, tqdm(total=sum(outputs), disable=not progress, unit="tok", leave=False)
    start = time.perf_counter()
    while scheduler.has_work():
        for res in run_step(scheduler, runner):
            if res.error is not None:
                raise res.error
            if res.token is None:
                continue
            req = res.request
            tokens = (res.tokens or [res.token])[: req.max_tokens - len(req.output_ids)]
            req.output_ids += tokens
            first.setdefault(req.request_id, time.perf_counter())
            bar.update(len(tokens))
            if len(req.output_ids) >= req.max_tokens:
                req.finish("length")
        for req in scheduler.remove_finished():
            runner.release(req.request_id)
    elapsed = time.perf_counter() - start
    bar.close()
    ttft = sorted(first[r.request_id] - start for r in requests)
    return {
        "elapsed_s": elapsed,
        "output_tokens": sum(len(r.output_ids) for r in requests),
        "ttft_s": ttft,
        "tokens": [r.output_ids for r in requests],
        **speculation(scheduler.num_draft_tokens, scheduler.num_accepted_tokens),
    }


def speculation(drafted: int, accepted: int) -> dict:
    """Speculative decoding's counts and acceptance rate (nothing when it proposed nothing)."""
    if not drafted:
        return {}
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted,
    }


def kestrel_latency(args, runner, work: Workload) -> dict:
    prompts, outputs = work.prompts(args.vocab), work.outputs()
    drive(runner, prompts, [2], args, 1, False)  # warm-up (kernels compiled)
    ttft = drive(runner, prompts, [1], args, 1, False)["elapsed_s"]
    full = drive(runner, prompts, outputs, args, 1, not args.no_progress)
    # the tokens after the first over the time after it, both from the same run
    decode = (outputs[0] - 1) / max(full["elapsed_s"] - full["ttft_s"][0], 1e-9)
    spec = {k: full[k] for k in ("draft_tokens", "accepted_tokens", "acceptance_rate") if k in full}
    return {"ttft_s": ttft, "decode_tok_s": decode, "total_s": full["elapsed_s"], **spec}


def kestrel_throughput(args, runner, work: Workload, max_num_seqs: int) -> dict:
    drive(runner, [[1] * 8] * 2, [2, 2], args, max_num_seqs, False)  # warm-up
    run = drive(
        runner, work.prompts(args.vocab), work.outputs(), args, max_num_seqs, not args.no_progress
    )
    prompt_tokens = sum(len(p) for p in work.prompts(args.vocab))
    return {
        "output_tok_s": run["output_tokens"] / run["elapsed_s"],
        "total_tok_s": (run["output_tokens"] + prompt_tokens) / run["elapsed_s"],
        "elapsed_s": run["elapsed_s"],
        "generated_tokens": run["output_tokens"],
        "ttft_p50_s": _pct(run["ttft_s"], 50),
        "ttft_p99_s": _pct(run["ttft_s"], 99),
        **{k: run[k] for k in ("draft_tokens", "accepted_tokens", "acceptance_rate") if k in run},
    }


def kestrel_engine(args, model, config, device, max_num_seqs: int):
    """kestrel's Engine (scheduler + runner + detokenizer + stop checks), as the server's engine
    thread runs it, without HTTP."""
    from kestrel.engine.engine import Engine
    from kestrel.loading import load_draft

    if args.shape:
        tokenizer = shape_tokenizer(decoder_config(config).vocab_size)
    else:
        from kestrel.weights.loader import load_tokenizer, resolve

        tokenizer = load_tokenizer(resolve(args.model))
    engine_config = bench_config(args, max_num_seqs)
    draft = load_draft(engine_config, device, tokenizer, not args.no_progress)
    return Engine(model, tokenizer, engine_config, device, draft)


def parallel_engine(args, modes: list[str], work: Workload):
    """With -tp or -pp > 1, rank 0's engine over ranks kestrel starts; else None. Only the
    engine mode runs over ranks (the others drive one process's runner)."""
    if args.tensor_parallel_size == 1 and args.pipeline_parallel_size == 1:
        return None
    if modes != ["engine"]:
        raise SystemExit("kestrel bench: -tp and -pp run only as `kestrel bench engine`")
    from kestrel.llm import load_engine

    seqs = min(args.max_num_seqs, work.num_requests)
    engine, _ = load_engine(bench_config(args, seqs), progress=not args.no_progress)
    return engine


def engine_throughput(args, engine, work: Workload, structured=None) -> dict:
    """Throughput through the Engine; every request constrained by `structured` when given."""
    from kestrel.sampling import SamplingParams

    def run(prompts, outputs, progress) -> tuple[float, int, list[float]]:
        from tqdm import tqdm

        ids = [f"e{run.calls}-{i}" for i in range(len(prompts))]
        run.calls += 1
        for request_id, prompt, o in zip(ids, prompts, outputs, strict=True):
            params = SamplingParams(
                temperature=args.temperature,
                ignore_eos=True,
                max_tokens=o,
                structured_output=structured,
            )
            engine.add_request(request_id, prompt, params)
        first, produced = {}, 0
        bar = tqdm(total=sum(outputs), disable=not progress, unit="tok", leave=False)
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is not None:
                    raise out.error
                first.setdefault(out.request_id, time.perf_counter() - start)
                produced += len(out.new_token_ids)
                bar.update(len(out.new_token_ids))
        bar.close()
        return time.perf_counter() - start, produced, sorted(first.values())

    run.calls = 0
    run([[1] * 8] * 2, [2, 2], False)  # warm-up
    prompts = work.prompts(args.vocab)
    before = (engine.scheduler.num_draft_tokens, engine.scheduler.num_accepted_tokens)
    elapsed, produced, ttft = run(prompts, work.outputs(), not args.no_progress)
    drafted = engine.scheduler.num_draft_tokens - before[0]
    accepted = engine.scheduler.num_accepted_tokens - before[1]
    return {
        **speculation(drafted, accepted),
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, prompts))) / elapsed,
        "elapsed_s": elapsed,
        "generated_tokens": produced,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
    }


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q / 100))]


# -- the transformers peer ----------------------------------------------------------------------


def peer_model(config, dtype, device, seed: int):
    """transformers' model of `config` with random weights: its causal LM, else (vision-language
    configs) its image-text-to-text model, which generates from text alone."""
    auto = peer_class(config.model_type)
    torch.manual_seed(seed)
    with torch.device(device):
        model = auto.from_config(config, dtype=dtype)
    randomize(model)
    return model.eval()


def peer_class(model_type: str):
    """The transformers auto class that builds `model_type`, looked up by name: an unknown type
    would make transformers import every model's config before it says no."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    if model_type in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    raise ValueError(f"transformers has no generating model for {model_type!r}")


@torch.no_grad()
def peer_latency(model, work: Workload, vocab: int, device) -> dict:
    ids = torch.tensor([work.prompts(vocab)[0]], device=device)
    mask = torch.ones_like(ids)  # else generate() takes prompt tokens equal to pad for padding
    o = work.outputs()[0]

    def generate(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        _sync(device)
        return time.perf_counter() - start

    generate(2)  # warm-up
    ttft = generate(1)
    total = generate(o)
    return {"ttft_s": ttft, "decode_tok_s": (o - 1) / max(total - ttft, 1e-9), "total_s": total}


@torch.no_grad()
def peer_throughput(model, work: Workload, vocab: int, device, time_limit: float | None = None):
    """transformers' continuous batching (`generate_batch`); where it fails (its cache has no
    room for MLA's, gemma4's or the Mamba layers' shapes), `generate()` over fixed batches, for
    at most `time_limit` seconds (see `_batched_generate`)."""
    attention = model.config._attn_implementation
    try:
        return _continuous_batching(model, work, vocab, device)
    except Exception as error:  # noqa: BLE001 (reported beside the fallback's numbers)
        failed = _error(error)["error"]
    if model.config._attn_implementation != attention:  # it switched to its paged kernels
        model.set_attn_implementation(attention)
    numbers = _batched_generate(model, work, vocab, device, time_limit=time_limit)
    return {**numbers, "peer_mode": f"generate(), {PEER_BATCH} at a time", "peer_failed": failed}


PEER_BATCH = 64  # sequences per generate() call: its KV cache for 64 x 768 tokens fits an H200


def _batched_generate(
    model, work: Workload, vocab: int, device, batch: int = PEER_BATCH, time_limit=None
) -> dict:
    """`generate()` over the requests, `batch` at a time. Past `time_limit` seconds no new batch
    starts (the first always runs): every batch is the same work, so the rate over the batches
    that ran is the peer's rate, and the record says how many requests that was
    (`peer_requests`). On glm-4.7-flash's shape all 256 requests take over 245 s."""
    prompts, o = work.prompts(vocab), work.output_tokens
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("the generate() peer takes prompts of one length (no --random-lengths)")
    ids = torch.tensor(prompts, device=device)

    def generate(part: torch.Tensor, n: int) -> int:
        out = model.generate(
            part, attention_mask=torch.ones_like(part), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        return out.shape[0] * (out.shape[1] - part.shape[1])

    generate(ids[:2, :8], 2)  # warm-up
    _sync(device)
    start = time.perf_counter()
    produced = done = 0
    while done < len(ids) and (done == 0 or time_limit is None or _since(start) < time_limit):
        produced += generate(ids[done : done + batch], o)
        done = min(done + batch, len(ids))
        _sync(device)
    return {**_peer_rates(produced, ids[:done].numel(), _since(start)), "peer_requests": done}


def _since(start: float) -> float:
    return time.perf_counter() - start


def _peer_rates(produced: int, prompt_tokens: int, elapsed: float) -> dict:
    """A throughput peer's figures from its token counts and time."""
    return {
        "output_tok_s": produced / elapsed,
        "elapsed_s": elapsed,
        "generated_tokens": produced,
        "total_tok_s": (produced + prompt_tokens) / elapsed,
    }


def _continuous_batching(model, work: Workload, vocab: int, device) -> dict:
    from transformers import GenerationConfig

    prompts = work.prompts(vocab)
    o = work.output_tokens
    cache = _peer_cache(work, device)
    gen = GenerationConfig(
        max_new_tokens=o, min_new_tokens=o, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    try:
        model.generate_batch([p[:8] for p in prompts[:2]], generation_config=gen, **cache)
    except Exception:  # versions without min_new_tokens / eos None in continuous batching
        gen = GenerationConfig(max_new_tokens=o, do_sample=False, pad_token_id=0)
        model.generate_batch([p[:8] for p in prompts[:2]], generation_config=gen, **cache)
    _sync(device)
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=gen, **cache)
    _sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(out.generated_tokens) for out in outputs.values())
    if produced < o * len(prompts):  # generate_batch logs failed requests and returns them empty
        raise RuntimeError(f"generate_batch produced {produced} of {o * len(prompts)} tokens")
    return _peer_rates(produced, sum(map(len, prompts)), elapsed)


def _peer_cache(work: Workload, device) -> dict:
    """On the CPU, a KV cache sized for the workload: transformers' continuous batching otherwise
    takes 90% of free memory (14 GB on a 24 GB machine, which two runs at once cannot share)."""
    if device.type != "cpu":
        return {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:  # older transformers size it from the workload
        return {}
    longest = work.prompt_tokens * 3 // 2 + work.output_tokens  # random lengths reach 1.5 P
    pages = -(-longest // 256) + 1
    blocks = work.num_requests * pages + 4
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=blocks)}


# -- entry point --------------------------------------------------------------------------------

PEERS = ("transformers", "gpt-fast")


def run_bench(args) -> int:
    from kestrel.loading import resolve_device, resolve_dtype

    if args.mode == "serve":
        return _run_serve(args, resolve_device(args.device))

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.max_batched_tokens is None:
        args.max_batched_tokens = 8192 if device.type == "cuda" else 512
    modes = ["latency", "throughput"] if args.mode == "all" else [args.mode]
    if args.speculative in DRAFT_METHODS and modes != ["engine"]:
        raise SystemExit(
            f"kestrel bench: --speculative {args.speculative} runs only as `kestrel bench engine`"
        )
    check_peers(args, modes)
    out = open(args.output, "a") if args.output else None
    env = {**environment(device), **card_ceilings(args, device)}
    latency = Workload(1, args.latency_prompt_tokens, args.latency_output_tokens, seed=args.seed)
    batch = Workload(
        args.num_requests, args.prompt_tokens, args.output_tokens, args.random_lengths, args.seed
    )
    peer_rates = {}  # {peer's engine: its single-stream decode tok/s}
    for peer in args.peer:  # first, while the card is free of kestrel's KV pool
        peer_rates.update(_run_peer(peer, args, dtype, device, modes, latency, batch, env, out))
    parallel = parallel_engine(args, modes, batch)  # None: one process
    if parallel is not None:  # the model is rank 0's shard: the ceilings are one device's
        model, config = parallel.runner.model, parallel.runner.model.config
        label = args.shape or source_name(args.model)
    else:
        model, config, label = load_model(args, device, dtype)
    args.vocab = decoder_config(config).vocab_size
    from kestrel.cache.paged import kv_cache_dtype

    kv_per_token = model.kv_bytes_per_token(kv_cache_dtype(args.kv_cache_dtype, dtype))
    base = {"engine": "kestrel", "model": label, "dtype": str(dtype).removeprefix("torch."), **env}
    base["kv_cache_dtype"] = args.kv_cache_dtype
    base["tensor_parallel_size"] = args.tensor_parallel_size
    base["pipeline_parallel_size"] = args.pipeline_parallel_size
    for mode in modes:
        work = latency if mode == "latency" else batch
        seqs = 1 if mode == "latency" else min(args.max_num_seqs, work.num_requests)
        if mode == "engine":  # the Engine builds its own runner
            engine = parallel or kestrel_engine(args, model, config, device, seqs)
            runner = engine.runner
            numbers = engine_throughput(args, engine, work)
            if args.json_schema:  # the same engine and workload, every request constrained
                constrained = engine_throughput(args, engine, work, _structured(args.json_schema))
                numbers.update({f"json_schema_{k}": v for k, v in constrained.items()})
                numbers["json_schema_cost"] = (
                    1 - constrained["output_tok_s"] / numbers["output_tok_s"]
                )
            del engine
        else:
            runner = make_kestrel_runner(args, model, config, device, seqs)
            numbers = (
                kestrel_latency(args, runner, work)
                if mode == "latency"
                else kestrel_throughput(args, runner, work, seqs)
            )
        numbers.update(ceilings(args, model, kv_per_token, dtype, work, seqs))
        numbers.update(of_ceiling(numbers))
        if mode == "latency" and peer_rates:
            numbers["vs_peers"] = _versus(numbers["decode_tok_s"], peer_rates)
        emit(
            {
                **base,
                "mode": mode,
                **_workload(work, seqs),
                **numbers,
                "cuda_graphs": bool(getattr(runner, "graphs", None)),
                "kv_pool_blocks": getattr(getattr(runner, "pool", None), "num_blocks", None),
            },
            out,
        )
        del runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if parallel is not None:
        parallel.shutdown()
    return 0


def card_ceilings(args, device) -> dict:
    """The bandwidth and FLOP rate the ceilings use, as record fields: --bandwidth / --flops where
    given, else on CUDA the card's own (measured once per process); on the CPU none."""
    given = {"bandwidth": args.bandwidth, "flops": args.flops}
    measure = device.type == "cuda" and None in given.values()
    measured = card_rates(device) if measure else {}
    fields = {}
    for name, value in given.items():
        if value is None and name not in measured:
            continue
        setattr(args, name, measured[name] if value is None else value)
        fields[name] = getattr(args, name)
        fields[f"{name}_from"] = "measured" if value is None else f"--{name}"
    return fields


def check_peers(args, modes: list[str]) -> None:
    """Refuse a peer the run cannot measure before anything is built (a CLI error naming the
    flag). gpt-fast measures one stream of a named shape, from a placed checkout."""
    if "gpt-fast" not in args.peer:
        return
    from kestrel.bench.gpt_fast import checkout, peer_shape

    if "latency" not in modes:
        raise SystemExit(
            "--peer gpt-fast measures a single stream: use it with `kestrel bench latency` "
            "(or `kestrel bench`); transformers is the throughput peer"
        )
    if not args.shape:
        raise SystemExit("--peer gpt-fast needs --shape (it builds random weights of a shape)")
    if args.latency_output_tokens < 2:
        raise SystemExit("--latency-output-tokens: --peer gpt-fast needs at least 2")
    peer_shape(args.shape)
    checkout(args.gpt_fast)


def _run_peer(peer, args, dtype, device, modes, latency, batch, env, out) -> dict:
    """Measure one peer; {its engine: its single-stream decode tok/s} where it measured one."""
    if peer == "gpt-fast":
        return _run_gpt_fast(args, device, latency, env, out)
    if peer != "transformers":
        raise SystemExit(f"unknown peer {peer!r}; supported: {', '.join(PEERS)}")
    import transformers

    config = shape_config(args.shape) if args.shape else None
    if config is None:
        from kestrel.weights.loader import load_config, resolve, text_config

        config = text_config(load_config(resolve(args.model)))
    family = meta_model(config, dtype)  # the roofline counts kestrel's layout of the weights
    kv_per_token, vocab = family.kv_bytes_per_token(dtype), decoder_config(config).vocab_size
    engine = f"transformers {transformers.__version__}"
    base = {
        "engine": engine,
        "model": args.shape or args.model,
        "dtype": str(dtype).removeprefix("torch."),
        **env,
    }
    try:
        model = peer_model(config, dtype, device, args.seed)
    except Exception as error:  # e.g. nemotron-nas: transformers has no class for it
        model, failed = None, _error(error)
    rates = {}
    for mode in modes:
        work = latency if mode == "latency" else batch
        if model is None:
            numbers = dict(failed)
        else:
            try:
                numbers = (
                    peer_latency(model, work, vocab, device)
                    if mode == "latency"
                    else peer_throughput(model, work, vocab, device, args.peer_time_limit)
                )
            except Exception as error:  # report the peer's failure and go on with kestrel
                numbers = _error(error)
        numbers.update(ceilings(args, family, kv_per_token, dtype, work, work.num_requests))
        numbers.update(of_ceiling(numbers))
        if mode == "latency" and "decode_tok_s" in numbers:
            rates[engine] = numbers["decode_tok_s"]
        emit({**base, "mode": mode, **_workload(work, work.num_requests), **numbers}, out)
    del model
    gc.collect()  # a failed generate_batch leaves cycles that hold the model's memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


def _run_gpt_fast(args, device, work: Workload, env, out) -> dict:
    """gpt-fast compiled on the shape's nearest model, one stream, in a child process
    (kestrel.bench.gpt_fast); its ceiling counts the bytes its own model reads."""
    from kestrel.bench.gpt_fast import child_command

    command = child_command(args.shape, work, args.seed, device, args.temperature, args.gpt_fast)
    numbers = _child_numbers(command, args.peer_time_limit)
    if args.bandwidth and "active_weight_bytes" in numbers:
        step = numbers["active_weight_bytes"] + numbers["kv_bytes_per_token"] * work.prompt_tokens
        numbers["ceiling_decode_tok_s"] = args.bandwidth / step
        numbers.update(of_ceiling(numbers))
    engine = "gpt-fast " + ("compiled" if numbers.get("compiled") else "eager")
    record = {"engine": engine, "model": args.shape, "dtype": "bfloat16", **env}
    emit({**record, "mode": "latency", **_workload(work, 1), **numbers}, out)
    return {engine: numbers["decode_tok_s"]} if "decode_tok_s" in numbers else {}


def _child_numbers(command: list[str], time_limit: float | None) -> dict:
    """The JSON line a child process prints last, or its failure as the record's error."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=time_limit)
    except subprocess.TimeoutExpired:
        return {"error": f"gpt-fast ran past --peer-time-limit {time_limit:g} s (compiling)"}
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    sys.stderr.write(done.stderr[-4000:])
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"gpt-fast exited with status {done.returncode}: {last}"[:300]}


def _versus(rate: float, peer_rates: dict) -> dict:
    """{peer: kestrel's rate / the peer's} (above 1: kestrel is faster)."""
    return {peer: rate / theirs for peer, theirs in peer_rates.items() if theirs}


def _structured(schema: str):
    """--json-schema: a file's path or the schema's JSON text."""
    from pathlib import Path

    from kestrel.structured import StructuredOutput

    text = Path(schema).read_text() if os.path.isfile(schema) else schema
    constraint = StructuredOutput("json_schema", text, "--json-schema")
    constraint.check()
    return constraint


def _error(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}"[:300]}


def _workload(work: Workload, concurrency: int) -> dict:
    return {
        "num_requests": work.num_requests,
        "prompt_tokens": work.prompt_tokens,
        "output_tokens": work.output_tokens,
        "random_lengths": work.random_lengths,
        "concurrency": concurrency,
    }


def add_bench_args(p) -> None:
    """The `kestrel bench` flags (engine flags come from cli.add_engine_args)."""
    from kestrel.bench.gpt_fast import DEFAULT_DIR as GPT_FAST_DIR

    p.add_argument(
        "mode",
        nargs="?",
        default="all",
        choices=["all", "latency", "throughput", "engine", "serve"],
        help="all = latency + throughput (scheduler + runner); engine = throughput through the "
        "Engine (with detokenization, as the server runs it); serve = a server at --url",
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--random-lengths", action="store_true", help="lengths uniform in [L/2, 3L/2]")
    p.add_argument("--latency-prompt-tokens", type=int, default=128)
    p.add_argument("--latency-output-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--json-schema",
        help="engine mode: measure again with every request constrained by this JSON schema "
        "(a file or the JSON text), in the same run; json_schema_* fields and the cost",
    )
    p.add_argument(
        "--peer", action="append", default=[], choices=PEERS,
        help="also measure, in the same run: transformers (every mode), gpt-fast (single stream: "
        "its compiled decode on the shape's nearest dense or Mixtral model; needs --shape)",
    )  # fmt: skip
    p.add_argument(
        "--gpt-fast", default=GPT_FAST_DIR, metavar="DIR",
        help="the gpt-fast checkout --peer gpt-fast runs (`make gpt-fast` places it here)",
    )  # fmt: skip
    p.add_argument(
        "--peer-time-limit", type=float, default=300.0, metavar="S",
        help="where the transformers peer falls back to generate() batches, start none after S "
        "seconds (its rate is over the batches that ran: peer_requests in the record); the "
        "gpt-fast peer is stopped after S seconds, compiling included",
    )  # fmt: skip
    p.add_argument(
        "--bandwidth", type=float, default=None,
        help="bytes/s for the ceilings (CUDA: the card's device-to-device copy, measured)",
    )  # fmt: skip
    p.add_argument(
        "--flops", type=float, default=None,
        help="FLOP/s for the ceilings (CUDA: the card's bf16 matmul, measured)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", help="append the JSON lines to this file")
    p.add_argument("--no-progress", action="store_true")
    add_serve_bench_args(p)


def _run_serve(args, device) -> int:
    """`kestrel bench serve`: the client side only; the server is whatever answers at --url."""
    import asyncio

    if args.multi_turn:  # chat conversations resending their history
        from kestrel.bench.multiturn import bench_multi_turn as bench_serve
    else:
        from kestrel.bench.serve import bench_serve

    if not args.url:
        raise SystemExit("kestrel bench serve needs --url (the server's base URL)")
    if args.endpoint == "chat" and args.prompt_format == "ids":
        raise SystemExit("--endpoint chat needs --prompt-format text")
    env = environment(device)
    with open(args.output, "a") if args.output else contextlib.nullcontext() as out:
        asyncio.run(bench_serve(args, lambda record: emit({**record, **env}, out)))
    return 0
