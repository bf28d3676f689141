"""The paged GPU runner (Triton kernels, fused layers, CUDA graphs) generates the same greedy tokens
as the CPU reference runner, on tiny random models of every paged family in fp32, with and without a
KV bound (trimmed, sunk) and sliding windows. GPU only; skipped elsewhere."""

import copy

import pytest
import torch

from kestrel.config import CacheConfig
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.sampling import SamplingParams
from test_paged_cache import prompts, run_to_end, scheduler_for, tiny_model

pytestmark = pytest.mark.gpu


def generate(
    runner, seqs, steps, max_kv_size=None, keep=0, max_num_seqs=4, chunk=5, images=None, out=None
):
    """Each sequence's greedy tokens; `out`, when given, gets the scheduler (its blocks)."""
    images = images or [None] * len(seqs)
    reqs = [
        Request(f"g{i}", p, SamplingParams(temperature=0), steps, max_kv_size, keep, mm)
        for i, (p, mm) in enumerate(zip(seqs, images, strict=True))
    ]
    scheduler = scheduler_for(runner, max_num_seqs=max_num_seqs, prefill_chunk_size=chunk)
    run_to_end(runner, reqs, scheduler=scheduler)
    if out is not None:
        out.append(scheduler)
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize(
    "kind,window",
    [
        ("llama", None),
        ("llama", 7),
        ("gemma3", 6),
        ("exaone_moe", 6),
        ("nemotron_nas", None),
        ("gemma4", 6),
        ("minicpm3", None),
        ("glm4_moe_lite", None),
        ("mistral4", None),
        ("nemotron_h", None),
        ("jamba", None),
    ],
)
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("max_kv_size", [None, 12])
def test_gpu_greedy_tokens_equal_cpu(kind, window, graphs, max_kv_size):
    model = tiny_model(kind, window)
    seqs = prompts(9, 4, 13)
    expected = generate(ModelRunner(model, torch.device("cpu")), seqs, 32, max_kv_size, 2)
    gpu_model = copy.deepcopy(model).cuda()
    runner = PagedRunner(
        gpu_model,
        torch.device("cuda"),
        4,
        9,
        256,
        CacheConfig(block_size=16, num_blocks=200),
        cuda_graphs=graphs,
    )
    assert bool(runner.graphs) == graphs
    schedulers = []
    assert generate(runner, seqs, 32, max_kv_size, 2, out=schedulers) == expected
    assert schedulers[0].blocks.num_free == 199  # every block back after release


@pytest.mark.parametrize(
    "kind,window,max_kv_size",
    [
        ("llama", None, None),
        ("gemma3", 6, 12),
        ("exaone_moe", 6, None),
        ("nemotron_nas", None, None),
        ("gemma4", 6, 12),
        ("glm4_moe_lite", None, None),
        ("minicpm3", None, 12),
        ("nemotron_h", None, 12),
        ("jamba", None, None),
    ],
)
def test_gpu_pool_exhaustion_preempts_and_each_request_gets_its_solo_output(
    kind, window, max_kv_size
):
    """More concurrent requests than the pool holds (8 x 4 blocks of 16 on 9), preempted and
    recomputed with CUDA graphs on: each ends with the tokens it gets alone on an ample pool."""
    model = copy.deepcopy(tiny_model(kind, window)).cuda()
    seqs = prompts(*range(20, 28))

    def run(num_blocks, max_num_seqs, requests):
        cache = CacheConfig(block_size=16, num_blocks=num_blocks)
        runner = PagedRunner(model, torch.device("cuda"), max_num_seqs, 40, 256, cache)
        scheduler = scheduler_for(runner, max_num_seqs=max_num_seqs, prefill_chunk_size=8)
        return scheduler, run_to_end(runner, requests, scheduler=scheduler)

    def requests():
        return [
            Request(f"x{i}", p, SamplingParams(temperature=0), 60 - len(p), max_kv_size, 2)
            for i, p in enumerate(seqs)
        ]

    solo = []
    for request in requests():
        run(64, 1, [request])
        solo.append(request.output_ids)
    crowd = requests()
    scheduler, preempted = run(10, 8, crowd)
    assert preempted > 0
    assert [r.output_ids for r in crowd] == solo
    assert scheduler.blocks.num_free == 9


@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_image_prompts_generate_as_cpu(graphs):
    """A vision-language model on the paged runner: images encoded on the GPU, M-RoPE ids and image
    rows packed per batch, decode in CUDA graphs; the CPU reference's greedy tokens."""
    from tests.reference import load_kestrel
    from tests.vl_reference import image_prompt, tiny_vl_checkpoint
    from tests.vl_suite import MERGE, PATCH

    folder = tiny_vl_checkpoint()
    model, prompt = load_kestrel(folder), image_prompt(folder, PATCH, MERGE)
    seqs, images = [prompt.token_ids, prompts(11)[0], prompt.token_ids], [prompt, None, prompt]
    cpu = ModelRunner(model, torch.device("cpu"))
    expected = generate(cpu, seqs, 24, 40, 2, chunk=7, images=images)
    cache = CacheConfig(block_size=16, num_blocks=64)
    runner = PagedRunner(
        copy.deepcopy(model).cuda(), torch.device("cuda"), 4, 21, 256, cache, graphs
    )
    assert generate(runner, seqs, 24, 40, 2, chunk=7, images=images) == expected


