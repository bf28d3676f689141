"""Tensor parallel on the CPU: two gloo processes, each holding half of every attention block (GQA
or latent), MLP, expert (or half of the experts, with expert parallel), embedding and head,
generate exactly what one process holding the whole model generates (greedy tokens equal, first-step log-probs within 1e-4 in fp32) with chunked
prefill and a `--max-kv-size` trim: the sharded layers through the reference runner, then whole
engines (`LLM(..., tensor_parallel_size=2)`, `kestrel serve -tp 2`) whose workers kestrel starts;
a worker killed under a running server makes it answer 503 and exit non-zero."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, Mistral4Config

from kestrel.distributed.group import TPGroup, join, leave
from kestrel.distributed.tensor_parallel import shard_model
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.llm import LLM
from kestrel.models.gemma4 import Gemma4Attention
from kestrel.models.layers.attention import Attention
from kestrel.models.layers.mla import MultiHeadLatentAttention
from kestrel.sampling import SamplingParams
from kestrel.weights.loader import build_model
from server_fixtures import child_pids, start_server
from server_fixtures import tiny_model as server_tiny_model
from test_models_mistral4 import COMMON as MISTRAL4
from test_paged_cache import prompts, run_to_end, tiny_model

CPU = torch.device("cpu")


def one_kv_head():
    """4 query heads over 1 KV head: with 2 ranks each keeps a copy of the KV head."""
    config = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip
    return random_model(config)


def mla_q_proj():
    """Mistral 4 with a full-rank q_proj (no q_a_proj / q_b_proj) and rotate-half RoPE."""
    return random_model(Mistral4Config(**MISTRAL4, q_lora_rank=None, rope_interleave=False))


def mamba2_one_group():
    """Nemotron-H whose Mamba2 heads share one state group: B, C and the gated norm's group span
    both ranks' heads."""
    from test_paged_cache import TINY_CONFIGS

    return random_model(TINY_CONFIGS["nemotron_h"](None).__class__(**{
        **TINY_CONFIGS["nemotron_h"](None).to_dict(), "n_groups": 1
    }))  # fmt: skip


def random_model(config):
    torch.manual_seed(0)  # every rank, and the whole model, draw the same weights
    model = build_model(config, torch.float32, CPU)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


# (name, model factory, prefill chunk): GQA with a vocabulary that does not split evenly (97),
# every layer sliding (Mistral), gemma3's sliding/global mix, replicated KV heads, EXAONE-MoE
# (sigmoid, group-limited routing over experts split along their width, a shared expert, a dense
# layer), and MLA: minicpm3 (biases, LongRoPE), glm4_moe_lite (MoE), mistral4 (position-scaled
# queries) with low-rank queries, and mistral4 with a full q_proj, nemotron_nas (per-layer KV
# heads and MLP widths, linear and no-op blocks), gemma4 (KV-shared layers, keys as values,
# per-layer inputs, a dense MLP beside routed experts) and Nemotron-H (Mamba2 split by heads and
# state groups, or with one group kept whole; ungated MLPs; a latent MoE) and Jamba (Mamba split
# by channels, its x_proj row parallel). MLA prefills in 8-token chunks so that both its
# expanded (8 tokens) and latent-space (shorter, decode) attention run.
MODELS = [
    ("llama", lambda: tiny_model("llama"), 5),
    ("exaone_moe", lambda: tiny_model("exaone_moe"), 5),
    ("mistral-sliding", lambda: tiny_model("llama", window=7), 5),
    ("gemma3", lambda: tiny_model("gemma3", window=6), 5),
    ("one-kv-head", one_kv_head, 5),
    ("minicpm3", lambda: tiny_model("minicpm3"), 8),
    ("glm4_moe_lite", lambda: tiny_model("glm4_moe_lite"), 8),
    ("mistral4", lambda: tiny_model("mistral4"), 8),
    ("mistral4-q_proj", mla_q_proj, 8),
    ("nemotron_nas", lambda: tiny_model("nemotron_nas"), 5),
    ("gemma4", lambda: tiny_model("gemma4"), 5),
    ("nemotron_h", lambda: tiny_model("nemotron_h"), 5),
    ("nemotron_h-one-group", mamba2_one_group, 5),
    ("jamba", lambda: tiny_model("jamba"), 5),
]
ATTENTION = (Attention, MultiHeadLatentAttention, Gemma4Attention)
MOE = {"exaone_moe", "glm4_moe_lite"}  # also run with expert parallel


