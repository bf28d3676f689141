"""Tensor parallel on the CPU: two gloo processes, each holding half of every attention block, MLP,
expert, embedding and head, generate exactly what one process holding the whole model generates (greedy
tokens equal, first-step log-probs within 1e-4 in fp32), through the reference runner with
chunked prefill and a `--max-kv-size` trim."""

import socket

import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig

from kestrel.distributed.group import TPGroup, join, leave
from kestrel.distributed.tensor_parallel import shard_model
from kestrel.engine.request import Request
from kestrel.engine.runner import ModelRunner
from kestrel.models.layers.attention import Attention
from kestrel.sampling import SamplingParams
from kestrel.weights.loader import build_model
from test_paged_cache import prompts, run_to_end, tiny_model

CPU = torch.device("cpu")


def one_kv_head(window):
    """4 query heads over 1 KV head: with 2 ranks each keeps a copy of the KV head."""
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)  # every rank, and the whole model, draw the same weights
    model = build_model(config, torch.float32, CPU)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


# (name, model factory): GQA with a vocabulary that does not split evenly (97), every layer
# sliding (Mistral), gemma3's sliding/global mix, replicated KV heads, and EXAONE-MoE (sigmoid,
# group-limited routing over experts split along their width, a shared expert, a dense layer)
MODELS = [
    ("llama", lambda: tiny_model("llama")),
    ("exaone_moe", lambda: tiny_model("exaone_moe")),
    ("mistral-sliding", lambda: tiny_model("llama", window=7)),
    ("gemma3", lambda: tiny_model("gemma3", window=6)),
    ("one-kv-head", lambda: one_kv_head(None)),
]


def greedy(model) -> tuple[list[list[int]], list[dict]]:
    """Three prompts in 5-token chunks under a 12-token KV bound (1 sink): tokens, log-probs."""
    params = SamplingParams(temperature=0, logprobs=5)
    requests = [Request(f"t{i}", p, params, 10, 12, 1) for i, p in enumerate(prompts(9, 14, 4))]
    logprobs = {}
    run_to_end(ModelRunner(model, CPU), requests, logprobs, max_num_seqs=3, prefill_chunk_size=5)
    return [r.output_ids for r in requests], [logprobs[r.request_id] for r in requests]


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    tp = join(rank, 2, CPU, f"tcp://127.0.0.1:{port}")
    try:
        for name, factory in MODELS:
            want_tokens, want_logprobs = greedy(factory())
            sharded = shard_model(factory(), tp)
            heads = [m.num_heads for m in sharded.modules() if isinstance(m, Attention)]
            assert heads and all(h == heads[0] for h in heads), name
            got_tokens, got_logprobs = greedy(sharded)
            assert got_tokens == want_tokens, name
            for got, want in zip(got_logprobs, want_logprobs, strict=True):
                assert got.keys() == want.keys(), name
                for token, value in want.items():
                    assert abs(got[token] - value) < 1e-4, (name, token, got[token], value)
    finally:
        leave()


def test_two_ranks_generate_what_one_whole_model_generates():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2, join=True)


def test_a_family_it_does_not_cover_is_refused_by_name():
    model = tiny_model("minicpm3")
    with pytest.raises(
        ValueError, match="does not cover MiniCPM3ForCausalLM.s layers .*self_attn.q_a_proj"
    ):
        shard_model(model, TPGroup(0, 2))
