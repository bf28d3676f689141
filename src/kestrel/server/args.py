"""`kestrel serve` flags, named like llama-server's where we share them.

Each shared flag also reads llama-server's environment variable (LLAMA_ARG_*); the command line
wins over the environment because the variable only sets the flag's default.
"""

import argparse
import os

from kestrel.config import default_of
from kestrel.flags import add_engine_args
from kestrel.server.reasoning import NAMES as REASONING_PARSERS
from kestrel.server.tools.parsers import PARSERS

# flag dest -> llama-server's environment variable
LLAMA_ENV = {
    "model": "LLAMA_ARG_MODEL",
    "alias": "LLAMA_ARG_ALIAS",
    "host": "LLAMA_ARG_HOST",
    "port": "LLAMA_ARG_PORT",
    "ctx_size": "LLAMA_ARG_CTX_SIZE",
    "max_tokens": "LLAMA_ARG_N_PREDICT",
    "max_num_seqs": "LLAMA_ARG_N_PARALLEL",
    "prefill_chunk_size": "LLAMA_ARG_BATCH",
    "threads": "LLAMA_ARG_THREADS",
    "api_key": "LLAMA_API_KEY",
    "timeout": "LLAMA_ARG_TIMEOUT",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument(
        "-a",
        "--alias",
        "--served-model-name",
        dest="alias",
        default=None,
        help="model names clients use, comma-separated: the first is the id responses carry, "
        "the others are accepted too (default: -m's value)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "-np",
        "--parallel",
        "--max-num-seqs",
        dest="max_num_seqs",
        type=int,
        default=default_of("max_num_seqs"),
        help="max running sequences",
    )
    p.add_argument(
        "--max-queue-depth",
        type=int,
        default=default_of("max_queue_depth"),
        help="max waiting requests; beyond it 503 with Retry-After",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="which waiting request runs next and which running one is preempted when KV runs "
        "out: fcfs (arrival order; a request's priority must be 0) or priority (vLLM's: the "
        "request's `priority`, lower first; the lowest is preempted)",
    )
    p.add_argument(
        "--priority-aging-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --scheduling-policy priority: a request's effective priority improves by 1 "
        "per this many seconds since it arrived, which bounds starvation (0 = off: strict)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        dest="max_tokens",
        type=int,
        default=-1,
        help="default max tokens per request (-1 = until the context is full)",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=default_of("threads"),
        help="CPU threads (0 = torch's default)",
    )
    p.add_argument("--api-key", default=None, help="require this key (Bearer) on all but /health")
    p.add_argument(
        "--allowed-origins", default="", help="comma-separated CORS origins (default: none)"
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        help="image_url parts may name file:// images under this directory (default: none)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="HTTP keep-alive/read timeout (s)")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=default_of("max_request_bytes"),
        help="larger request bodies get 413 before they are read (default: 8 MiB)",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=default_of("client_timeout"),
        help="seconds a client has to send its request head, and then its body (slow clients)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        dest="kv_capacity",
        type=int,
        default=0,
        help="KV tokens all running sequences may hold (0 = as many as the KV pool holds: on the "
        "CPU at most a quarter of RAM); beyond it requests wait or are preempted and recomputed",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    p.add_argument(
        "--no-exit-on-engine-failure",
        dest="exit_on_engine_failure",
        action="store_false",
        help="stay up (unhealthy, 503) if the engine dies and is not restarted",
    )
    p.add_argument(
        "--no-restart-engine",
        dest="restart_engine",
        action="store_false",
        help="do not restart an engine that died (crash, OOM kill): fail as --no-exit-... says",
    )
    p.add_argument(
        "--max-engine-restarts",
        type=int,
        default=default_of("max_engine_restarts"),
        help="engine restarts allowed within --engine-restart-window; one more and the server "
        "gives up (exits non-zero)",
    )
    p.add_argument(
        "--engine-restart-window",
        type=float,
        default=default_of("engine_restart_window"),
        help="seconds (see above)",
    )
    p.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=default_of("slots"),
        help="serve GET /slots, llama-server's slot monitor (default: off, 501)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=default_of("tool_call_parser"),
        choices=["auto", *PARSERS],
        help="the syntax of the model's tool calls (vLLM's names; default: auto, chosen from the "
        "chat template and vocabulary, else hermes)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=default_of("reasoning_parser"),
        choices=REASONING_PARSERS,
        help="split thinking models' reasoning out of the answer (vLLM's names; default: auto, "
        "chosen from the chat template's markers; none: leave it in the content)",
    )
    p.add_argument(
        "--pooling",
        default=default_of("pooling"),
        choices=["last", "mean"],
        help="how /v1/embeddings pools a prompt's final-norm hidden states: the last token's "
        "(default, as vLLM for decoder models) or the mean over its tokens",
    )
    add_data_parallel_args(p)
    add_disaggregate_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    apply_llama_env(p)


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    from kestrel.flags import _positive

    group = p.add_argument_group("data parallel")
    group.add_argument(
        "-dp",
        "--data-parallel-size",
        type=_positive,
        default=1,
        help="serve this many engine replicas behind the one endpoint (Ray actors, each on its "
        "own -tp x -pp GPUs, or on the CPU); requests go to the replica that served their "
        "prefix last, else the least busy (needs ray: pip install 'kestrel[dp]')",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to run -dp replicas on, e.g. ray://head:10001 or auto (default: "
        "start a local one)",
    )


def add_disaggregate_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("disaggregated prefill and decode")
    group.add_argument(
        "--disaggregate",
        action="store_true",
        default=default_of("disaggregate"),
        help="serve with two engines: a prefill engine runs each prompt and its first token, "
        "then hands the KV blocks to a decode engine that generates the rest (NCCL between two "
        "GPUs, gloo otherwise); not with -tp, -pp or -dp",
    )
    group.add_argument(
        "--prefill-device",
        default=default_of("prefill_device"),
        help="the prefill engine's device, e.g. cuda:0 or cpu (default: --device's)",
    )
    group.add_argument(
        "--decode-device",
        default=default_of("decode_device"),
        help="the decode engine's device, e.g. cuda:1 or cpu (default: the GPU after the "
        "prefill engine's when there is one, else the prefill engine's)",
    )


def served_names(args) -> tuple[str, set[str]]:
    """(the model's id, the other names a request's `model` may use): --alias's names, -m's
    value and its file name."""
    names = [name.strip() for name in (args.alias or "").split(",") if name.strip()]
    model = str(args.model)
    served = names[0] if names else args.shape or model
    return served, {model, os.path.basename(model), *names[1:]}


def apply_llama_env(p: argparse.ArgumentParser, environ=os.environ) -> None:
    """Set defaults from LLAMA_ARG_* variables, converted by the flag's own type."""
    actions = {a.dest: a for a in p._actions}
    defaults = {}
    for dest, var in LLAMA_ENV.items():
        if var in environ and dest in actions:
            convert = actions[dest].type or str
            try:
                defaults[dest] = convert(environ[var])
            except ValueError:
                p.error(f"{var}={environ[var]!r} is not a valid {dest}")
    p.set_defaults(**defaults)
