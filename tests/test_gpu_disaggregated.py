"""Disaggregated prefill and decode on one GPU: the KV hand-off between the two roles' pools
(gloo through host memory) arrives bit-exact on the receiver's device (`kestrel serve
--disaggregate` as a user starts it: tests/test_gpu_entry_points.py; the two-GPU hand-off over
NCCL: tests/test_two_gpus.py). GPU only; skipped elsewhere."""

import pytest

from test_kv_transfer import round_trip, spawn_pair

pytestmark = pytest.mark.gpu


def test_both_roles_on_one_gpu_hand_off_bit_exact():
    spawn_pair(round_trip, ("cuda:0", "cuda:0"))
