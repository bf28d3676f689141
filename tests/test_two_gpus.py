"""The tests that need two CUDA devices: disaggregated prefill on one GPU and decode on the other,
the KV hand-off over NCCL bit-exact and `kestrel serve --disaggregate` answering as one engine.
They are kept out of the one-GPU gate set (tests/test_gpu_*.py), which must run whole on one
card; marked `two_gpus` and skipped on machines with fewer."""

import pytest

from test_gpu_entry_points import serve_disaggregated_answers_as_one_engine
from test_kv_transfer import round_trip, spawn_pair

pytestmark = pytest.mark.two_gpus


def test_two_gpus_hand_off_bit_exact_over_nccl():
    spawn_pair(round_trip, ("cuda:0", "cuda:1"))


def test_serve_disaggregated_on_two_gpus_answers_as_one_engine():
    serve_disaggregated_answers_as_one_engine("cuda:0", "cuda:1")
