"""The paged KV pool and its PyTorch attention fallback equal the dense reference path (CPU).

The GPU runner packs batches over a BlockPool; here it runs on the CPU with the fallback kernel and
is driven through the same chunk schedule as the reference runner: trimmed (--max-kv-size), sunk
(keep) and sliding-window sequences, several sequences per batch, prefill and decode mixed.
"""

import pytest
import torch
from transformers import (
    ExaoneMoeConfig,
    Gemma3TextConfig,
    Gemma4TextConfig,
    Glm4MoeLiteConfig,
    JambaConfig,
    LlamaConfig,
    MiniCPM3Config,
    Mistral4Config,
    NemotronHConfig,
)

from kestrel.cache.blocks import BlockManager
from kestrel.config import CacheConfig, SchedulerConfig
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.engine.runner import run_step
from kestrel.engine.scheduler import ScheduledChunk, Scheduler, take_blocks
from kestrel.models.nemotron_nas import NemotronNasConfig
from kestrel.sampling import SamplingParams, argmax_rows
from kestrel.weights.loader import build_model
from test_models_glm4_moe_lite import CONFIG as GLM4_MOE_LITE
from test_models_jamba import CONFIG as JAMBA
from test_models_minicpm3 import CONFIG as MINICPM3
from test_models_mistral4 import COMMON as MISTRAL4
from test_models_nemotron_h import CONFIG as NEMOTRON_H

# the attention dimensions gemma3's and exaone_moe's tiny models share
SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)


S, F = "sliding_attention", "full_attention"


def gemma3_config(window):
    return Gemma3TextConfig(**SMALL, sliding_window=window or 6, layer_types=[S, S, F])


def exaone_moe_config(window):  # GQA over sliding and full layers, sigmoid-routed MoE
    return ExaoneMoeConfig(
        **SMALL,
        sliding_window=window or 6,
        layer_types=[S, F, S],
        mlp_layer_types=["dense", "sparse", "sparse"],
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        num_shared_experts=1,
    )


def gemma4_config(window):
    """Full layers with their own head dim and KV heads (K = V), the last two layers reading
    layers 2's and 3's caches, per-layer inputs and routed experts beside the dense MLP."""
    rope = {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6}
    return Gemma4TextConfig(
        **{**SMALL, "num_hidden_layers": 6},
        sliding_window=window or 6,
        layer_types=[S, S, F, S, S, F],
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=97,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=16,
        final_logit_softcapping=20.0,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4}, F: rope},
    )


def nas_block(attention: str = "gqa", group: int = 1, ffn: str = "mlp") -> dict:
    """A `block_configs` entry: GQA of `group` query heads per KV head, or the flag named."""
    return {
        "attention": {"n_heads_in_group": group} if attention == "gqa" else {attention: True},
        "ffn": {"ffn_mult": 1.0} if ffn == "mlp" else {ffn: True},
    }


def nemotron_nas_config(window):
    """GQA blocks of 4, 1 and 2 KV heads between linear and no-op attention blocks."""
    blocks = [
        nas_block("gqa", 1),
        nas_block("replace_with_linear", ffn="replace_with_linear"),
        nas_block("gqa", 4),
        nas_block("no_op", ffn="no_op"),
        nas_block("gqa", 2),
    ]
    fields = {k: v for k, v in SMALL.items() if k not in ("intermediate_size", "head_dim")}
    return NemotronNasConfig(**{**fields, "num_hidden_layers": 5}, block_configs=blocks)


def llama_config(window):
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    if window:  # every layer slides (Mistral-style): blocks behind the window are freed
        config.model_type = "mistral"
        config.sliding_window = window
    return config


