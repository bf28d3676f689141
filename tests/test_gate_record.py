"""The GPU gate, checked on every CI run (which has no GPU): the committed record of the last GPU
test run (`benchmarks/results/gpu-tests.json`, written by `benchmarks/gpu_gate.py` on a CUDA
machine) passed, and was made on the GPU-relevant code as it is now. A change under
src/kestrel/{engine,cache,kernels,models,weights} or to a GPU test fails here until the GPU test
set has passed on it."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_gate():
    spec = importlib.util.spec_from_file_location("gpu_gate", ROOT / "benchmarks" / "gpu_gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gate():
    return load_gate()


def test_last_gpu_run_passed_every_gpu_test(gate):
    record = json.loads(gate.RECORD.read_text())
    assert record["device"], "the record was not made on a CUDA device"
    assert record["failed"] == 0, f"GPU tests failed at {record['commit']}: {record['failures']}"
    assert record["passed"] > 0 and record["skipped"] == 0


def test_gpu_code_is_what_the_last_gpu_run_tested(gate):
    record = json.loads(gate.RECORD.read_text())
    assert record["gpu_code_hash"] == gate.gpu_code_hash(), (
        f"GPU-relevant code changed since the last GPU test run (commit {record['commit']}): run "
        "`python benchmarks/gpu_gate.py` on a CUDA machine and commit its record"
    )


def test_every_gpu_test_is_in_the_gpu_test_set(gate):
    """Tests marked `gpu` outside tests/test_gpu_*.py would never run in the gate."""
    marked = re.compile(r"^(pytestmark = pytest\.mark\.gpu|\s*@pytest\.mark\.gpu)", re.M)
    outside = [
        p.name
        for p in (ROOT / "tests").glob("test_*.py")
        if marked.search(p.read_text()) and not p.match("test_gpu_*.py")
    ]
    assert outside == []
