"""The prefill and decode roles (distributed/disaggregated.py) over the paged pools of two real
engines in one process, the blocks moved by an in-process transport with KVTransfer's interface
(the seam a network transport plugs into): an FP8 pool's blocks and scales arrive as written,
a decode pool without room recomputes the request to the same tokens, and blocks of another
layout are refused with nothing taken."""

import copy
from collections import deque

import pytest
import torch

from kestrel.config import build_config
from kestrel.distributed.disaggregated import DecodeRole, PrefillRole
from kestrel.distributed.kv_transfer import KVHandoff, KVTransferError
from kestrel.llm import load_engine
from kestrel.sampling import SamplingParams
from server_fixtures import tiny_model

PROMPTS = [[(i * 37 + j) % 900 + 20 for j in range(n)] for i, n in enumerate((45, 70, 21))]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


class Loopback:
    """KVTransfer's interface in one process: hand-offs are received in the order sent."""

    def __init__(self):
        self.sent: deque[KVHandoff] = deque()

    def send(self, handoff: KVHandoff) -> None:
        blocks = [None if b is None else b.clone() for b in handoff.blocks]  # a wire copies
        self.sent.append(KVHandoff(handoff.request_id, blocks, copy.deepcopy(handoff.meta)))

    def recv(self, expect: str | None = None) -> KVHandoff:
        handoff = self.sent.popleft()
        if expect is not None and handoff.request_id != expect:
            raise KVTransferError(f"expected {expect!r}, received {handoff.request_id!r}")
        return handoff


def engine(**settings):
    config = build_config(
        model=tiny_model(), device="cpu", ctx_size=512, max_num_seqs=4, **settings
    )
    return load_engine(config, progress=False)[0]


def run(engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def whole(settings: dict, params=GREEDY) -> dict[str, list[int]]:
    reference = engine(**settings)
    for i, ids in enumerate(PROMPTS):
        reference.add_request(f"r{i}", ids, params)
    return run(reference)


def disaggregated(settings: dict, decode_settings: dict | None = None, before_decode=None):
    """Tokens of PROMPTS through a prefill engine and a decode engine joined by a Loopback;
    `before_decode(decode engine)` runs before the hand-offs are added there."""
    link = Loopback()
    prefill, decode = engine(**settings), engine(**(decode_settings or settings))
    prefill.role, decode.role = PrefillRole(link), DecodeRole(link)
    requests = []
    for i, ids in enumerate(PROMPTS):
        request = prefill.add_request(f"r{i}", ids, GREEDY)
        request.handoff = True
        requests.append(copy.deepcopy(request))  # as the router keeps it
    first = run(prefill)
    if before_decode:
        before_decode(decode)
    for request in requests:
        decode.add(request)
    rest = run(decode)
    return {i: first[i] + rest.get(i, []) for i in first}, decode


def test_an_fp8_pool_hands_off_its_blocks_and_scales():
    fp8 = {"kv_cache_dtype": "fp8"}
    got, decode = disaggregated(fp8)
    assert got == whole(fp8)
    assert decode.runner.pool.calibrated


def test_the_decode_pool_holds_the_bits_the_prefill_pool_sent():
    link = Loopback()
    prefill, decode = engine(kv_cache_dtype="fp8"), engine(kv_cache_dtype="fp8")
    prefill.role, decode.role = PrefillRole(link), DecodeRole(link)
    request = prefill.add_request("r", PROMPTS[1], GREEDY)
    request.handoff = True
    handed = copy.deepcopy(request)
    first = run(prefill)["r"]
    sent = link.sent[0]
    sent = KVHandoff(sent.request_id, [b if b is None else b.clone() for b in sent.blocks])
    decode.add(handed)
    held = decode.scheduler.blocks.table("r").held
    blocks = decode.runner.export_blocks(held)
    assert [logical for logical, _ in held] == list(range(-(-len(PROMPTS[1]) // 64)))
    for got, want in zip(blocks, sent.blocks, strict=True):
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        )
    pool, sent_pool = decode.runner.pool, prefill.runner.pool
    for got, want in zip(
        pool.k_scale + pool.v_scale, sent_pool.k_scale + sent_pool.v_scale, strict=True
    ):
        assert torch.equal(got, want)
    assert handed.num_computed == len(PROMPTS[1]) and handed.output_ids == first


def test_a_decode_pool_without_room_recomputes_to_the_same_tokens(caplog):
    small = {"block_size": 16, "num_blocks": 9, "prefix_caching": False}
    busy = [(k * 11) % 700 + 30 for k in range(100)]

    def fill(decode):  # a long request holds most of the pool when the hand-offs arrive
        decode.add_request("busy", busy, SamplingParams(max_tokens=12, temperature=0))
        decode.step()

    with caplog.at_level("WARNING", logger="kestrel.disaggregated"):
        got, decode = disaggregated({"block_size": 16}, small, before_decode=fill)
    assert "no room for the KV" in caplog.text  # it was recomputed, not imported
    assert got == whole({"block_size": 16})


def test_blocks_of_another_layout_are_refused_with_nothing_taken():
    link = Loopback()
    prefill, decode = engine(block_size=16), engine(block_size=32)
    prefill.role, decode.role = PrefillRole(link), DecodeRole(link)
    request = prefill.add_request("r", PROMPTS[0], GREEDY)
    request.handoff = True
    handed = copy.deepcopy(request)
    run(prefill)
    with pytest.raises(KVTransferError, match="same model"):
        decode.add(handed)
    assert decode.scheduler.blocks.num_used == 0
    assert not decode.has_unfinished()