# MLA families (latent pool): their transformers tests' tiny configs. MiniCPM3's LongRoPE switches
# to its long factors for chunks ending at position 32 or later; Mistral 4 scales its queries by
# position (Llama-4 scaling) with low-rank queries and interleaved RoPE pairs
TINY_CONFIGS = {
    "llama": llama_config,
    "gemma3": gemma3_config,
    "exaone_moe": exaone_moe_config,
    "gemma4": gemma4_config,
    "nemotron_nas": nemotron_nas_config,
    "minicpm3": lambda window: MiniCPM3Config(**MINICPM3),
    "glm4_moe_lite": lambda window: Glm4MoeLiteConfig(**GLM4_MOE_LITE),
    "mistral4": lambda window: Mistral4Config(**MISTRAL4, q_lora_rank=12, rope_interleave=True),
    # hybrids: Mamba2 (every block kind) and Mamba layers keep recurrent state in slots
    "nemotron_h": lambda window: NemotronHConfig(**NEMOTRON_H),
    "jamba": lambda window: JambaConfig(**JAMBA),
}


def tiny_model(kind: str, window=None):
    torch.manual_seed(0)
    model = build_model(TINY_CONFIGS[kind](window), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def run_both(
    model,
    prompts,
    schedule,
    max_kv_size=None,
    keep=0,
    block_size=4,
    num_blocks=64,
    images=None,
    ssm_dtype="float32",
    tol=1e-4,
):
    """Feed the same chunks to the reference and the paged runner; compare every logits row.
    `images`: per prompt, its MultimodalPrompt (or None for text); `ssm_dtype`: the paged
    runner's Mamba state (the reference keeps float32)."""
    ref = ModelRunner(model, torch.device("cpu"))
    paged = PagedRunner(
        model,
        torch.device("cpu"),
        8,
        64,
        256,
        CacheConfig(block_size=block_size, num_blocks=num_blocks, mamba_ssm_cache_dtype=ssm_dtype),
        cuda_graphs=False,
    )
    images = images or [None] * len(prompts)
    reqs = [
        Request(f"r{i}", p, SamplingParams(temperature=0), 10**6, max_kv_size, keep, mm)
        for i, (p, mm) in enumerate(zip(prompts, images, strict=True))
    ]
    blocks = BlockManager.of(paged.kv_memory(None))  # planned here as the scheduler plans
    for sizes in schedule:  # sizes[i]: tokens of request i this step (0: not scheduled)
        chunks = [planned(blocks, r, n) for r, n in zip(reqs, sizes, strict=True) if n]
        with torch.no_grad():
            for c in chunks:
                ref._cache(c)
            expected = model(ref._pack(chunks))
            actual = model(paged._pack_batch(chunks))
        torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)
        sampling = [c for c in chunks if c.samples]
        for c in chunks:
            ref.caches[c.request.request_id].advance(c.num_tokens)
            paged.caches[c.request.request_id].advance(c.num_tokens)
            c.request.num_computed += c.num_tokens
        next_ids = expected.argmax(-1).tolist()
        for c, token in zip(sampling, next_ids, strict=True):
            c.request.output_ids.append(token)
        blocks.commit()
    return paged


def planned(blocks: BlockManager, request: Request, n: int) -> ScheduledChunk:
    """A chunk of `request`'s next n tokens with its blocks taken, as the scheduler plans one."""
    return ScheduledChunk(request, n, table=take_blocks(blocks, request, n))


def chunked_schedule(lengths, chunk: int, decode: int) -> list[tuple[int, ...]]:
    """Every sequence prefills in chunks of `chunk` tokens, then decodes `decode` tokens."""
    done, steps = [0] * len(lengths), []
    while any(d < n + decode for d, n in zip(done, lengths, strict=True)):
        sizes = tuple(
            0 if d >= n + decode else min(chunk, n - d) if d < n else 1
            for d, n in zip(done, lengths, strict=True)
        )
        done = [d + m for d, m in zip(done, sizes, strict=True)]
        steps.append(sizes)
    return steps


def prompts(*lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]


def test_packed_prefill_and_decode_match_dense():
    model = tiny_model("llama")
    schedule = [(7, 5, 0), (1, 1, 9), *[(1, 1, 1)] * 6]
    run_both(model, prompts(7, 5, 9), schedule)


def test_trimmed_sequences_with_sinks_match_dense_and_free_blocks():
    model = tiny_model("llama")
    schedule = [(6, 3), (6, 1), *[(1, 1)] * 14]
    paged = run_both(model, prompts(12, 3), schedule, max_kv_size=10, keep=2)
    cache = paged.caches["r0"]
    assert cache.live_start > cache.keep  # it was trimmed past the sinks
    blocks, n_sink, main_start = cache.table()
    assert n_sink == 1 and main_start > 1  # sink block kept, a gap of freed blocks after it
    assert len(blocks) <= (10 + 4 - 1) // 4 + 2


