"""Pipeline parallel on the CPU: two gloo processes, each holding a range of the decoder's layers
(the other layers pass through, their weights dropped), generate exactly what one process holding
the whole model generates (greedy tokens equal, first-step log-probs within 1e-4 in fp32) with
chunked prefill and a `--max-kv-size` trim, for dense, MoE, MLA and hybrid (Mamba) families: the
stages through the reference runner, then whole engines (`LLM(..., pipeline_parallel_size=2)`,
`kestrel serve -pp 2` and the openai client) over the paged runner, whose workers kestrel starts;
the same split started as two torchrun "nodes" on this host, and as two `kestrel serve` processes
joined by the standard rendezvous variables; the layer ranges' flag; and every rank's engine
rebuilt over the smallest pool."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from kestrel.config import build_config
from kestrel.distributed.group import join, leave
from kestrel.distributed.pipeline import (
    decoder_layers,
    other_stages_parameters,
    split_stages,
    stage_of,
    stage_ranges,
)
from kestrel.errors import InvalidRequestError
from kestrel.llm import LLM
from kestrel.sampling import SamplingParams
from server_fixtures import start_server
from test_paged_cache import tiny_model
from test_tensor_parallel import (  # noqa: F401 (checkpoints: a fixture)
    LONG_TEXT,
    assert_same_generation,
    assert_same_outputs,
    checkpoints,
    generate_with,
    greedy,
    spawn_two_ranks,
)

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
            want = greedy(factory(), chunk)
            stage = split_stages(factory(), rank, 2)
            held = [p.device.type != "meta" for p in decoder_layers(stage).parameters()]
            assert any(held) and not all(held), name  # a stage holds some layers, not all
            assert_same_generation(greedy(stage, chunk), want, name)
    finally:
        leave()


def test_two_stages_generate_what_one_whole_model_generates():
    spawn_two_ranks(_rank)


@pytest.mark.parametrize(
    "family, layers",
    [("llama", "0-0,1-1"), ("exaone_moe", None), ("glm4_moe_lite", None), ("nemotron_h", None)],
)
def test_llm_over_two_stages_generates_what_one_process_generates(checkpoints, family, layers):  # noqa: F811
    want = generate_with(checkpoints[family])
    got = generate_with(checkpoints[family], pipeline_parallel_size=2, pp_layers=layers)
    assert_same_outputs(got, want)


class CountedStages:
    """A stage model's `pipeline` (distributed/pipeline.py StageOutputs), noting how many
    micro-batches each forward sends through the stages."""

    def __init__(self, stage):
        self.stage, self.stages, self.counts = stage, stage.stages, []

    def __call__(self, batches):
        self.counts.append(len(batches))
        return self.stage(batches)


@pytest.mark.parametrize("family", ["llama", "exaone_moe", "glm4_moe_lite", "nemotron_h"])
def test_micro_batches_through_two_stages_generate_what_one_process_generates(checkpoints, family):  # noqa: F811
    """Every step of at least 2 tokens is cut into micro-batches of about equal tokens (up to 2
    per stage: 4), prefill chunks cut inside: the latent pool (glm4_moe_lite), the trimmed
    request's chunks, and (nemotron_h) recurrent state carried from a chunk's first part to its
    second."""
    counted = []

    def count(llm):
        model = llm.engine.runner.model
        model.pipeline = CountedStages(model.pipeline)
        counted.append(model.pipeline)

    want = generate_with(checkpoints[family])
    got = generate_with(
        checkpoints[family], count, pipeline_parallel_size=2, pp_microbatch_tokens=1
    )
    assert_same_outputs(got, want)
    assert max(counted[0].counts) == 4 and min(counted[0].counts) == 1


def one_process(checkpoint: str, prompts: list[str]) -> list[str]:
    llm = LLM(checkpoint, progress=False)
    return [r.outputs[0].text for r in llm.generate(prompts, SamplingParams(temperature=0))]


def answers(server, prompts: list[str]) -> list[str]:
    """The server's greedy completions of `prompts`, as `one_process` runs them."""
    client = server.client()
    return [
        client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]


