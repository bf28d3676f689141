"""The GPU gate, checked on every CI run (which has no GPU): the committed record of the last GPU
test run (`benchmarks/results/gpu-tests.json`, written by `benchmarks/gpu_gate.py` on a CUDA
machine) ran the whole GPU test set, passed, was made on the code as it is now (all of
src/kestrel and every test module the GPU tests import), and with dependency versions that
pyproject.toml declares. A change to any of that code fails here until a GPU run records it."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def load_gate():
    spec = importlib.util.spec_from_file_location("gpu_gate", ROOT / "benchmarks" / "gpu_gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gate():
    return load_gate()


@pytest.fixture(scope="module")
def record(gate):
    return json.loads(gate.RECORD.read_text())


def test_last_gpu_run_passed_every_gpu_test(record):
    assert record["device"], "the record was not made on a CUDA device"
    assert record["failed"] == 0, f"GPU tests failed at {record['commit']}: {record['failures']}"
    assert record["passed"] > 0 and record["skipped"] == 0


def test_last_gpu_run_was_the_whole_gpu_test_set(gate, record):
    collected = gate.collected_count()
    assert record["collected"] == record["passed"] == collected, (
        f"the record ran {record['passed']} of {record['collected']} tests; the GPU test set "
        f"holds {collected} now: run `python benchmarks/gpu_gate.py` on a CUDA machine"
    )


def test_gpu_code_is_what_the_last_gpu_run_tested(gate, record):
    assert record["gpu_code_hash"] == gate.gpu_code_hash(), (
        f"code the GPU tests exercise changed since the last GPU test run (commit "
        f"{record['commit']}): run `python benchmarks/gpu_gate.py` on a CUDA machine and commit "
        "its record"
    )


def test_last_gpu_run_used_the_declared_dependency_versions(gate, record):
    installed = record["dependencies"]
    outside = [
        f"{requirement} (ran {installed.get(Requirement(requirement).name)})"
        for requirement in gate.declared_dependencies()
        if not Requirement(requirement).specifier.contains(
            installed.get(Requirement(requirement).name) or "0.dev0", prereleases=True
        )
    ]
    assert outside == []


def test_the_hash_covers_the_package_and_the_gpu_tests_helpers(gate, tmp_path):
    files = {p.relative_to(ROOT).as_posix() for p in gate.gpu_code_files()}
    assert {"src/kestrel/sampling.py", "src/kestrel/server/app.py", "tests/reference.py"} <= files
    tree = tmp_path / "tree"
    for part in ("src/kestrel", "tests"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = gate.gpu_code_hash(tree)
    sampling = tree / "src" / "kestrel" / "sampling.py"
    sampling.write_text(sampling.read_text() + "\n# changed\n")
    assert gate.gpu_code_hash(tree) != before


@pytest.mark.parametrize("selection", [["-k", "paged"], ["tests/test_gpu_kernels.py"], ["-x"]])
def test_the_gate_refuses_a_partial_run(selection, tmp_path):
    out = tmp_path / "record.json"
    gate = [sys.executable, str(ROOT / "benchmarks" / "gpu_gate.py"), "-o", str(out)]
    done = subprocess.run([*gate, "-n", "2", *selection], capture_output=True, text=True)
    assert done.returncode == 2 and not out.exists()
    assert re.search(r"refused .*the whole GPU test set", done.stderr)


def test_every_gpu_test_is_in_the_gpu_test_set():
    """Tests marked `gpu` outside tests/test_gpu_*.py would never run in the gate."""
    marked = re.compile(r"^(pytestmark = pytest\.mark\.gpu|\s*@pytest\.mark\.gpu)", re.M)
    outside = [
        p.name
        for p in (ROOT / "tests").glob("test_*.py")
        if marked.search(p.read_text()) and not p.match("test_gpu_*.py")
    ]
    assert outside == []


def test_the_one_gpu_set_needs_only_one_gpu():
    """The gate runs on one card, where a test needing a second would skip and leave the record
    unclean: those are marked `two_gpus` and live in tests/test_two_gpus.py."""
    needs_two = re.compile(r"mark\.two_gpus|device_count\(\)\s*<\s*2")
    inside = [p.name for p in ROOT.glob("tests/test_gpu_*.py") if needs_two.search(p.read_text())]
    assert inside == []