def test_sliding_window_sequences_match_dense_and_free_blocks():
    model = tiny_model("llama", window=5)
    schedule = [(8,), (7,), *[(1,)] * 10]
    paged = run_both(model, prompts(15), schedule)
    held = [logical for logical, _ in paged.caches["r0"].blocks.held]
    assert held[0] > 0  # blocks wholly behind the window went back to the pool


def test_gemma3_mixed_sliding_and_full_layers_match_dense():
    model = tiny_model("gemma3", window=6)
    schedule = [(9, 4), (5, 1), *[(1, 1)] * 8]
    run_both(model, prompts(14, 4), schedule, max_kv_size=12, keep=1)


def test_exaone_moe_sliding_full_and_moe_layers_match_dense():
    model = tiny_model("exaone_moe", window=6)
    schedule = [(9, 4), (5, 1), *[(1, 1)] * 8]
    run_both(model, prompts(14, 4), schedule, max_kv_size=12, keep=1)


def test_gemma4_shared_kv_and_per_layer_head_sizes_match_dense():
    model = tiny_model("gemma4", window=6)
    schedule = [(9, 4), (5, 1), *[(1, 1)] * 8]
    paged = run_both(model, prompts(14, 4), schedule, max_kv_size=12, keep=1)
    # the two KV-shared layers hold no storage; full layers hold 1 KV head of 16
    shapes = [None if k is None else tuple(k.shape[2:]) for k in paged.pool.k]
    assert shapes == [(2, 8), (2, 8), (1, 16), (2, 8), None, None]


def test_nemotron_nas_per_layer_blocks_match_dense():
    model = tiny_model("nemotron_nas")
    schedule = [(9, 4), (5, 1), *[(1, 1)] * 8]
    paged = run_both(model, prompts(14, 4), schedule, max_kv_size=12, keep=1)
    shapes = [None if k is None else tuple(k.shape[2:]) for k in paged.pool.k]
    assert shapes == [(4, 8), None, (1, 8), None, (2, 8)]  # linear and no-op hold nothing


@pytest.mark.parametrize("kind", ["minicpm3", "glm4_moe_lite", "mistral4"])
def test_mla_latent_pool_matches_dense(kind):
    """MLA layers keep [latent, rope key] per token in one pool tensor (values inside the keys)
    and attend in latent space for every chunk, long prompts and trimmed sinks included."""
    model = tiny_model(kind)
    schedule = [(9, 4), (12, 1), (13, 1), *[(1, 1)] * 6]
    paged = run_both(model, prompts(40, 4), schedule, max_kv_size=30, keep=1)
    c = model.config
    assert [tuple(k.shape[2:]) for k in paged.pool.k] == [
        (1, c.kv_lora_rank + c.qk_rope_head_dim)
    ] * 3
    assert paged.pool.v == [None] * 3


@pytest.mark.parametrize("kind", ["nemotron_h", "jamba"])
def test_hybrid_recurrent_state_slots_match_dense(kind):
    """Mamba layers keep each sequence's conv window and SSM state in its slot of the state pool,
    carried across chunks (longer than the SSD chunk), chunks of one length scanned together and
    batched decode steps, trims included (recurrent state is never trimmed)."""
    model = tiny_model(kind)
    # chunks of one length share a scan (the two 4-token prompts), others go alone
    schedule = [(9, 4, 4), (12, 1, 1), (13, 1, 1), (6, 1, 1), *[(1, 1, 1)] * 6]
    paged = run_both(model, prompts(40, 4, 4), schedule, max_kv_size=30, keep=1)
    slots = [paged.caches[f"r{i}"].state_slot for i in range(3)]
    assert sorted(slots) == [1, 2, 3]  # one slot each, slot 0 left as scratch
    layout = model.state_layout()  # recurrent layers hold state and no KV; attention, KV only
    assert [t is not None for t in paged.states.ssm] == [s is not None for s in layout]
    assert all(k is None for k, s in zip(paged.pool.k, layout, strict=True) if s)


