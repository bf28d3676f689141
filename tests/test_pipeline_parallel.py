"""Pipeline parallel on the CPU: two gloo processes, each holding a range of the decoder's layers
(the other layers pass through, their weights dropped), generate exactly what one process holding
the whole model generates (greedy tokens equal, first-step log-probs within 1e-4 in fp32) with
chunked prefill and a `--max-kv-size` trim, for dense, MoE, MLA and hybrid (Mamba) families: the
stages through the reference runner, then whole engines (`LLM(..., pipeline_parallel_size=2)`)
over the paged runner, whose workers kestrel starts; and the layer ranges' flag."""

import json
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from kestrel.config import build_config
from kestrel.distributed.group import join, leave
from kestrel.distributed.pipeline import decoder_layers, split_stages, stage_ranges
from kestrel.errors import InvalidRequestError
from kestrel.llm import LLM
from kestrel.sampling import SamplingParams
from server_fixtures import start_server
from test_paged_cache import tiny_model
from test_tensor_parallel import LONG_TEXT, checkpoints, generate_with, greedy  # noqa: F401

CPU = torch.device("cpu")

# (name, model factory, prefill chunk): dense, sliding/global, MoE with a dense layer, MLA with
# MoE, per-layer head sizes with shared KV, and two hybrids whose Mamba layers fall on both stages
MODELS = [
    ("llama", lambda: tiny_model("llama"), 5),
    ("gemma3", lambda: tiny_model("gemma3", window=6), 5),
    ("exaone_moe", lambda: tiny_model("exaone_moe"), 5),
    ("glm4_moe_lite", lambda: tiny_model("glm4_moe_lite"), 8),
    ("gemma4", lambda: tiny_model("gemma4"), 5),
    ("nemotron_h", lambda: tiny_model("nemotron_h"), 5),
    ("jamba", lambda: tiny_model("jamba"), 5),
]


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    join(rank, 2, CPU, f"tcp://127.0.0.1:{port}")
    try:
        for name, factory, chunk in MODELS:
            want_tokens, want_logprobs = greedy(factory(), chunk)
            stage = split_stages(factory(), rank, 2)
            held = [p.device.type != "meta" for p in decoder_layers(stage).parameters()]
            assert any(held) and not all(held), name  # a stage holds some layers, not all
            got_tokens, got_logprobs = greedy(stage, chunk)
            assert got_tokens == want_tokens, name
            for got, want in zip(got_logprobs, want_logprobs, strict=True):
                assert got.keys() == want.keys(), name
                for token, value in want.items():
                    assert abs(got[token] - value) < 1e-4, (name, token, got[token], value)
    finally:
        leave()


def test_two_stages_generate_what_one_whole_model_generates():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2, join=True)


@pytest.fixture(scope="module")
def with_hybrid(checkpoints, tmp_path_factory, smollm2_tokenizer):  # noqa: F811
    """The tensor-parallel tests' checkpoints and a Nemotron-H (Mamba2, attention and MLP
    layers) saved with SmolLM2's tokenizer."""
    from tests.test_families_server import FAMILIES

    folder = tmp_path_factory.mktemp("nemotron_h")
    FAMILIES["nemotron_h"].build(folder, len(smollm2_tokenizer))
    smollm2_tokenizer.save_pretrained(folder)
    return {**checkpoints, "nemotron_h": str(folder)}


@pytest.mark.parametrize(
    "family, layers",
    [("llama", "0-0,1-1"), ("exaone_moe", None), ("glm4_moe_lite", None), ("nemotron_h", None)],
)
def test_llm_over_two_stages_generates_what_one_process_generates(with_hybrid, family, layers):
    want = generate_with(with_hybrid[family])
    got = generate_with(with_hybrid[family], pipeline_parallel_size=2, pp_layers=layers)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got[:3], want[:3], strict=True):
        assert got_logprobs.keys() == want_logprobs.keys()
        assert all(abs(got_logprobs[t] - v) < 1e-4 for t, v in want_logprobs.items())


def test_serve_over_two_stages_answers_the_openai_client_as_one_process(checkpoints):  # noqa: F811
    prompts = ["Hello", "The quick brown fox", LONG_TEXT]
    llm = LLM(checkpoints["llama"], progress=False)
    want = [r.outputs[0].text for r in llm.generate(prompts, SamplingParams(temperature=0))]
    server = start_server(["-m", checkpoints["llama"], "-a", "tiny", "-pp", "2"])
    try:
        client = server.client()
        replies = [
            client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
            for p in prompts
        ]
        assert [r.choices[0].text for r in replies] == want
        assert "pipeline parallel: 2 ranks on cpu" in server.log()
    finally:
        server.stop()


def test_bench_engine_runs_over_two_stages(checkpoints):  # noqa: F811
    bench = [sys.executable, "-m", "kestrel", "bench", "-m", checkpoints["llama"], "-pp", "2"]
    work = ["--num-requests", "3", "--prompt-tokens", "16", "--output-tokens", "8"]
    done = subprocess.run(
        [*bench, "engine", *work, "--no-progress"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["pipeline_parallel_size"] == 2 and record["generated_tokens"] == 3 * 8


def test_a_rank_rebuilds_its_engine_over_the_smallest_pool(checkpoints):  # noqa: F811
    """Every rank sizes its own pool (a stage holds fewer layers' keys); the schedulers are
    replicas, so each engine is rebuilt over the smallest pool any rank sized."""
    from kestrel.distributed.workers import _resized
    from kestrel.engine.engine import Engine

    llm = LLM(checkpoints["llama"], progress=False)
    engine = llm.engine
    blocks = engine.scheduler.blocks.num_blocks
    build = lambda config: Engine(engine.runner.model, llm.tokenizer, config)  # noqa: E731
    assert _resized(engine, blocks, build) is engine
    smaller = _resized(engine, blocks // 2, build)
    assert smaller.scheduler.blocks.num_blocks == blocks // 2
    assert smaller.runner.pool.num_blocks == blocks // 2 + 1  # and the scratch block


def test_stage_ranges_split_evenly_or_as_told():
    assert stage_ranges(32, 2) == [(0, 16), (16, 32)]
    assert stage_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_ranges(32, 2, "0-9,10-31") == [(0, 10), (10, 32)]
    for spec in ("0-9,11-31", "0-9", "0-31,32-40", "a-b,c-d", "0-15,16-15"):
        with pytest.raises(ValueError, match="--pp-layers"):
            stage_ranges(32, 2, spec)
    # gemma4: layers 6 and 7 attend over the caches of layers 3 and 4, which join their stage
    shared = [0, 1, 2, 3, 4, 5, 3, 4]
    assert stage_ranges(8, 2, sources=shared) == [(0, 3), (3, 8)]
    with pytest.raises(ValueError, match="needs the cache of layer 3"):
        stage_ranges(8, 2, "0-3,4-7", shared)


def test_bad_parallel_settings_name_their_flag():
    for kwargs, param in [
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"pp_layers": "0-1,2-3"}, "pp_layers"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            build_config(**kwargs)
        assert error.value.param == param
