"""The GPU gate: run the GPU test set (tests/test_gpu_*.py) on a CUDA machine and record the result.

CI has no GPU, so it cannot see a CUDA regression; this record is how a change to the GPU-relevant
code (src/kestrel/{engine,cache,kernels,models,weights} and the GPU tests) lands with a GPU run
after it. The record holds a hash of that code; `tests/test_gate_record.py` fails in CI when the
code no longer matches the last passing run.

Usage (on the GPU machine, from the repository root):
    python benchmarks/gpu_gate.py [-o benchmarks/results/gpu-tests.json] [pytest args...]
"""

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_CODE = [f"src/kestrel/{part}" for part in ("engine", "cache", "kernels", "models", "weights")]
GPU_TESTS = "tests/test_gpu_*.py"
RECORD = ROOT / "benchmarks" / "results" / "gpu-tests.json"


def gpu_code_files(root: Path = ROOT) -> list[Path]:
    files = [f for part in GPU_CODE for f in (root / part).rglob("*.py")]
    return sorted(files + list(root.glob(GPU_TESTS)))


def gpu_code_hash(root: Path = ROOT) -> str:
    """sha256 over the paths and contents of the GPU-relevant sources (no git needed: the GPU
    machine may get a copy of the tree without it)."""
    digest = hashlib.sha256()
    for path in gpu_code_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def commit() -> str | None:
    """KESTREL_COMMIT when set (a copy of the tree may carry stale git metadata), else git's."""
    if os.environ.get("KESTREL_COMMIT"):
        return os.environ["KESTREL_COMMIT"]
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
        )
        return done.stdout.strip() or None
    except OSError:
        return None


def run_tests(junit: Path, extra: list[str]) -> tuple[int, float]:
    files = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(GPU_TESTS))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    start = time.monotonic()
    code = subprocess.call([*command, f"--junitxml={junit}", *extra], cwd=ROOT)
    return code, time.monotonic() - start


def summarize(junit: Path) -> dict:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {
        "passed": passed,
        "failed": len(failed),
        "skipped": counts["skipped"],
        "failures": failed,
    }


def environment() -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=RECORD)
    args, extra = parser.parse_known_args()
    junit = args.output.with_suffix(".xml")
    code, seconds = run_tests(junit, extra)
    record = {
        "commit": commit(),
        "gpu_code_hash": gpu_code_hash(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **environment(),
        **summarize(junit),
        "seconds": round(seconds, 1),
        "command": "python benchmarks/gpu_gate.py " + " ".join(sys.argv[1:]),
    }
    if record["device"] is None:
        print("gpu_gate: no CUDA device: the GPU tests were skipped; nothing recorded")
        return 1
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "failures"}))
    return code


if __name__ == "__main__":
    sys.exit(main())