@pytest.mark.parametrize("kind", ["nemotron_h", "jamba"])
def test_a_bfloat16_ssm_state_stays_within_its_tolerance(kind):
    """`--mamba-ssm-cache-dtype bfloat16` keeps the SSM state in half the bytes (the scans still
    compute in float32): through chunked prefill and decode, logits stay within bf16 tolerance
    of the float32 reference."""
    model = tiny_model(kind)
    schedule = [(9, 4), (12, 1), (6, 1), *[(1, 1)] * 6]
    paged = run_both(model, prompts(27, 4), schedule, ssm_dtype="bfloat16", tol=3e-2)
    assert {t.dtype for t in paged.states.ssm if t is not None} == {torch.bfloat16}


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_sizes_agree(block_size):
    model = tiny_model("llama")
    run_both(model, prompts(10, 6), [(10, 6), *[(1, 1)] * 4], block_size=block_size, num_blocks=128)


@pytest.mark.parametrize("vocab", [128256, 49152, 1000])  # 1000: not split, PyTorch's argmax
def test_argmax_rows_picks_the_first_largest_like_argmax(vocab):
    """The two-pass argmax of greedy sampling: the same index as argmax, the first of tied
    largest values (across chunks and within one), for a decode step of 2 and of 5 rows."""
    torch.manual_seed(0)
    for rows in (2, 5):
        logits = torch.randn(rows, vocab).to(torch.bfloat16)
        top = logits.max() + 1
        logits[0, [7, vocab - 3]] = top  # tied in different chunks: the first wins
        logits[-1, [vocab - 2, vocab - 1]] = top  # tied inside the last chunk
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))
        assert argmax_rows(logits)[0] == 7 and argmax_rows(logits)[-1] == vocab - 2


def test_runner_generates_same_greedy_tokens_as_reference():
    model = tiny_model("llama")
    outs = []
    for runner in (
        ModelRunner(model, torch.device("cpu")),
        PagedRunner(
            model,
            torch.device("cpu"),
            4,
            32,
            256,
            CacheConfig(block_size=4, num_blocks=64),
            cuda_graphs=False,
        ),
    ):
        reqs = [
            Request(f"q{i}", p, SamplingParams(temperature=0), 6)
            for i, p in enumerate(prompts(5, 8))
        ]
        blocks = BlockManager.of(runner.kv_memory(None))
        while any(not r.finished for r in reqs):
            chunks = [planned(blocks, r, r.num_pending) for r in reqs if not r.finished]
            results = runner.execute(chunks)
            for c in chunks:
                c.request.num_computed += c.num_tokens
            for res in results:
                res.request.output_ids.append(res.token)
                if len(res.request.output_ids) >= 6:
                    res.request.finish("length")
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]


def scheduler_for(runner, **config) -> Scheduler:
    """A scheduler over the runner's KV memory (`config`: SchedulerConfig's fields)."""
    config = SchedulerConfig(**config)
    return Scheduler(config, runner.kv_memory(config.kv_capacity))


def run_to_end(runner, requests, logprobs: dict | None = None, scheduler=None, **config) -> int:
    """Drive scheduler and runner until every request has its max_tokens; the preemptions.
    `logprobs`, when given, gets each request's first-step log-probs by id; `scheduler`: one
    that outlives the call (its blocks, their prefix cache), else a new one of `config`."""
    scheduler = scheduler or scheduler_for(runner, **config)
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        for result in run_step(scheduler, runner):
            assert result.error is None, result.error
            if result.token is not None:
                if logprobs is not None:
                    logprobs.setdefault(result.request.request_id, result.logprobs)
                result.request.output_ids.append(result.token)
                if len(result.request.output_ids) >= result.request.max_tokens:
                    result.request.finish("length")
        for request in scheduler.remove_finished():
            runner.release(request.request_id)
    return scheduler.num_preempted


def _seeded_run(runner, capacity) -> tuple[list[list[int]], int]:
    """Seeded temperature-1 sampling of three prompts under a KV capacity: (outputs, preempted)."""
    requests = [
        Request(f"s{i}", p, SamplingParams(temperature=1.0, seed=7 + i), 12)
        for i, p in enumerate(prompts(6, 9, 5))
    ]
    preempted = run_to_end(
        runner, requests, max_num_seqs=3, prefill_chunk_size=4, kv_capacity=capacity
    )
    return [r.output_ids for r in requests], preempted


