"""Embedding requests in the runners (CPU): a prompt's final-norm hidden states pooled (last token
or mean) and L2-normalized, computed in the same scheduled steps as generation. Vectors equal one
dense pass of the model over the whole prompt, however the prompt is chunked or batched, on the
reference runner and on the paged runner alike."""

import pytest
import torch
import torch.nn.functional as F

from kestrel.cache.sequence import SequenceCache
from kestrel.config import CacheConfig, SchedulerConfig
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.engine.runner import run_step
from kestrel.engine.scheduler import ScheduledChunk, Scheduler
from kestrel.models.batch import ForwardBatch
from kestrel.sampling import SamplingParams
from test_paged_cache import prompts, tiny_model

CPU = torch.device("cpu")


def make_runner(model, paged: bool, capacity: int | None = None):
    if not paged:
        return ModelRunner(model, CPU)
    return PagedRunner(
        model, CPU, 4, 16, 256, CacheConfig(block_size=4, num_blocks=64), False, capacity
    )


def one_pass(model, prompt: list[int], pooling: str) -> torch.Tensor:
    """The oracle: one forward over the whole prompt in a fresh dense cache, pooled."""
    batch = ForwardBatch.single(SequenceCache(model.cache_specs()), torch.tensor(prompt))
    with torch.inference_mode():
        hidden = model.hidden(batch)  # (T, H)
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return F.normalize(pooled.float(), dim=0)


def embedding_request(i: int, prompt: list[int], pooling: str) -> Request:
    return Request(f"e{i}", prompt, SamplingParams(), 0, pooling=pooling)


def run(runner, requests: list[Request], **config) -> tuple[dict[str, torch.Tensor], int]:
    """Drive scheduler and runner to the end; each embedding request's vector by id (generation
    requests generate their max_tokens greedily beside them), and how many preemptions there
    were."""
    config = SchedulerConfig(**config)
    scheduler = Scheduler(config, runner.kv_memory(config.kv_capacity))
    for request in requests:
        scheduler.add(request)
    vectors = {}
    while scheduler.has_work():
        for result in run_step(scheduler, runner):
            request = result.request
            assert result.error is None, result.error
            if result.embedding is not None:
                assert request.pooling is not None and result.token is None
                vectors[request.request_id] = torch.tensor(result.embedding)
                request.finish("stop")
            elif result.token is not None:
                request.output_ids.append(result.token)
                if len(request.output_ids) >= request.max_tokens:
                    request.finish("length")
        for request in scheduler.remove_finished():
            runner.release(request.request_id)
    return vectors, scheduler.num_preempted


@pytest.mark.parametrize("kind,window", [("llama", None), ("gemma3", 6), ("nemotron_h", None)])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_chunked_pooling_equals_one_pass(kind, window, paged, pooling):
    model = tiny_model(kind, window)
    seqs = prompts(13, 5, 1)
    requests = [embedding_request(i, p, pooling) for i, p in enumerate(seqs)]
    vectors, _ = run(make_runner(model, paged), requests, prefill_chunk_size=3, max_num_seqs=4)
    assert sorted(vectors) == ["e0", "e1", "e2"]
    for i, prompt in enumerate(seqs):
        expected = one_pass(model, prompt, pooling)
        torch.testing.assert_close(vectors[f"e{i}"], expected, atol=1e-5, rtol=1e-5)
        assert vectors[f"e{i}"].norm().item() == pytest.approx(1.0, abs=1e-6)
    # the two poolings differ (a multi-token prompt has more than its last state)
    other = "last" if pooling == "mean" else "mean"
    assert not torch.allclose(vectors["e0"], one_pass(model, seqs[0], other), atol=1e-3)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_both_runners_embed_alike_beside_generation(pooling):
    """Embedding prompts (one of them a single token, batched with decodes) running beside greedy
    generations: the same vectors on both runners, and the generations unchanged by them."""
    model = tiny_model("llama")
    gen_prompts, emb_prompts = prompts(6, 9), prompts(11, 1, 7)

    def mixed(paged: bool):
        gens = [
            Request(f"g{i}", p, SamplingParams(temperature=0), 8) for i, p in enumerate(gen_prompts)
        ]
        embs = [embedding_request(i, p, pooling) for i, p in enumerate(emb_prompts)]
        vectors, _ = run(make_runner(model, paged), gens + embs, prefill_chunk_size=4)
        return vectors, [g.output_ids for g in gens]

    def alone():
        gens = [
            Request(f"g{i}", p, SamplingParams(temperature=0), 8) for i, p in enumerate(gen_prompts)
        ]
        run(make_runner(model, False), gens, prefill_chunk_size=4)
        return [g.output_ids for g in gens]

    ref_vectors, ref_tokens = mixed(False)
    paged_vectors, paged_tokens = mixed(True)
    assert sorted(ref_vectors) == sorted(paged_vectors) == ["e0", "e1", "e2"]
    for name, vector in ref_vectors.items():
        torch.testing.assert_close(paged_vectors[name], vector, atol=1e-5, rtol=1e-5)
    assert ref_tokens == paged_tokens == alone()


def test_one_token_embedding_chunk_never_samples():
    """The paged runner replays CUDA graphs only for steps whose every chunk samples one token;
    a one-token embedding prompt completes without sampling, so it takes the eager path."""
    request = embedding_request(0, [5], "last")
    chunk = ScheduledChunk(request, 1)
    assert chunk.completes and not chunk.samples
    generation = Request("g", [5], SamplingParams(temperature=0), 4)
    assert ScheduledChunk(generation, 1).samples


@pytest.mark.parametrize("paged", [False, True])
def test_mean_pooling_survives_preemption(paged):
    """A generation's decodes outgrow a small KV capacity and preempt the newest running request,
    an embedding prompt part-way through its chunks: it is recomputed from its first token (its
    partial sum dropped), so its vector still equals one pass."""
    model = tiny_model("llama")
    gen_prompt, emb_prompts = prompts(6, 14, 13)[0], prompts(6, 14, 13)[1:]
    generation = Request("g", gen_prompt, SamplingParams(temperature=0), 16)
    requests = [generation] + [embedding_request(i, p, "mean") for i, p in enumerate(emb_prompts)]
    runner = make_runner(model, paged, 28)
    vectors, preempted = run(runner, requests, prefill_chunk_size=4, kv_capacity=28)
    assert preempted > 0  # the case this test is about happened
    for i, prompt in enumerate(emb_prompts):
        expected = one_pass(model, prompt, "mean")
        torch.testing.assert_close(vectors[f"e{i}"], expected, atol=1e-5, rtol=1e-5)
    assert not runner.pooled  # nothing left behind