def test_serve_over_two_stages_answers_the_openai_client_as_one_process(checkpoints):  # noqa: F811
    prompts = ["Hello", "The quick brown fox", LONG_TEXT]
    want = one_process(checkpoints["llama"], prompts)
    server = start_server(["-m", checkpoints["llama"], "-a", "tiny", "-pp", "2"])
    try:
        assert answers(server, prompts) == want
        assert "pipeline parallel: 2 ranks on cpu" in server.log()
    finally:
        server.stop()


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


@pytest.mark.parametrize("model", ["exaone_moe", "smollm2", "shape:tiny"])
def test_a_stage_reads_only_its_layers_weights(checkpoints, model):  # noqa: F811
    """Loading for stage 1 of 2 (a safetensors folder, the real SmolLM2 GGUF, a random-weight
    shape) leaves the other stage's layers on the meta device, never read; the rest is loaded."""
    from kestrel.loading import load_model

    shape = model.removeprefix("shape:") if model.startswith("shape:") else None
    config = (
        build_config(shape=shape) if shape else build_config(model=checkpoints.get(model, model))
    )
    select = other_stages_parameters(1, 2)
    stage, _, _ = load_model(config, torch.device("cpu"), progress=False, select=select)
    first, end = stage_of(stage, 1, 2).layers
    assert 0 < first < end == len(decoder_layers(stage))
    for i, layer in enumerate(decoder_layers(stage)):
        assert {p.is_meta for p in layer.parameters()} == {not first <= i < end}, i
    outside = [p for n, p in stage.named_parameters() if ".layers." not in n]
    assert outside and not any(p.is_meta for p in outside)  # embedding, final norm, head


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
        ({"tensor_parallel_size": 0, "pipeline_parallel_size": 2}, "tensor_parallel_size"),
        ({"pp_layers": "0-1,2-3"}, "pp_layers"),
        ({"pp_microbatch_tokens": 64}, "pp_microbatch_tokens"),
        ({"pipeline_parallel_size": 2, "pp_microbatch_tokens": 0}, "pp_microbatch_tokens"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            build_config(**kwargs)
        assert error.value.param == param


@pytest.mark.parametrize("per_node, split", [(1, ["-pp", "2"]), (2, ["-tp", "2", "-pp", "2"])])
def test_two_torchrun_nodes_generate_what_one_process_generates(
    checkpoints,  # noqa: F811
    per_node,
    split,
):
    """The two stages started as two torchrun "nodes" on this host (separate launches, loopback
    rendezvous), each running the same `kestrel generate -pp 2`, one process a node, or `-tp 2
    -pp 2`, a stage's two tensor-parallel ranks on each node: rank 0 prints what one process
    prints, and every process exits 0."""
    command = ["-m", "kestrel", "generate", "-m", checkpoints["llama"], "-n", "12", "--temp", "0"]
    command += ["-p", "The quick brown fox"]
    one = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    launch += ["--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1"]
    launch += ["--master-port", str(port)]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(rank), *command, *split],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert outputs[0][0] == one.stdout and one.stdout.strip()
    assert outputs[1][0] == ""  # rank 1 serves rank 0's calls and prints nothing


def test_serve_on_two_joined_ranks_answers_the_openai_client(checkpoints):  # noqa: F811
    """`kestrel serve -pp 2` started on each "machine" with the standard rendezvous variables
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun sets them): rank 0 serves, rank 1
    runs its stage, the answers are one process's, and rank 1 exits 0 when rank 0 stops."""
    prompts = ["Hello", "The quick brown fox"]
    want = one_process(checkpoints["llama"], prompts)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = ["-m", checkpoints["llama"], "-a", "tiny", "-pp", "2"]
    follower = subprocess.Popen(
        [sys.executable, "-m", "kestrel", "serve", *args],
        env={**os.environ, **env, "RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = start_server(args, env={**env, "RANK": "0"})
    try:
        assert answers(server, prompts) == want
        assert "joined ranks: 2 on cpu" in server.log()
    finally:
        server.stop()
        out, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0, out[-3000:]