@pytest.mark.parametrize("paged", [False, True])
def test_seeded_sampling_continues_exactly_across_preemption(paged):
    model, cpu = tiny_model("llama"), torch.device("cpu")

    def make(capacity):  # the paged pool: 64 blocks, or as many as `capacity` tokens need
        if paged:
            cache = CacheConfig(block_size=4, num_blocks=64)
            return PagedRunner(model, cpu, 3, 16, 256, cache, False, capacity)
        return ModelRunner(model, cpu)

    alone, none_preempted = _seeded_run(make(None), None)
    squeezed, preempted = _seeded_run(make(40), 40)
    assert none_preempted == 0 and preempted > 0  # the case this test is about happened
    assert squeezed == alone


def test_pool_sized_by_a_probe_step_then_generates_as_reference():
    """With no fixed `num_blocks` the runner sizes its pool: on CUDA from the memory it measures
    around a probe of the largest step, on the CPU for every running sequence's whole context.
    A probe that the runner cannot run breaks every GPU user at start, so CI runs it
    too."""
    model, cpu = tiny_model("llama"), torch.device("cpu")
    seqs = prompts(5, 8)

    def greedy(runner):
        reqs = [Request(f"p{i}", p, SamplingParams(temperature=0), 6) for i, p in enumerate(seqs)]
        run_to_end(runner, reqs, max_num_seqs=4, prefill_chunk_size=4)
        return [r.output_ids for r in reqs]

    paged = PagedRunner(model, cpu, 4, 16, 256, CacheConfig(block_size=4), cuda_graphs=False)
    blocks = 4 * (256 // 4 + 1) + 1  # a partial block per context, and block 0 (padding)
    assert paged.pool.num_blocks == blocks and paged.kv_memory(None).num_blocks == blocks - 1
    paged._run_probe_step()
    assert paged.pool is None and not paged.caches  # the probe left nothing behind
    paged._use_pool(blocks)
    assert greedy(paged) == greedy(ModelRunner(model, cpu))


@pytest.mark.parametrize(
    "kind,window,max_kv_size",
    [
        ("llama", None, None),
        ("llama", 7, None),
        ("gemma3", 6, 12),
        ("exaone_moe", 6, 12),
        ("gemma4", 6, 12),
        ("nemotron_nas", None, None),
        ("glm4_moe_lite", None, 12),
        ("mistral4", None, None),
        ("nemotron_h", None, 12),
        ("jamba", None, None),
    ],
)
def test_a_pool_too_small_for_the_load_preempts_and_every_request_gets_its_solo_output(
    kind, window, max_kv_size
):
    """Eight requests of 22 tokens (6 blocks of 4 each) on a pool of 11 blocks: the scheduler
    admits what fits and preempts when decodes outgrow the pool, so none fails and each finishes
    with the greedy tokens it gets alone on the reference runner (trims and windows included)."""
    model, cpu = tiny_model(kind, window), torch.device("cpu")
    seqs = prompts(*range(7, 15))

    def requests():
        return [
            Request(f"x{i}", p, SamplingParams(temperature=0), 22 - len(p), max_kv_size, 2)
            for i, p in enumerate(seqs)
        ]

    solo = []
    for request in requests():
        run_to_end(ModelRunner(model, cpu), [request], max_num_seqs=1, prefill_chunk_size=4)
        solo.append(request.output_ids)
    paged = PagedRunner(model, cpu, 8, 40, 256, CacheConfig(block_size=4, num_blocks=12), False)
    crowd, scheduler = requests(), scheduler_for(paged, max_num_seqs=8, prefill_chunk_size=4)
    preempted = run_to_end(paged, crowd, scheduler=scheduler)
    assert [r.output_ids for r in crowd] == solo
    assert preempted > 0  # the pool ran out, and that was survived
    assert scheduler.blocks.num_free == 11 and not scheduler.blocks.tables  # every block back
    assert not paged.caches