@pytest.mark.parametrize(
    "kind,window", [("llama", None), ("llama", 7), ("gemma3", 6), ("glm4_moe_lite", None)]
)
def test_gpu_prefix_hits_give_the_tokens_of_cold_prompts(kind, window):
    """On CUDA (Triton attention over shared blocks, graphs for decode) a prompt served after
    another left its prefix cached gives the tokens it gives cold."""
    from tests.family_suite import greedy, served

    model = copy.deepcopy(tiny_model(kind, window)).cuda()
    first, second = prompts(70, 30)
    second = first[:40] + second  # blocks of 16: two in common

    def run(cache: bool):
        return served(model, [greedy(0, first), greedy(1, second)], cache, "cuda", 16)

    warm, cold = run(True), run(False)
    assert [cached for *_, cached in warm] == [0, 32] and [c for *_, c in cold] == [0, 0]
    assert [tokens for tokens, *_ in warm] == [tokens for tokens, *_ in cold]


@pytest.mark.parametrize("kind", ["nemotron_h", "jamba"])
def test_gpu_hybrid_prefix_hits_start_from_a_state_snapshot(kind):
    """A hybrid's next turn (the earlier prompt and more) starts from the recurrent state kept at
    the earlier prompt's last full block, and gives the tokens it gives cold."""
    from tests.family_suite import greedy, served

    model = copy.deepcopy(tiny_model(kind)).cuda()
    first, more = prompts(70, 30)
    second = first[:66] + more

    def run(cache: bool):
        return served(model, [greedy(0, first), greedy(1, second)], cache, "cuda", 16)

    warm, cold = run(True), run(False)
    assert [cached for *_, cached in warm] == [0, 64] and [c for *_, c in cold] == [0, 0]
    assert [tokens for tokens, *_ in warm] == [tokens for tokens, *_ in cold]


@pytest.mark.parametrize("kind", ["llama", "nemotron_h"])
def test_gpu_embeddings_beside_graph_decodes_equal_cpu(kind):
    """On CUDA, with graphs for the decode steps, embedding prompts (one of a single token) batched
    with greedy generations give the CPU reference runner's vectors, and the generations its
    tokens."""
    from test_embeddings import embedding_request, run

    model = tiny_model(kind)
    gen_prompts, emb_prompts = prompts(6, 9), prompts(11, 1, 7)

    def requests():
        gens = [
            Request(f"g{i}", p, SamplingParams(temperature=0), 16)
            for i, p in enumerate(gen_prompts)
        ]
        return gens, [embedding_request(i, p, "last") for i, p in enumerate(emb_prompts)]

    gens, embs = requests()
    expected, _ = run(ModelRunner(model, torch.device("cpu")), gens + embs, prefill_chunk_size=4)
    expected_tokens = [g.output_ids for g in gens]
    cache = CacheConfig(block_size=16, num_blocks=64)
    runner = PagedRunner(copy.deepcopy(model).cuda(), torch.device("cuda"), 4, 16, 256, cache)
    assert runner.graphs
    gens, embs = requests()
    vectors, _ = run(runner, gens + embs, prefill_chunk_size=4)
    assert sorted(vectors) == sorted(expected) == ["e0", "e1", "e2"]
    for name, vector in expected.items():
        torch.testing.assert_close(vectors[name].cpu(), vector, atol=1e-4, rtol=1e-4)
    assert [g.output_ids for g in gens] == expected_tokens


@pytest.mark.parametrize(
    "kind,window",
    [
        ("llama", 7),
        ("gemma3", 6),
        ("gemma4", 6),
        ("glm4_moe_lite", None),
        ("minicpm3", None),
        ("nemotron_h", None),
    ],
)
def test_gpu_fp8_kv_cache_stays_near_the_model_dtype_cache(kind, window):
    """--kv-cache-dtype fp8 on CUDA (the Triton kernels write and read e4m3 with per-head scales,
    decode in graphs): the tokens and log-probs of the fp32 pool within the CPU suite's bound,
    for plain, sliding, KV-shared, latent (MLA) and hybrid layers."""
    from tests.family_suite import FP8_LOGPROB_BOUND, fp8_logprob_gap, steps_served

    model = copy.deepcopy(tiny_model(kind, window)).cuda()
    (prompt,) = prompts(30)
    exact, fp8 = (steps_served(model, prompt, dtype, "cuda") for dtype in ("auto", "fp8"))
    assert fp8_logprob_gap(exact, fp8, FP8_LOGPROB_BOUND) < FP8_LOGPROB_BOUND