def greedy(model, chunk: int) -> tuple[list[list[int]], list[dict]]:
    """Three prompts in `chunk`-token chunks under a 12-token KV bound (1 sink): tokens,
    log-probs."""
    params = SamplingParams(temperature=0, logprobs=5)
    requests = [Request(f"t{i}", p, params, 10, 12, 1) for i, p in enumerate(prompts(9, 14, 4))]
    logprobs = {}
    runner = ModelRunner(model, CPU)
    run_to_end(runner, requests, logprobs, max_num_seqs=3, prefill_chunk_size=chunk)
    return [r.output_ids for r in requests], [logprobs[r.request_id] for r in requests]


def assert_same_generation(got, want, label) -> None:
    """(tokens, per-step log-probs) of a split model against the whole one's: the same tokens,
    log-probs within 1e-4."""
    assert got[0] == want[0], label
    for got_step, want_step in zip(got[1], want[1], strict=True):
        assert got_step.keys() == want_step.keys(), label
        for token, value in want_step.items():
            assert abs(got_step[token] - value) < 1e-4, (label, token, got_step[token], value)


def spawn_two_ranks(rank_main) -> None:
    """`rank_main(rank, port)` in two processes that join one gloo group on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(port,), nprocs=2, join=True)


def _rank(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    tp = join(rank, 2, CPU, f"tcp://127.0.0.1:{port}")
    try:
        for name, factory, chunk in MODELS:
            want = greedy(factory(), chunk)
            for experts in (False, True) if name in MOE else (False,):  # slices, whole experts
                sharded = shard_model(factory(), tp, expert_parallel=experts)
                heads = [m.num_heads for m in sharded.modules() if isinstance(m, ATTENTION)]
                assert heads and all(h == heads[0] for h in heads), name
                assert_same_generation(greedy(sharded, chunk), want, (name, experts))
    finally:
        leave()


def test_two_ranks_generate_what_one_whole_model_generates():
    spawn_two_ranks(_rank)


@pytest.mark.parametrize("family", ["minicpm3", "glm4_moe_lite", "mistral4"])
def test_latent_attention_splits_heads_and_keeps_the_whole_latent_cache(family):
    layout = tiny_model(family).kv_layout()
    sharded = shard_model(tiny_model(family), TPGroup(0, 2))
    assert sharded.kv_layout() == layout  # the latent and RoPE key are per token, not per head
    assert {m.num_heads for m in sharded.modules() if isinstance(m, ATTENTION)} == {2}


def test_expert_parallel_keeps_whole_experts():
    from kestrel.models.layers.moe import Experts

    whole = [m for m in tiny_model("exaone_moe").modules() if isinstance(m, Experts)]
    model = shard_model(tiny_model("exaone_moe"), TPGroup(1, 2), expert_parallel=True)
    held = [m for m in model.modules() if isinstance(m, Experts)]
    for before, after in zip(whole, held, strict=True):
        n = before.num_experts // 2
        assert after.num_experts == n and after.intermediate == before.intermediate
        assert torch.equal(after.down_proj, before.down_proj[n:])  # rank 1: the second half


def test_a_layer_no_rule_covers_is_refused_by_name():
    """Every family's Linears have a rule now; one no rule knows (here an extra projection
    beside a Llama's layers) is refused, named, rather than left whole and wrong."""
    model = tiny_model("llama")
    model.model.layers[1].adapter = torch.nn.Linear(8, 8)
    with pytest.raises(
        ValueError, match="does not cover LlamaForCausalLM.s layers model.layers.1.adapter"
    ):
        shard_model(model, TPGroup(0, 2))


# -- the engine over ranks: `LLM(..., tensor_parallel_size=2)` and `kestrel serve -tp 2` ---------

KV_BOUND = 12  # below the longer prompts: they are trimmed (4 sinks kept)
LONG_TEXT = " ".join(f"word{i}" for i in range(40))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, str]:
    """A dense family (the tiny Llama), an MoE one (EXAONE-MoE: sigmoid group-limited
    routing, a shared expert, a dense layer), an MLA one (GLM-4-MoE-Lite: the paged runner's
    fused low-rank projections over the latent pool), nemotron_nas (per-layer KV heads in the
    pool), gemma4 (KV-shared layers), Nemotron-H and Jamba (Mamba2 and Mamba state per rank), saved
    with SmolLM2's tokenizer."""
    from tests.test_families_server import FAMILIES

    folders = {"llama": server_tiny_model()}
    families = ("exaone_moe", "glm4_moe_lite", "nemotron_nas", "gemma4", "nemotron_h", "jamba")
    for family in families:
        folder = tmp_path_factory.mktemp(family)
        FAMILIES[family].build(folder, len(smollm2_tokenizer))
        smollm2_tokenizer.save_pretrained(folder)
        folders[family] = str(folder)
    return folders


