"""The CPU benchmark's bookkeeping (benchmarks/cpu_generate.py, cpu_report.py): repeated runs
summarized as their median and range, ratios against the faster llama.cpp build, and a llama.cpp
worker that dies recorded as the peer's failure rather than raised as the benchmark's."""

import signal
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_generate  # noqa: E402  (the benchmark's own folder)
from cpu_report import ratios, summarize  # noqa: E402


def run(system: str, metric: str, tok_s: float, build: str | None = None, **fields) -> dict:
    record = {"model": "m", "system": system, "metric": metric, "tok_s": tok_s}
    record |= {"seconds": 1 / tok_s, **fields}
    return record | ({"build": build} if build else {})


def test_summary_is_the_median_run_with_the_range_and_every_run():
    runs = [run("kestrel", "decode", v, run_index=i) for i, v in enumerate([30.0, 10.0, 20.0])]
    summary = summarize(runs)
    assert summary["tok_s"] == 20.0 and summary["run_index"] == 2  # fields of the median run
    assert (summary["tok_s_min"], summary["tok_s_max"]) == (10.0, 30.0)
    assert summary["tok_s_runs"] == [30.0, 10.0, 20.0] and summary["runs"] == 3
    assert summary["seconds"] == pytest.approx(1 / 20)


def test_summary_of_an_even_number_of_runs_is_their_middle_mean():
    summary = summarize([run("kestrel", "decode", v) for v in [10.0, 40.0, 20.0, 30.0]])
    assert summary["tok_s"] == 25.0 and summary["runs"] == 4


def summaries(decode: dict[str, list[float]], prefill: dict[str, list[float]]) -> list[dict]:
    """Summaries of kestrel and both builds: decode and prefill_256 runs per label."""
    out = []
    for label, speeds in decode.items():
        system, _, build = label.partition(":")
        out.append(summarize([run(system, "decode", v, build or None) for v in speeds]))
    for label, speeds in prefill.items():
        system, _, build = label.partition(":")
        runs = [run(system, "prefill", v, build or None, prompt_tokens=256) for v in speeds]
        out.append(summarize(runs))
    return out


def test_ratio_to_llama_cpp_takes_the_faster_build_per_measurement():
    records = summaries(
        decode={"kestrel": [90, 100, 110], "llama.cpp:no-amx": [50, 50, 50]}
        | {"llama.cpp:default": [80, 80, 80]},
        prefill={"kestrel": [600, 600, 600], "llama.cpp:no-amx": [400, 400, 400]}
        | {"llama.cpp:default": [300, 300, 300]},
    )
    lines = {line["system"]: line for line in ratios("m", records)}
    best = lines["kestrel/llama.cpp"]
    assert best["decode"] == pytest.approx(100 / 80) and best["prefill_256"] == pytest.approx(1.5)
    assert best["peer_build"] == {"decode": "default", "prefill_256": "no-amx"}
    assert best["paired"]["decode"] == pytest.approx([90 / 80, 110 / 80])
    assert lines["kestrel/llama.cpp (no-amx)"]["decode"] == pytest.approx(2.0)
    assert lines["kestrel/llama.cpp (default)"]["prefill_256"] == pytest.approx(2.0)


def test_streams_are_set_against_the_peers_single_stream():
    records = summaries(decode={"kestrel": [100], "llama.cpp:no-amx": [50]}, prefill={})
    records.append(summarize([run("kestrel", "decode_streams", 300.0, streams=8)]))
    line = next(r for r in ratios("m", records) if r["system"] == "kestrel/llama.cpp (no-amx)")
    assert line["streams_vs_single"] == pytest.approx(6.0)


def test_a_build_that_crashed_leaves_the_other_as_the_only_peer():
    records = summaries(decode={"kestrel": [100], "llama.cpp:no-amx": [50]}, prefill={})
    records.append({"model": "m", "system": "llama.cpp", "build": "default", "metric": "crashed"})
    assert [line["system"] for line in ratios("m", records)] == ["kestrel/llama.cpp (no-amx)"]


def worker_args() -> Namespace:
    return Namespace(prompt_tokens=[16], decode_tokens=4, threads=1)


def test_a_worker_that_cannot_load_the_file_is_a_failed_peer(tmp_path, monkeypatch):
    # this interpreter as the build's: without llama_cpp it fails to import, with it the file
    monkeypatch.setitem(cpu_generate.LLAMA_CPP_BUILDS, "no-amx", sys.executable)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(cpu_generate.Crashed) as raised:
        cpu_generate.LlamaCpp(str(junk), worker_args(), "no-amx")
    assert raised.value.record["metric"] == "failed"
    assert raised.value.record["returncode"] == 1
    assert "Error" in raised.value.record["detail"]  # the worker's traceback, for the record


def test_a_worker_killed_by_a_signal_is_a_crashed_peer(monkeypatch):
    pytest.importorskip("llama_cpp")
    monkeypatch.setitem(cpu_generate.LLAMA_CPP_BUILDS, "no-amx", sys.executable)
    llama = cpu_generate.LlamaCpp("smollm2", worker_args(), "no-amx")
    assert llama.run(list(range(1, 17)), 2).decode_s > 0
    llama.worker.send_signal(signal.SIGSEGV)  # as llama.cpp's AMX path dies on some files
    with pytest.raises(cpu_generate.Crashed) as raised:
        llama.run(list(range(1, 17)), 2)
    assert raised.value.record["metric"] == "crashed"
    assert raised.value.record["returncode"] == -signal.SIGSEGV
