"""The prefix cache's host tier (--kv-offloading-size): its index (LRU of keys -> host slots, one
ordered list of copies), the block manager's use of it, and the real engine on SmolLM2 and a
tiny hybrid: conversations evicted from a pool too small for all of them come back from host
memory and answer as a run without the tier does."""

import argparse

import pytest
import transformers
from tests import test_models_nemotron_h as nemotron_h
from tests.reference import save_tiny

from kestrel.cache.blocks import BlockManager
from kestrel.cache.host_tier import BlockCopy, HostTier
from kestrel.config import CacheConfig
from kestrel.engine.client import EngineStats
from kestrel.errors import InvalidRequestError
from kestrel.flags import add_engine_args
from kestrel.llm import LLM
from kestrel.sampling import SamplingParams
from kestrel.server.metrics import Metrics

KEYS = [bytes([i]) * 16 for i in range(8)]


# --- the index ----------------------------------------------------------------------------------


def test_a_full_tier_gives_the_least_recently_used_keys_slot_to_a_new_key():
    tier = HostTier(2)
    tier.offload(KEYS[0], block=5)
    tier.offload(KEYS[1], block=6)
    tier.offload(KEYS[0], block=7)  # offloaded again: only moves to the end, no copy
    tier.offload(KEYS[2], block=8)  # takes KEYS[1]'s slot, the least recently used
    assert KEYS[1] not in tier and KEYS[0] in tier and KEYS[2] in tier
    assert tier.slot_of[KEYS[2]] == 1 and tier.evictions == 1
    assert [c.block for c in tier.take_copies()] == [5, 6, 8]


def test_copies_are_listed_in_the_order_they_were_decided():
    tier = HostTier(1)
    tier.offload(KEYS[0], block=3)
    [block] = tier.restore([KEYS[0]], allocate=lambda: 9)
    tier.offload(KEYS[1], block=4)  # the one slot, reused after the copy back reads it
    assert block == 9
    assert tier.take_copies() == [
        BlockCopy(to_host=True, block=3, slot=0),
        BlockCopy(to_host=False, block=9, slot=0),
        BlockCopy(to_host=True, block=4, slot=0),
    ]
    assert tier.take_copies() == []


def test_keys_being_restored_keep_their_slots_while_allocating_offloads_others():
    tier = HostTier(2)
    tier.offload(KEYS[0], block=1)
    tier.offload(KEYS[1], block=2)
    evicted = iter([(KEYS[2], 3), (KEYS[3], 4)])

    def allocate():  # each allocation evicts a cached device block into the full tier
        key, block = next(evicted)
        tier.offload(key, block)
        return block

    blocks = tier.restore([KEYS[0], KEYS[1]], allocate)
    assert blocks == [3, 4] and KEYS[0] in tier and KEYS[1] in tier
    assert KEYS[2] not in tier and KEYS[3] not in tier  # no slot was left for them


# --- the block manager --------------------------------------------------------------------------


def cached_manager(num_blocks: int, host_slots: int) -> BlockManager:
    return BlockManager(num_blocks, block_size=4, prefix_caching=True, host_slots=host_slots)


def run_prompt(blocks: BlockManager, request_id: str, tokens: list[int]) -> None:
    """A prompt computed whole and finished: its full blocks cached, then let go."""
    table = blocks.table(request_id)
    hit = blocks.lookup(tokens, len(tokens))
    blocks.attach(table, hit)
    table.reserve(hit.tokens, len(tokens) - hit.tokens)
    blocks.publish(table, len(tokens), tokens, [])
    blocks.commit()
    blocks.release(request_id)


def test_a_finished_sequence_is_evicted_last_block_first():
    blocks = cached_manager(num_blocks=3, host_slots=0)
    run_prompt(blocks, "a", list(range(12)))  # blocks 0, 1, 2
    blocks.allocate()  # evicts one: the conversation's last block
    assert blocks.lookup(list(range(12)), 12).tokens == 8


def test_an_evicted_prefix_comes_back_from_the_host_tier_into_new_blocks():
    blocks = cached_manager(num_blocks=3, host_slots=4)
    prompt = list(range(12))
    run_prompt(blocks, "a", prompt)
    run_prompt(blocks, "b", list(range(100, 112)))  # evicts all three of a's blocks
    assert blocks.host.take_copies() == [BlockCopy(True, b, s) for b, s in ((2, 0), (1, 1), (0, 2))]
    hit = blocks.lookup(prompt, 12)
    assert hit.tokens == 12 and hit.blocks == () and hit.from_host == (0, 1, 2)
    blocks.attach(blocks.table("c"), hit)
    # each of b's blocks goes out (its last first) before a's come back into it; a's three keys
    # hold three of the four slots, so b's blocks take turns in the fourth
    assert blocks.host.take_copies() == [
        BlockCopy(True, 0, 3),
        BlockCopy(False, 0, 2),
        BlockCopy(True, 1, 3),
        BlockCopy(False, 1, 1),
        BlockCopy(True, 2, 3),
        BlockCopy(False, 2, 0),
    ]
    assert blocks.tables["c"].held == ((0, 0), (1, 1), (2, 2))


