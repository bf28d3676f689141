"""`kestrel bench`: offline throughput and latency against the peers in the same run
(offline.py), an OpenAI-compatible server under concurrent streaming clients (serve.py), and an
SVG chart of the results (plot.py). Random-weight shapes live with the loaders
(weights/shapes.py)."""

from kestrel.bench.offline import add_bench_args, run_bench

__all__ = ["add_bench_args", "run_bench"]
