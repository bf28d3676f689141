"""The records of cpu_generate.py, summarized and compared: each measurement's repeats as one
record (median, extremes, every run), kestrel's ratios to each peer and to the faster llama.cpp
build, and the grouped bars of `--plot`."""

import statistics


def label(record: dict) -> str:
    """A system's name with its build: `kestrel`, `llama.cpp (no-amx)`."""
    build = record.get("build")
    return f"{record['system']} ({build})" if build else record["system"]


def summarize(runs: list[dict]) -> dict:
    """One measurement's runs as one record: the median tok/s and seconds, the extremes and
    every run's tok/s in run order; the other fields from the median run."""
    speeds = [r["tok_s"] for r in runs]
    middle = sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]
    return middle | {
        "tok_s": statistics.median(speeds),
        "seconds": statistics.median(r["seconds"] for r in runs),
        "tok_s_min": min(speeds),
        "tok_s_max": max(speeds),
        "tok_s_runs": speeds,
        "runs": len(runs),
    }


def key(record: dict) -> str:
    """A measurement's name in ratios and plots: prefill_256, decode, decode_streams."""
    if record["metric"] == "prefill":
        return f"prefill_{record['prompt_tokens']}"
    return record["metric"]


def speeds(records: list[dict], system: str) -> dict[str, dict]:
    """A system's measured records (its summaries) by measurement name."""
    return {key(r): r for r in records if label(r) == system and "tok_s" in r}


def ratio_line(alias: str, ours: dict, theirs: dict, peer: str) -> dict:
    """kestrel / peer from the medians, each measurement against `theirs[name]` (a streams
    figure against the peer's single stream); `paired`: the range of run-by-run ratios."""
    line, paired_ranges = {"model": alias, "system": f"kestrel/{peer}", "metric": "ratios"}, {}
    for name, mine in ours.items():
        single = "decode" if name == "decode_streams" else name
        if single not in theirs:
            continue
        field = "streams_vs_single" if single != name else name
        line[field] = mine["tok_s"] / theirs[single]["tok_s"]
        # a build that crashed part-way has fewer runs: pair what both have
        runs = mine.get("tok_s_runs", []), theirs[single].get("tok_s_runs", [])
        pairs = zip(*runs, strict=False)
        paired = [a / b for a, b in pairs]
        if paired:
            paired_ranges[field] = [min(paired), max(paired)]
    return line | {"paired": paired_ranges}


def fastest(records: list[dict], peers: list[str]) -> tuple[dict, dict]:
    """Per measurement, the peer record with the highest median, and which build it is."""
    best = {}
    for peer in peers:
        for name, record in speeds(records, peer).items():
            if name not in best or record["tok_s"] > best[name]["tok_s"]:
                best[name] = record
    return best, {name: record.get("build") for name, record in best.items()}


def ratios(alias: str, records: list[dict]) -> list[dict]:
    """kestrel / each peer, then kestrel / the faster llama.cpp build that ran the file."""
    ours = speeds(records, "kestrel")
    peers = list(dict.fromkeys(label(r) for r in records if "tok_s" in r))
    peers = [p for p in peers if p != "kestrel"]
    out = [ratio_line(alias, ours, speeds(records, p), p) for p in peers]
    builds = [p for p in peers if p.startswith("llama.cpp (")]
    if len(builds) > 1:
        best, which = fastest(records, builds)
        out.append(ratio_line(alias, ours, best, "llama.cpp") | {"peer_build": which})
    return out


LABELS = {"decode": "decode, 1 stream", "decode_streams": "decode, {streams} streams"}


def plot(records: list[dict], path: str) -> None:
    """Grouped bars, one panel per model: a group per measurement, a bar per system (and build),
    tok/s on a log axis (prefill and decode differ by orders of magnitude), the median on the
    bar and the runs' range as its error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in records if "tok_s" in r and r["metric"] != "ratios"]
    models = list(dict.fromkeys(r["model"] for r in measured))
    fig, axes = plt.subplots(len(models), 1, figsize=(9, 3.6 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models, strict=True):
        panel(ax, model, [r for r in measured if r["model"] == model])
    fig.tight_layout()
    fig.savefig(path)


def panel(ax, model: str, mine: list[dict]) -> None:
    bars = {(key(r), label(r)): r for r in mine}
    groups = list(dict.fromkeys(key(r) for r in mine))
    systems = list(dict.fromkeys(label(r) for r in mine))
    width = 0.8 / len(systems)
    for i, system in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(groups))]
        shown = [bars.get((g, system), {}) for g in groups]
        values = [r.get("tok_s", 0) for r in shown]
        spread = [
            [v - r.get("tok_s_min", v) for v, r in zip(values, shown, strict=True)],
            [r.get("tok_s_max", v) - v for v, r in zip(values, shown, strict=True)],
        ]
        drawn = ax.bar(xs, values, width, label=system, yerr=spread, capsize=2)
        ax.bar_label(drawn, [_value(v) for v in values], fontsize=7)
    streams = next((r["streams"] for r in mine if "streams" in r), 0)
    labels = [LABELS.get(g, g.replace("_", " ")).format(streams=streams) for g in groups]
    ax.set_xticks(range(len(groups)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("tok/s")
    runs = max((r.get("runs", 1) for r in mine), default=1)
    ax.set_title(f"{model}: {mine[0]['threads']} threads, greedy, median of {runs}")
    ax.legend(fontsize=8)


def _value(tok_s: float) -> str:
    return "" if not tok_s else f"{tok_s:,.0f}" if tok_s >= 100 else f"{tok_s:.1f}"
