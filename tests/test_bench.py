"""`kestrel bench` on the CPU: a tiny random-weight shape, kestrel and the transformers peer, one
JSON line per measurement with the fields the results table reads."""

import json

from kestrel.cli import main


def test_bench_tiny_shape_with_peer_prints_json_lines(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    argv = (
        "bench --shape tiny --num-requests 2 --prompt-tokens 12 --output-tokens 3 "
        "--latency-prompt-tokens 6 --latency-output-tokens 4 --peer transformers --no-progress "
        f"--bandwidth 1e10 --flops 1e11 -o {out}"
    ).split()
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [(r["engine"].split()[0], r["mode"]) for r in records]
    assert kinds == [
        ("transformers", "latency"),
        ("transformers", "throughput"),
        ("kestrel", "latency"),
        ("kestrel", "throughput"),
    ]
    kestrel = records[3]
    assert kestrel["generated_tokens"] == 6 and kestrel["output_tok_s"] > 0
    assert kestrel["ceiling_output_tok_s"] > 0 and records[2]["ceiling_decode_tok_s"] > 0
    assert records[2]["decode_tok_s"] > 0 and "command" in kestrel and "commit" in kestrel
