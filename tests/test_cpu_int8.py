"""The CPU's int8 activations (decode's default where the CPU has VNNI) on the real embedded
models, against the float path in the same process: greedy decoding gives the same tokens until
a near tie, and the chosen tokens' log-probs stay within a bound (benchmarks/int8_accuracy.py
measures both over more prompts and steps; the figures are in benchmarks/README.md)."""

import sys
from pathlib import Path

import pytest

from kestrel import LLM
from kestrel.kernels import cpu_native

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from int8_accuracy import compare  # noqa: E402  (the benchmark's own folder)

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the CPU kernels")
BOUND = 0.3  # |log-prob difference| of the chosen token; measured up to 0.2 over 64 steps


@pytest.mark.parametrize("model", ["smollm2", "gemma3-270m"])
def test_int8_decode_stays_near_the_float_path(model):
    llm = LLM(model, progress=False, device="cpu", max_num_seqs=1, prefix_caching=False)
    record = compare(model, "The history of the printing press begins", 24, llm)
    assert 0 < record["max_abs_logprob_diff"] < BOUND  # the paths differ, a little
    if record["agree"] < record["steps"]:  # they part only where the float path nearly ties
        assert record["margin_where_they_part"] < 2 * BOUND
    assert not cpu_native.int8_activations()  # the suite's float path, put back (conftest)
