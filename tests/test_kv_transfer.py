"""The KV hand-off seam (distributed/kv_transfer.py) between two real processes over gloo: blocks
of every dtype arrive bit-exact, with their metadata, in the order they were sent; a hand-off
for another request than the one expected is an error that names both."""

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from kestrel.distributed.kv_transfer import (
    DECODE_RANK,
    PREFILL_RANK,
    KVHandoff,
    KVTransfer,
    KVTransferError,
    _pack,
    _unpack,
    choose_backend,
)

CPU = torch.device("cpu")


def handoff(request_id: str, seed: int, num_blocks: int) -> KVHandoff:
    """K and V of 3 layers (float32, bfloat16, FP8 bits), one layer without KV, and metadata."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)  # (n, block_size, Hkv, D)
    k32 = torch.randn(shape, generator=g)
    k16 = torch.randn(shape, generator=g).to(torch.bfloat16)
    k8 = torch.randn(shape, generator=g).to(torch.float8_e4m3fn)
    blocks = [k32, k16, k8, None, k32 * 2, k16 * 2, k8.clone(), None]
    meta = {"first_token": seed, "offset": 4 * num_blocks - 1, "logical": list(range(num_blocks))}
    return KVHandoff(request_id, blocks, meta)


SENT = [("a", 1, 3), ("b", 2, 1), ("c", 3, 5)]


def same_bits(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return got.dtype == want.dtype and torch.equal(
        got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    )


def spawn_pair(main, devices=("cpu", "cpu")) -> None:
    """`main(rank, init_method, devices)` in two processes that join one hand-off group, the
    prefill rank on devices[0], the decode rank on devices[1]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(main, args=(f"tcp://127.0.0.1:{port}", devices), nprocs=2, join=True)


def round_trip(rank: int, init_method: str, devices) -> None:
    """The prefill rank sends SENT's hand-offs (from its device); the decode rank receives
    them on its own and checks every bit and the metadata."""
    device, peer = torch.device(devices[rank]), torch.device(devices[1 - rank])
    transfer = KVTransfer.join(rank, device, peer, init_method, timeout_s=120)
    try:
        if rank == PREFILL_RANK:
            for args in SENT:
                sent = handoff(*args)
                sent.blocks = [b if b is None else b.to(device) for b in sent.blocks]
                transfer.send(sent)
            while transfer.in_flight():  # the sends complete once received
                time.sleep(0.01)
            return
        for request_id, seed, n in SENT:
            got, want = transfer.recv(expect=request_id), handoff(request_id, seed, n)
            assert got.request_id == request_id
            assert all(b is None or b.device == device for b in got.blocks)
            got.blocks = [b if b is None else b.cpu() for b in got.blocks]
            assert got.meta == want.meta
            assert len(got.blocks) == len(want.blocks)
            assert all(same_bits(g, w) for g, w in zip(got.blocks, want.blocks, strict=True))
    finally:
        transfer.close()


def test_blocks_and_metadata_round_trip_bit_exact_in_order():
    spawn_pair(round_trip)


def _wrong_request(rank: int, init_method: str, devices) -> None:
    transfer = KVTransfer.join(rank, CPU, CPU, init_method, timeout_s=120)
    try:
        if rank == PREFILL_RANK:
            transfer.send(handoff("sent", 1, 2))
            while transfer.in_flight():
                time.sleep(0.01)
            return
        with pytest.raises(KVTransferError, match="'expected'.*'sent'"):
            transfer.recv(expect="expected")
    finally:
        transfer.close()


def test_a_hand_off_for_another_request_is_refused_naming_both():
    spawn_pair(_wrong_request)


@pytest.mark.parametrize(
    "device, peer, backend",
    [
        ("cpu", "cpu", "gloo"),
        ("cuda:0", "cuda:1", "nccl"),
        ("cuda:0", "cuda:0", "gloo"),  # two ranks on one GPU: NCCL cannot pair them
        ("cuda:0", "cpu", "gloo"),
    ],
)
def test_nccl_only_between_two_gpus(device, peer, backend):
    assert choose_backend(torch.device(device), torch.device(peer)) == backend


def test_ranks_are_prefill_then_decode():
    assert (PREFILL_RANK, DECODE_RANK) == (0, 1)


def test_a_payload_that_does_not_match_its_layout_is_refused():
    blocks = handoff("a", 1, 2).blocks
    payload = _pack([b for b in blocks if b is not None])
    layout = KVHandoff("a", blocks).layout()
    assert all(same_bits(g, w) for g, w in zip(_unpack(payload, layout), blocks, strict=True))
    with pytest.raises(KVTransferError, match="payload has"):
        _unpack(payload[:-1], layout)
