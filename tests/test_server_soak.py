"""The soak benchmark's fast version: benchmarks/soak.py for 20 seconds (and at
least 30 requests) on the tiny model. Its accounting must hold (no unexpected outcome, every
request classified, the server idle and healthy afterwards, exit 0), whatever the machine's speed;
the drift limits need the long run (the committed result)."""

import importlib.util
import json
from pathlib import Path

import pytest

from server_fixtures import tiny_model

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_short_soak_accounts_for_every_request(tmp_path):
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    out = tmp_path / "soak.json"
    argv = ["-m", tiny_model(), "--duration", "20", "--window", "5", "--concurrency", "6"]
    argv += ["--min-requests", "30"]  # seed 0's first 30 kinds include a cancelled stream (26th)
    soak.main([*argv, "--server-args", "-np 4 -c 512", "--out", str(out)])
    result = json.loads(out.read_text())
    totals = result["totals"]
    assert totals["unexpected"] == 0, result["windows"]
    assert sum(totals.values()) == result["requests"] >= 30  # each sent request counted once
    assert totals["errored"] == 0 and totals["completed"] > 0 and totals["cancelled"] > 0
    assert result["checks"]["idle_at_end"] and result["checks"]["healthy_at_end"]
    assert result["server_exit_code"] == 0
    assert len(result["windows"]) == 4
    # a window's latencies are those of the requests it completed: none, on a slow enough machine
    assert all((w["p99_s"] is None) == (w["completed"] == 0) for w in result["windows"])
    assert all(w["rss_mib"] > 0 for w in result["windows"])