def generate_with(model: str, built=None, **settings) -> list[tuple[list[int], dict]]:
    """Four prompts at once in 5-token chunks, one of them under a KV bound: each one's greedy
    tokens and first-step log-probs (`built(llm)` is called before they start)."""
    llm = LLM(model, progress=False, prefill_chunk_size=5, max_num_seqs=4, **settings)
    if built is not None:
        built(llm)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    prompts = ["Hello", "The quick brown fox", LONG_TEXT[:60], LONG_TEXT]
    results = llm.generate(prompts[:3], params)
    bounded = llm.engine.add_request("bounded", prompts[3], params, max_kv_size=KV_BOUND)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.shutdown()
    outputs = [(r.outputs[0].token_ids, r.outputs[0].logprobs[0]) for r in results]
    return [*outputs, (bounded.output_ids, None)]


@pytest.mark.parametrize(
    "family, experts",
    [
        ("llama", False),
        ("exaone_moe", False),
        ("exaone_moe", True),
        ("glm4_moe_lite", False),
        ("nemotron_nas", False),
        ("gemma4", False),
        ("nemotron_h", False),
        ("jamba", False),
    ],
)
def test_llm_over_two_ranks_generates_what_one_process_generates(checkpoints, family, experts):
    want = generate_with(checkpoints[family])
    got = generate_with(checkpoints[family], tensor_parallel_size=2, enable_expert_parallel=experts)
    assert_same_outputs(got, want)


def assert_same_outputs(got, want) -> None:
    """`generate_with`'s outputs: the same tokens, first-step log-probs within 1e-4."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, got_logprobs), (_, want_logprobs) in zip(got[:3], want[:3], strict=True):
        assert got_logprobs.keys() == want_logprobs.keys()
        assert all(abs(got_logprobs[t] - v) < 1e-4 for t, v in want_logprobs.items())


def test_heads_that_do_not_split_are_refused_before_any_worker_is_left(checkpoints):
    with pytest.raises(ValueError, match="4 query and 2 KV heads do not split over 3 ranks"):
        LLM(checkpoints["llama"], progress=False, tensor_parallel_size=3)
    assert not [pid for pid in child_pids(os.getpid()) if "worker_main" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read()
    except FileNotFoundError:
        return ""  # exited since it was listed


def test_serve_over_two_ranks_answers_the_openai_client_as_one_process(checkpoints):
    prompts = ["Hello", "The quick brown fox", LONG_TEXT]
    llm = LLM(checkpoints["llama"], progress=False)
    want = [r.outputs[0].text for r in llm.generate(prompts, SamplingParams(temperature=0))]
    server = start_server(["-m", checkpoints["llama"], "-a", "tiny", "-tp", "2"])
    try:
        client = server.client()
        with ThreadPoolExecutor(len(prompts)) as pool:  # batched together
            replies = list(
                pool.map(
                    lambda p: client.completions.create(
                        model="tiny", prompt=p, max_tokens=16, temperature=0
                    ),
                    prompts,
                )
            )
        assert [r.choices[0].text for r in replies] == want
        assert "tensor parallel: 2 ranks on cpu" in server.log()
    finally:
        server.stop()


def test_serve_over_two_ranks_answers_image_chats_as_one_process(tmp_path):
    """A vision-language model (Qwen3-VL-MoE, experts split by expert parallel): every rank keeps
    the vision tower whole and encodes the images itself; the decoder is split. Image chats of
    two sizes and a text one, sent together, give one process's greedy text."""
    from tests.test_server_vision_families import ALIAS, CONVERSATIONS, FAMILIES, chat
    from tests.vl_reference import save_tiny_vl, tiny_tokenizer
    from tests.vl_suite import MERGE, PATCH

    model_cls, config = FAMILIES["qwen3_vl_moe"]
    save_tiny_vl(model_cls, config(), tmp_path, tiny_tokenizer(), PATCH, MERGE)
    args = ["-m", str(tmp_path), "-a", ALIAS, "-np", "4", "--prefill-chunk-size", "8"]
    answers = []
    for parallel in ([], ["-tp", "2", "--enable-expert-parallel"]):
        server = start_server(args + parallel)
        try:
            with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
                answers.append(list(pool.map(lambda m, s=server: chat(s, m), CONVERSATIONS)))
        finally:
            server.stop()
    assert answers[1] == answers[0]


