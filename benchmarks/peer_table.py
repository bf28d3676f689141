"""A markdown table of single-stream records: per shape and card, kestrel's decode rate and share
of the card's bandwidth beside each peer's, and kestrel's ratio to each peer (the records of
`benchmarks/roofline_peers.sh` or any `kestrel bench latency --peer ...`).

    python benchmarks/peer_table.py OUT.jsonl [MORE.jsonl ...]
"""

import json
import sys


def rows(records: list[dict]) -> list[str]:
    """One row per kestrel latency record, with the peers of the same run (shape, card, commit)."""
    peers = {}
    for r in records:
        if r.get("mode") == "latency" and r.get("engine") != "kestrel":
            peers.setdefault(_run(r), []).append(r)
    out = []
    for r in records:
        if r.get("mode") != "latency" or r.get("engine") != "kestrel":
            continue
        theirs = "; ".join(_peer(p, r) for p in peers.get(_run(r), [])) or "none"
        out.append(
            f"| {r['model']} | {r.get('gpu') or r['device']} | {_tb(r.get('bandwidth'))} | "
            f"{r['decode_tok_s']:.1f} | {_pct(r.get('of_ceiling'))} | {theirs} | "
            f"{r.get('commit')} |"
        )
    return out


def _run(r: dict) -> tuple:
    """What one `kestrel bench` run's records share."""
    return r.get("model"), r.get("gpu"), r.get("commit"), r.get("command")


def _peer(p: dict, ours: dict) -> str:
    if "decode_tok_s" not in p:
        return f"{p['engine']}: {p.get('error', 'no figure')}"
    ratio = ours["decode_tok_s"] / p["decode_tok_s"]
    return f"{p['engine']} {p['decode_tok_s']:.1f} ({_pct(p.get('of_ceiling'))}): {ratio:.2f}x"


def _tb(bandwidth) -> str:
    return f"{bandwidth / 1e12:.2f} TB/s" if bandwidth else ""


def _pct(share) -> str:
    return f"{share:.0%}" if share else ""


HEADER = [
    "| shape | card | measured bandwidth | kestrel tok/s | of ceiling | peers (tok/s, of their "
    "ceiling): kestrel / peer | commit |",
    "|---|---|---:|---:|---:|---|---|",
]


def main() -> int:
    records = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]
    print("\n".join(HEADER + rows(records)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
