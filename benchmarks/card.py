"""The card's record: its name, its measured device-to-device copy bandwidth (bytes read + written
per second) and bf16 matmul rate, as `kestrel bench` measures them for its ceilings (one JSON
line).

    python benchmarks/card.py [--device cuda] [-o OUT.jsonl]
"""

import argparse
import contextlib
import sys

import torch

from kestrel.bench.offline import emit, environment
from kestrel.bench.roofline import COPY_BYTES, card_rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("-o", "--output", help="append the JSON line to this file")
    opts = p.parse_args()
    device = torch.device(opts.device)
    record = {"mode": "card", **environment(device), **card_rates(device)}
    record["command"] = " ".join(["python benchmarks/card.py", *sys.argv[1:]])
    record["bandwidth_convention"] = f"copy_ of {COPY_BYTES} bytes: bytes read + written / s"
    with open(opts.output, "a") if opts.output else contextlib.nullcontext() as out:
        emit(record, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
