"""`kestrel run|generate|serve|bench|inspect|arch`: argument parsing, then one call each."""

import argparse
import json
import os
import sys

from kestrel.flags import MODEL_HELP, add_engine_args
from kestrel.weights.embedded import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    from kestrel.errors import InvalidRequestError, KestrelError

    try:
        if _joined_follower():
            return follow_rank0(args)
        return args.func(args) or 0
    except InvalidRequestError as e:
        flag = FLAGS.get(e.param, f"--{(e.param or '').replace('_', '-')}")
        print(f"kestrel: error: {flag}: {e}", file=sys.stderr)
        return 1
    except KestrelError as e:
        print(f"kestrel: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# SamplingParams field -> the flag that sets it, where the names differ
FLAGS = {
    "temperature": "--temp",
    "max_tokens": "-n/--n-predict",
    "repetition_penalty": "--repeat-penalty",
}


def serve_main() -> int:
    """`kestrel-server`: the same as `kestrel serve`."""
    return main(["serve", *sys.argv[1:]])


def version() -> str:
    """The installed distribution's version (the source's where kestrel runs uninstalled)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kestrel")
    except PackageNotFoundError:
        from kestrel import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kestrel", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=f"kestrel {version()}")
    sub = parser.add_subparsers(dest="command")
    _generate_parser(sub)
    _run_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    inspect = sub.add_parser("inspect", help="describe a model: architecture, size, KV per token")
    _add_model_positional(inspect)
    inspect.add_argument("-m", "--model", default=DEFAULT_MODEL)
    inspect.set_defaults(func=cmd_inspect)
    arch = sub.add_parser("arch", help="list the supported architectures (model_type)")
    arch.set_defaults(func=cmd_arch)
    return parser


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=256)
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("-s", "--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_model_positional(p) -> None:
    """The model as a positional argument (`kestrel run MODEL`), beside -m where both exist."""
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help=MODEL_HELP)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt, streaming the text")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.set_defaults(func=cmd_generate)


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="chat with a model (interactive, or one shot with -p)")
    _add_model_positional(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("-p", "--prompt", help="one message; print the answer and exit")
    p.add_argument("--system", help="system prompt")
    p.set_defaults(func=cmd_run)


def _serve_parser(sub) -> None:
    from kestrel.server.args import add_serve_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)


def _bench_parser(sub) -> None:
    from kestrel.bench import add_bench_args

    p = sub.add_parser("bench", help="measure throughput and latency (kestrel and peers)")
    add_engine_args(p)
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)


def sampling_params(args):
    from kestrel.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def load_llm(args, model: str | None = None):
    from kestrel.llm import LLM

    return LLM(config=engine_config(args, model))


def engine_config(args, model: str | None = None):
    """The Config of `generate` and `run` (`model`: run's positional model)."""
    from kestrel.config import config_from_args

    return config_from_args(args, **({"model": model} if model else {}))


def _joined_follower() -> bool:
    """Whether torchrun started this process as a rank other than 0 of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


def follow_rank0(args) -> int:
    """Every machine of a torchrun launch runs the same command; on ranks other than 0 it loads
    that rank's part of the model and runs the engine calls rank 0 sends, and nothing else (no
    server, no output)."""
    from kestrel.distributed.workers import follow_joined

    if args.command == "serve":
        from kestrel.server.main import server_settings

        return follow_joined(server_settings(args))
    if args.command in ("generate", "run"):
        return follow_joined(engine_config(args, getattr(args, "model_arg", None)))
    print(f"kestrel: error: `kestrel {args.command}` does not run under torchrun", file=sys.stderr)
    return 2


def stream(llm, prompt_ids: list[int], params) -> str:
    """Generate for one prompt, writing text to stdout as it comes; returns the whole text."""
    engine = llm.engine
    request_id = f"cli-{id(prompt_ids)}"
    engine.add_request(request_id, prompt_ids, params)
    text = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise out.error
            print(out.new_text, end="", flush=True)
            text.append(out.new_text)
    print()
    return "".join(text)


def cmd_generate(args) -> int:
    from kestrel.tokenizer import encode

    params = sampling_params(args)  # bad flags fail before the model loads
    llm = load_llm(args)
    stream(llm, encode(llm.tokenizer, args.prompt), params)
    return 0


def cmd_run(args) -> int:
    from kestrel.tokenizer import apply_chat_template

    params = sampling_params(args)
    llm = load_llm(args, args.model_arg)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = [args.prompt] if args.prompt else _read_turns()
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = stream(llm, apply_chat_template(llm.tokenizer, messages), params)
        messages.append({"role": "assistant", "content": answer})
    return 0


def _read_turns():
    print("kestrel chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return
        if line.strip():
            yield line


def cmd_serve(args) -> int:
    from kestrel.server.main import serve

    return serve(args)


def cmd_bench(args) -> int:
    from kestrel.bench import run_bench

    return run_bench(args)


def cmd_inspect(args) -> int:
    import torch

    from kestrel.weights.loader import (
        build_model,
        checkpoint_summary,
        load_config,
        resolve,
        text_config,
    )

    source = resolve(args.model_arg or args.model)
    config = text_config(load_config(source))
    model = build_model(config, torch.float32, torch.device("meta"))
    cpu = checkpoint_summary(model, source, torch.device("cpu"), torch.float32)
    cuda = checkpoint_summary(model, source, torch.device("cuda"), torch.bfloat16)
    info = {
        "model": str(source.path),
        "architecture": config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(getattr(config, "dtype", None) or "float32"),
        "context_length": getattr(config, "max_position_embeddings", None),
        "layers": [spec.kind for spec in model.cache_specs()],
        "kv_bytes_per_token": {
            "float32": model.kv_bytes_per_token(torch.float32),
            "bfloat16": model.kv_bytes_per_token(torch.bfloat16),
        },
        # tensors by type in the checkpoint (a quantized safetensors module counts once, as its
        # format), and the bytes its weights take once loaded: on the CPU (float32; GGUF blocks of
        # the packed types and MLX/FP8/NVFP4 tensors as stored) and on CUDA (bfloat16)
        "tensor_types": cpu["types"],
        "resident_bytes": {"cpu": cpu["resident"], "cuda": cuda["resident"]},
    }
    print(json.dumps(info, indent=2))
    return 0


def cmd_arch(args) -> int:
    from kestrel.models.registry import supported_architectures

    print("\n".join(supported_architectures()))
    return 0