def test_a_host_hit_without_room_on_the_device_stays_on_the_host():
    blocks = cached_manager(num_blocks=3, host_slots=4)
    run_prompt(blocks, "a", list(range(12)))
    run_prompt(blocks, "b", list(range(100, 112)))
    held = blocks.table("x")
    held.reserve(0, 8)  # two of the three blocks are taken by a running sequence
    assert blocks.lookup(list(range(12)), 12).tokens == 0


# --- flags --------------------------------------------------------------------------------------


def test_a_negative_offloading_size_is_refused_naming_the_flag(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-offloading-size", "-1"])
    assert "--kv-offloading-size" in capsys.readouterr().err
    assert parser.parse_args(["--kv-offloading-size", "0.5"]).kv_offloading_size == 0.5
    with pytest.raises(InvalidRequestError) as error:
        CacheConfig(kv_offloading_size=-2)
    assert error.value.param == "kv_offloading_size"


def test_an_offloading_size_below_one_block_names_the_flag():
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        LLM(progress=False, num_blocks=8, block_size=16, kv_offloading_size=1e-6)


# --- the real engine ----------------------------------------------------------------------------

TURNS, CONVERSATIONS, OUTPUT = 3, 3, 6


def conversation_turns(llm: LLM, opening: dict[int, list[int]], users) -> list[list[int]]:
    """Every conversation's turns, round robin (turn t of each, then turn t + 1), each turn's
    prompt the history so far plus a new user message; the greedy tokens of each turn."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
    history, answers = dict(opening), []
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            [result] = llm.generate([history[c]], params)
            tokens = result.outputs[0].token_ids
            answers.append(tokens)
            history[c] = history[c] + tokens + users(c, turn)
    return answers


def smollm2_conversations(llm: LLM):
    """Three conversations of about 90 tokens each, none sharing a block with another."""
    encode = llm.tokenizer.encode
    opening = {
        c: encode(f"Conversation {c}. " + " ".join(f"fact {c}-{i} holds." for i in range(12)))
        for c in range(CONVERSATIONS)
    }
    return conversation_turns(llm, opening, lambda c, t: encode(f" Turn {t} of {c}: go on."))


def hits(llm: LLM) -> dict[str, float]:
    """`kestrel_prefix_cache_hits_total` by tier, as /metrics serves it."""
    metrics = Metrics(lambda: None, EngineStats(load=llm.engine.snapshot()))
    return {
        sample.labels["tier"]: sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == "kestrel_prefix_cache_hits_total"
    }


# a pool of 16 blocks of 16 tokens: one conversation's history (up to ~10 blocks) fits, three don't
POOL = dict(progress=False, num_blocks=17, block_size=16, max_num_seqs=2)


@pytest.fixture(scope="module")
def without_tier():
    llm = LLM(**POOL)
    return smollm2_conversations(llm), hits(llm)


def test_conversations_evicted_from_a_small_pool_come_back_from_host_memory(without_tier):
    answers, device_only = without_tier
    llm = LLM(**POOL, kv_offloading_size=0.05)
    assert smollm2_conversations(llm) == answers
    tiered = hits(llm)
    assert device_only["host"] == 0
    # every later turn finds its whole history: all of it was evicted, most of it came back
    assert tiered["host"] > 0
    assert tiered["host"] + tiered["device"] > 2 * (device_only["host"] + device_only["device"])
    load = llm.engine.snapshot()
    assert 0 < load.prefix_host_blocks <= load.prefix_host_capacity


def test_a_hybrid_model_with_the_tier_on_answers_as_without_it(tmp_path, smollm2_tokenizer):
    """The hybrids' recurrent snapshots stay on the device (one per running slot: 4 here, so each
    conversation's outlives the other two's turns); their KV blocks go to the host and come back
    for a hit that ends at a snapshot."""
    folder = save_tiny(
        transformers.NemotronHForCausalLM,
        transformers.NemotronHConfig(**nemotron_h.CONFIG),
        tmp_path / "nemotron_h",
        tokenizer=smollm2_tokenizer,
        tweak=nemotron_h.perturb,
    )
    opening = {c: [(i * 37 + 11 * c) % 200 + 20 for i in range(40)] for c in range(CONVERSATIONS)}
    users = lambda c, t: [(c * 13 + t * 5 + i) % 200 + 20 for i in range(6)]  # noqa: E731
    pool = dict(model=str(folder), progress=False, num_blocks=9, block_size=16, max_num_seqs=4)
    cold = conversation_turns(LLM(**pool), opening, users)
    llm = LLM(**pool, kv_offloading_size=0.001)
    assert conversation_turns(llm, opening, users) == cold
    assert llm.engine.snapshot().prefix_host_hit_tokens > 0
