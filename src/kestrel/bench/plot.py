"""Bar chart (SVG, no dependencies) of `kestrel bench` JSON lines: kestrel vs peers vs ceiling.

Usage: python -m kestrel.bench.plot benchmarks/results/h200-*.jsonl -o benchmarks/results/h200.svg
"""

import argparse
import json

METRIC = {
    "latency": ("decode_tok_s", "ceiling_decode_tok_s"),
    "throughput": ("output_tok_s", "ceiling_output_tok_s"),
}
COLORS = {"kestrel": "#1f77b4", "peer": "#ff7f0e", "ceiling": "#cccccc"}


def groups(paths):
    """{(model, mode): {"kestrel": x, "peer": x, "ceiling": x}} from JSON-lines files."""
    out = {}
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            if r["mode"] not in METRIC:  # engine / serve lines: see the docs' server table
                continue
            value, ceiling = METRIC[r["mode"]]
            g = out.setdefault((r["model"], r["mode"]), {})
            g["kestrel" if r["engine"] == "kestrel" else "peer"] = r.get(value, 0)
            g["ceiling"] = r.get(ceiling, 0)
    return out


def svg(data) -> str:
    w, row, bar = 760, 90, 22
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{row * len(data) + 40}"'
        ' font-family="sans-serif" font-size="12">'
    ]
    for i, ((model, mode), g) in enumerate(sorted(data.items())):
        y, top = 20 + i * row, max(g.values()) or 1
        unit = "decode tok/s, 1 stream" if mode == "latency" else "output tok/s, 256 requests"
        parts.append(f'<text x="10" y="{y + 10}">{model}: {unit}</text>')
        for j, key in enumerate(("kestrel", "peer", "ceiling")):
            v = g.get(key, 0)
            length = 480 * v / top
            yy = y + 16 + j * bar
            parts.append(
                f'<rect x="150" y="{yy}" width="{length:.0f}" height="{bar - 4}" fill="{COLORS[key]}"/>'
            )
            parts.append(f'<text x="10" y="{yy + 13}">{key}</text>')
            parts.append(f'<text x="{155 + length:.0f}" y="{yy + 13}">{v:,.0f}</text>')
    return "\n".join(parts + ["</svg>"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("-o", "--output", default="bench.svg")
    args = parser.parse_args()
    open(args.output, "w").write(svg(groups(args.files)))
