"""The GPU gate: run the whole GPU test set (tests/test_gpu_*.py) on a CUDA machine and record it.

CI has no GPU, so it cannot see a CUDA regression; this record is how a change to the code the GPU
tests exercise lands with a GPU run after it. The record holds a hash of that code (all of
src/kestrel, the GPU tests and every test module they import), the number of GPU
tests it ran and the versions of the declared dependencies it ran with; `tests/test_gate_record.py`
fails in CI when the code no longer matches, when the run was not the whole set, or when a version
is outside what pyproject.toml declares.

Usage (on the GPU machine, from the repository root):
    python benchmarks/gpu_gate.py [-o FILE] [-n N --dist loadfile] [--durations=N]
Arguments that select or deselect tests are refused: the record stands for the whole set.
"""

import argparse
import ast
import datetime
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = "tests/test_gpu_*.py"
RECORD = ROOT / "benchmarks" / "results" / "gpu-tests.json"
# pytest options that change how the set runs, never which tests are in it
ALLOWED_OPTIONS = re.compile(
    r"^(-n\d*|--numprocesses(=.+)?|--dist(=.+)?|--durations(=\d+)?|-q|-v)$"
)


def tests_imported(path: Path, root: Path) -> set[Path]:
    """The test-package modules (`tests.x`) a test file imports, directly or through others."""
    found, todo = set(), [path]
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module == "tests":
                names = [f"tests.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("tests.")]
            for name in names:
                module = root / (name.replace(".", "/") + ".py")
                if module.exists() and module not in found:
                    found.add(module)
                    todo.append(module)
    return found


def gpu_code_files(root: Path = ROOT) -> list[Path]:
    """What a GPU run vouches for: the package, the GPU tests and the test modules they import."""
    package = [f for f in (root / "src" / "kestrel").rglob("*") if f.is_file()]
    tests = sorted(root.glob(GPU_TESTS)) + [root / "tests" / "conftest.py"]
    helpers = set().union(*(tests_imported(t, root) for t in tests))
    files = {f for f in package if "__pycache__" not in f.parts}
    return sorted(files | set(tests) | helpers)


def gpu_code_hash(root: Path = ROOT) -> str:
    """sha256 over the paths and contents of the GPU-relevant sources (no git needed: the GPU
    machine may get a copy of the tree without it)."""
    digest = hashlib.sha256()
    for path in gpu_code_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def declared_dependencies(root: Path = ROOT) -> list[str]:
    """pyproject.toml's runtime requirements, as written (`transformers>=5.24`)."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return [re.sub(r"\s*#.*", "", r) for r in project["dependencies"]]


def gpu_test_files(root: Path = ROOT) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob(GPU_TESTS))


def collected_count(root: Path = ROOT) -> int:
    """How many tests the GPU set holds (collection needs no GPU)."""
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, *gpu_test_files(root)], capture_output=True, text=True, cwd=root
    )
    match = re.search(r"(\d+) tests? collected", done.stdout)
    if match is None:
        raise RuntimeError(f"collecting the GPU tests failed:\n{done.stdout[-2000:]}")
    return int(match.group(1))


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
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *gpu_test_files()]
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
        "dependencies": installed_versions(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
    }


def installed_versions() -> dict[str, str | None]:
    """The installed version of every declared dependency (None: not installed)."""
    versions = {}
    for requirement in declared_dependencies():
        name = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def selection_arguments(extra: list[str]) -> list[str]:
    """The arguments that are not ALLOWED_OPTIONS (or the value of -n / --dist)."""
    refused, values = [], {"-n", "--numprocesses", "--dist", "--durations"}
    for previous, arg in zip([None, *extra], extra, strict=False):
        if previous in values:
            continue
        if not ALLOWED_OPTIONS.match(arg):
            refused.append(arg)
    return refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=RECORD)
    args, extra = parser.parse_known_args()
    refused = selection_arguments(extra)
    if refused:
        parser.error(
            f"refused {' '.join(refused)}: the gate runs the whole GPU test set; only "
            "-n/--numprocesses, --dist, --durations, -q and -v are allowed"
        )
    junit = args.output.with_suffix(".xml")
    collected = collected_count()
    code, seconds = run_tests(junit, extra)
    record = {
        "commit": commit(),
        "gpu_code_hash": gpu_code_hash(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **environment(),
        "collected": collected,
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