def test_a_killed_worker_makes_the_server_answer_503_and_exit_nonzero(checkpoints):
    server = start_server(
        ["-m", checkpoints["llama"], "-a", "tiny", "-tp", "2", "--no-restart-engine"]
    )
    try:
        (engine,) = child_pids(server.process.pid)
        (worker,) = child_pids(engine)
        client = server.client()
        stream = client.completions.create(
            model="tiny",
            prompt="a long story",
            max_tokens=4000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # in flight
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as refused:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        if isinstance(refused.value, openai.APIStatusError):
            assert refused.value.status_code == 503
        assert server.process.wait(30 - (time.monotonic() - killed)) != 0
        assert "tensor-parallel rank 1 exited (code -9)" in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize(
    "flag, field", [("-tp", "tensor_parallel_size"), ("-pp", "pipeline_parallel_size")]
)
def test_bench_engine_runs_over_two_ranks_and_other_modes_are_refused(checkpoints, flag, field):
    bench = [sys.executable, "-m", "kestrel", "bench", "-m", checkpoints["llama"], flag, "2"]
    work = ["--num-requests", "3", "--prompt-tokens", "16", "--output-tokens", "8"]
    done = subprocess.run(
        [*bench, "engine", *work, "--no-progress"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert record[field] == 2 and record["generated_tokens"] == 3 * 8
    refused = subprocess.run([*bench, "latency"], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "-tp and -pp run only as `kestrel bench engine`" in refused.stderr


# -- loading only a rank's shard -------------------------------------------------------------------


def loaded_and_cut(config, tp: TPGroup):
    """(this rank's model from `load_sharded`, the whole model loaded and then cut to it)."""
    from kestrel.distributed.tensor_parallel import load_sharded
    from kestrel.loading import load_model

    sharded, _, _ = load_sharded(config, CPU, tp, expert_parallel=False, progress=False)
    return sharded, shard_model(load_model(config, CPU, progress=False)[0], tp)


def assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module, label) -> None:
    got, want = dict(got.named_parameters()), dict(want.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p), (label, name)


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("family", ["llama", "exaone_moe", "glm4_moe_lite", "gemma4", "nemotron_h"])
def test_a_rank_loads_its_shard_one_layer_at_a_time(family, checkpoints, monkeypatch):
    """`load_sharded` gives each rank exactly the tensors that loading the whole model and then
    cutting it gives, and while it loads a rank never holds more than its shard plus one whole
    layer (the loader reads a layer's tensors only when that layer's turn comes)."""
    import kestrel.loading
    from kestrel.config import build_config
    from kestrel.loading import load_model

    config = build_config(model=checkpoints[family])
    whole, _, _ = load_model(config, CPU, progress=False)
    whole_bytes = nbytes(whole.parameters())
    held: list[int] = []  # bytes materialized after each layer's load
    load_weights = kestrel.loading.load_weights

    def observed(model, *args, **kwargs):
        load_weights(model, *args, **kwargs)
        held.append(nbytes(p for p in model.parameters() if not p.is_meta))

    monkeypatch.setattr(kestrel.loading, "load_weights", observed)
    for rank in (0, 1):
        held.clear()
        sharded, cut = loaded_and_cut(config, TPGroup(rank, 2))
        assert_same_parameters(sharded, cut, (family, rank))
        shard_bytes = nbytes(sharded.parameters())
        layer_bytes = max(nbytes(layer.parameters()) for layer in whole.model.layers)
        assert len(held) == len(whole.model.layers)
        assert max(held) <= shard_bytes + layer_bytes < whole_bytes, (held, shard_bytes)


# -- tensor parallel inside pipeline stages: -tp 2 -pp 2, four ranks ----------------------------


@pytest.mark.parametrize("family", ["llama", "exaone_moe"])
def test_tensor_parallel_inside_pipeline_stages_generates_what_one_process_generates(
    checkpoints, family
):
    """Four ranks: two stages of two tensor-parallel ranks each (every stage collects over its
    own process group; hidden states go to the same tensor-parallel rank of the next stage)."""
    want = generate_with(checkpoints[family])
    got = generate_with(checkpoints[family], tensor_parallel_size=2, pipeline_parallel_size=2)
    assert_same_outputs(got, want)


@pytest.mark.parametrize("key", ["fp8-block", "mlx-4"])
def test_a_quantized_folder_gives_each_rank_the_shard_of_its_dequantized_weights(
    tmp_path, key, smollm2_tokenizer, monkeypatch
):
    """A quantized folder (its loader reads every tensor on a pass, so it loads in one pass
    before the cut, not a pass per layer): each rank's tensors are those of the whole
    dequantized model, cut."""
    from tests.test_quant_formats import write_pair

    import kestrel.loading
    from kestrel.config import build_config

    folder, _ = write_pair(tmp_path, key)
    smollm2_tokenizer.save_pretrained(folder)
    config = build_config(model=str(folder), quantized_weights="dequantize")
    passes = []
    load_weights = kestrel.loading.load_weights
    monkeypatch.setattr(
        kestrel.loading, "load_weights", lambda *a, **k: passes.append(1) or load_weights(*a, **k)
    )
    for rank in (0, 1):
        sharded, cut = loaded_and_cut(config, TPGroup(rank, 2))
        assert_same_parameters(sharded, cut, (key, rank))
    assert not passes  # no pass per layer
