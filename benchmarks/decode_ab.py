"""Single-stream decode with and without the decode attention's key splits (kernels/attention.py)
and the one-row GEMV (kernels/gemv.py): `kestrel bench latency` in this process, `--base` turning
both off first. Appends the record to `-o` with `ab_mode` ("base" or "new") and prints a summary.

    python benchmarks/decode_ab.py --shape glm-4.7-flash --prompt-tokens 4096 -o ab.jsonl
    python benchmarks/decode_ab.py --shape glm-4.7-flash --prompt-tokens 4096 -o ab.jsonl --base
"""

import argparse
import json
import sys

from kestrel.cli import main as kestrel
from kestrel.kernels import attention, gemv


def run(shape: str, prompt_tokens: int, out: str, base: bool) -> dict:
    if base:
        attention._MAX_KV_SPLITS = 1  # one program per KV head walks the whole context
        gemv.MAX_BYTES = 0  # every projection and router on cuBLAS
    argv = ["bench", "latency", "--shape", shape, "--latency-prompt-tokens", str(prompt_tokens)]
    kestrel([*argv, "--latency-output-tokens", "64", "--no-progress", "-o", out])
    with open(out) as f:
        records = [json.loads(line) for line in f]
    records[-1]["ab_mode"] = "base" if base else "new"
    records[-1]["command"] = " ".join(["python benchmarks/decode_ab.py", *sys.argv[1:]])
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return records[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("-o", "--out", required=True)
    p.add_argument("--base", action="store_true", help="key splits and the one-row GEMV off")
    args = p.parse_args()
    r = run(args.shape, args.prompt_tokens, args.out, args.base)
    ceiling = r.get("ceiling_decode_tok_s")  # None on the CPU
    print(r["ab_mode"], args.shape, args.prompt_tokens, f"{r['decode_tok_s']:.1f} tok/s", ceiling)


if __name__ == "__main__":
    main()
