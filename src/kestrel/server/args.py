"""`kestrel serve` flags, named like llama-server's where we share them."""

import argparse

from kestrel.cli import add_engine_args


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-np", "--parallel", type=int, default=8, help="max running sequences")
    p.add_argument("--max-queue-depth", type=int, default=64)
    p.add_argument("-n", "--n-predict", dest="max_tokens", type=int, default=-1,
                   help="default max tokens per request (-1 = until the context is full)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--allowed-origins", default="", help="comma-separated CORS origins (default: none)")
