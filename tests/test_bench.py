"""`kestrel bench` on the CPU: a tiny random-weight shape, kestrel and the transformers peer, one
JSON line per measurement with the fields the results table reads."""

import json
import os

from kestrel.cli import main


def test_bench_tiny_shape_with_peer_prints_json_lines(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    argv = (
        "bench --shape tiny --num-requests 2 --prompt-tokens 12 --output-tokens 3 "
        "--latency-prompt-tokens 6 --latency-output-tokens 4 --peer transformers --no-progress "
        f"--bandwidth 1e10 --flops 1e11 -o {out}"
    ).split()
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = [(r["engine"].split()[0], r["mode"]) for r in records]
    assert kinds == [
        ("transformers", "latency"),
        ("transformers", "throughput"),
        ("kestrel", "latency"),
        ("kestrel", "throughput"),
    ]
    kestrel = records[3]
    assert kestrel["generated_tokens"] == 6 and kestrel["output_tok_s"] > 0
    assert kestrel["ceiling_output_tok_s"] > 0 and records[2]["ceiling_decode_tok_s"] > 0
    assert records[2]["decode_tok_s"] > 0 and "command" in kestrel and "commit" in kestrel


# -- kestrel bench serve against a real `kestrel serve` -------------------------------------------

import pytest  # noqa: E402
import torch  # noqa: E402
from tests.reference import save_tiny  # noqa: E402

from kestrel.bench.serve import percentile  # noqa: E402
from kestrel.weights.shapes import shape_tokenizer  # noqa: E402
from server_fixtures import start_server  # noqa: E402

KEY = "bench-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_tokenizer):
    """A tiny random llama checkpoint saved with SmolLM2's tokenizer, served with a key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    save_tiny(LlamaForCausalLM, config, folder, tokenizer=smollm2_tokenizer)
    server = start_server(
        ["-m", str(folder), "-a", "tiny", "-c", "256", "-np", "4", "--api-key", KEY]
    )
    yield server
    server.stop()


def _bench_serve(server, tmp_path, *flags: str) -> list[dict]:
    out = tmp_path / "serve.jsonl"
    out.unlink(missing_ok=True)
    argv = [
        "bench",
        "serve",
        "--url",
        server.url,
        "--api-key",
        KEY,
        "--no-progress",
        "-o",
        str(out),
        *flags,
    ]
    assert main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _generated(server) -> float:
    return server.metrics()["kestrel_generation_tokens_total"]


def test_bench_serve_measures_each_concurrency(server, tmp_path):
    before = _generated(server)
    records = _bench_serve(
        server,
        tmp_path,
        "--concurrency",
        "1",
        "4",
        "--num-requests",
        "4",
        "--prompt-tokens",
        "8",
        "--output-tokens",
        "5",
        "--vocab-size",
        "49152",
    )
    assert [r["concurrency"] for r in records] == [1, 4]
    for r in records:
        assert (r["mode"], r["model"], r["completed"], r["failed"]) == ("serve", "tiny", 4, 0)
        # exactly the asked-for tokens (ignore_eos), counted from the server's usage
        assert r["generated_tokens"] == 20 and r["mean_prompt_tokens"] == 8
        assert r["output_tok_s"] == pytest.approx(20 / r["elapsed_s"])
        for name in ("ttft", "tpot", "itl"):
            assert 0 < r[f"{name}_p50_s"] <= r[f"{name}_p99_s"] < r["elapsed_s"]
        assert r["ttft_p99_s"] + r["tpot_p50_s"] < r["elapsed_s"]
        assert "command" in r and "commit" in r
    # the server generated what the client counted, plus the one warm-up request's 4 tokens
    assert _generated(server) - before == 4 + 2 * 20


def test_bench_serve_chat_with_text_prompts(server, tmp_path):
    (r,) = _bench_serve(
        server,
        tmp_path,
        "--endpoint",
        "chat",
        "--prompt-format",
        "text",
        "--prompts",
        "fixed",
        "--concurrency",
        "2",
        "--num-requests",
        "2",
        "--prompt-tokens",
        "6",
        "--output-tokens",
        "3",
    )
    assert (r["endpoint"], r["completed"], r["generated_tokens"]) == ("chat", 2, 6)
    assert r["mean_prompt_tokens"] > 6  # six words inside the chat template


def test_bench_serve_reports_a_refused_key(server, capsys):
    argv = ["bench", "serve", "--url", server.url, "--api-key", "wrong", "--no-progress"]
    with pytest.raises(SystemExit, match="401"):
        main(argv)


def test_percentile_matches_numpy():
    import numpy

    values = torch.rand(37, generator=torch.Generator().manual_seed(0)).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(numpy.percentile(values, q))
    assert percentile([], 50) is None


# -- named random shapes and the CUDA flags through serve / generate / LLM --------------------------


def test_shape_tokenizer_covers_the_vocabulary():
    tok = shape_tokenizer(600)
    assert len(tok) == 600 and tok.decode(tok("Hello, world")["input_ids"]) == "Hello, world"
    words = [tok.decode([i]) for i in range(258, 600)]  # past the 256 bytes, BOS and EOS
    assert all(w.startswith(" t") for w in words) and len(set(words)) == len(words)


ENGINE_FLAGS = [
    "--shape",
    "tiny",
    "--gpu-memory-utilization",
    "0.5",
    "--no-cuda-graphs",
    "--block-size",
    "32",
    "--max-batched-tokens",
    "96",
]


def test_engine_flags_reach_the_server_engine():
    from kestrel.cli import build_parser
    from kestrel.config import CacheConfig
    from kestrel.engine.client import EngineStats, LatencyListener
    from kestrel.server.main import load_engine, server_settings

    args = build_parser().parse_args(["serve", *ENGINE_FLAGS])
    config = server_settings(args)
    # the engine process: its config comes back from the child
    engine = load_engine(config, "warning", LatencyListener(), EngineStats())
    try:
        child = engine.intake.config
        assert child.cache == CacheConfig(gpu_memory_utilization=0.5, block_size=32)
        assert child.model.cuda_graphs is False and child.scheduler.max_batched_tokens == 96
        assert engine.intake.vocab_size == len(engine.tokenizer) == 512
    finally:
        engine.stop()
    assert config.server.model_name == "tiny"


def test_engine_flags_reach_generate_and_the_llm_api(capsys):
    from kestrel.config import CacheConfig
    from kestrel.llm import LLM
    from kestrel.sampling import SamplingParams

    assert main(["generate", *ENGINE_FLAGS, "-p", "Hi", "-n", "3", "--temp", "0"]) == 0
    assert capsys.readouterr().out.strip()  # three " t<id>" words
    llm = LLM(
        shape="tiny",
        gpu_memory_utilization=0.5,
        cuda_graphs=False,
        block_size=32,
        max_batched_tokens=96,
        device="cpu",
    )
    config = llm.engine.config
    assert config.cache == CacheConfig(gpu_memory_utilization=0.5, block_size=32)
    assert config.model.cuda_graphs is False and config.scheduler.max_batched_tokens == 96
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (a,), (b,) = llm.generate([[300, 301, 302]], params), llm.generate([[300, 301, 302]], params)
    assert len(a.outputs[0].token_ids) == 4 and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_roofline_reads_kv_bytes_from_the_family_not_the_config():
    """gemma4's full layers have a wider head and fewer KV heads than `config.head_dim` and
    `num_key_value_heads` say, and some transformers versions refuse `config.head_dim`: the
    ceiling comes from the model's own KV bytes per token."""
    from argparse import Namespace

    import transformers

    from kestrel.bench.offline import Workload
    from kestrel.bench.roofline import active_weight_bytes, ceilings, kv_bytes_per_token
    from kestrel.weights.loader import build_model

    S, F = "sliding_attention", "full_attention"
    config = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=6,
        layer_types=[S, S, F], hidden_size_per_layer_input=0, max_position_embeddings=256,
    )  # fmt: skip
    model = build_model(config, torch.float32, torch.device("cpu"))
    kv = kv_bytes_per_token(config, torch.float32)
    assert kv == model.kv_bytes_per_token(torch.float32)
    assert kv != 2 * 2 * 8 * 3 * 4  # not what the config's top-level fields would say
    args = Namespace(bandwidth=1e12, flops=1e15)
    work = Workload(num_requests=1, prompt_tokens=100, output_tokens=8)
    ceiling = ceilings(args, model, kv, torch.float32, work, 1)["ceiling_decode_tok_s"]
    assert ceiling == pytest.approx(1e12 / (active_weight_bytes(model) + kv * 100))


def test_bench_serve_multi_turn_resends_the_history_and_compares_without_the_cache(
    server, tmp_path
):
    flags = ["--multi-turn", "--conversations", "2", "--turns", "3", "--concurrency", "2"]
    sizes = ["--system-tokens", "40", "--turn-tokens", "10", "--output-tokens", "4"]
    no_cache, cache, summary = _bench_serve(server, tmp_path, *flags, *sizes, "--compare-no-cache")
    assert (no_cache["prefix_caching"], cache["prefix_caching"]) == (False, True)
    for r in (no_cache, cache):
        assert (r["mode"], r["completed"], r["failed"]) == ("serve-multi-turn", 6, 0)
        prompts = [t["mean_prompt_tokens"] for t in r["per_turn"]]
        # each turn resends the last: its user message, the 4-token answer and this message
        assert all(b >= a + 2 * 10 + 4 for a, b in zip(prompts, prompts[1:], strict=False))
        assert all(0 < t["ttft_p50_s"] <= t["ttft_p99_s"] for t in r["per_turn"])
    assert no_cache["cached_tokens"] == 0 and cache["cached_tokens"] >= 2 * 64  # turns 2 and 3
    assert summary["mode"] == "serve-multi-turn-ratios"
    assert summary["total_tok_s_ratio"] > 0 and summary["later_turns_ttft_p50_ratio"] > 0


@pytest.mark.parametrize("flag", ["keep", "dequantize"])
def test_bench_loads_a_gguf_as_quantized_weights_says_and_the_roofline_counts_what_it_holds(
    flag, tmp_path
):
    """`kestrel bench -m file.gguf --quantized-weights keep` measures the packed blocks (it once
    dequantized whatever the flag said), and the ceiling counts the bytes the model holds: about
    the file for packed blocks, float32's for dequantized ones."""
    from argparse import Namespace

    from tests.test_gguf_quantized import tiny_llama_gguf

    from kestrel.bench.offline import load_model
    from kestrel.bench.roofline import weight_bytes
    from kestrel.models.layers.quant import QuantLinear

    path = tiny_llama_gguf(tmp_path / "q4_k.gguf", "Q4_K", tied=False)
    args = Namespace(
        shape=None, model=str(path), no_progress=True, quantized_weights=flag, speculative=None
    )
    model, _, _ = load_model(args, torch.device("cpu"), torch.float32)
    packed = any(isinstance(m, QuantLinear) for m in model.modules())
    assert packed == (flag == "keep")
    file_bytes = path.stat().st_size
    if packed:
        assert 0.9 * file_bytes < weight_bytes(model) < file_bytes
    else:
        assert weight_bytes(model) > 5 * file_bytes  # float32 against 4.5 bits a weight


# -- ceilings per card, and the compiled peer (`--peer gpt-fast`) -----------------------------------

from argparse import Namespace  # noqa: E402
from pathlib import Path  # noqa: E402

from kestrel.bench import gpt_fast  # noqa: E402

GPT_FAST = Path(__file__).resolve().parent.parent / gpt_fast.DEFAULT_DIR
needs_gpt_fast = pytest.mark.skipif(
    not (GPT_FAST / gpt_fast.MOE).is_file(), reason="gpt-fast not placed (make gpt-fast)"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MOE_SHAPES = ["qwen3-vl-30b-a3b", "gemma4-26b-a4b", "glm-4.7-flash", "minicpm3-4b"]


def test_cpu_ceilings_use_only_the_given_rates():
    from kestrel.bench.offline import card_ceilings

    cpu = torch.device("cpu")
    assert card_ceilings(Namespace(bandwidth=None, flops=None), cpu) == {}  # nothing measured
    args = Namespace(bandwidth=2e11, flops=None)
    assert card_ceilings(args, cpu) == {"bandwidth": 2e11, "bandwidth_from": "--bandwidth"}
    assert (args.bandwidth, args.flops) == (2e11, None)


def test_of_ceiling_reads_each_rate_against_its_own_ceiling():
    from kestrel.bench.roofline import of_ceiling

    assert of_ceiling({"decode_tok_s": 150.0, "ceiling_decode_tok_s": 200.0}) == {
        "of_ceiling": 0.75
    }
    assert of_ceiling({"output_tok_s": 50.0, "ceiling_output_tok_s": 400.0}) == {
        "of_ceiling": 0.125
    }
    assert of_ceiling({"decode_tok_s": 150.0}) == {} and of_ceiling({"error": "x"}) == {}


@needs_cuda
def test_card_rates_are_measured_once_per_process_on_the_card():
    """A copy of 1 GiB counted as bytes read + written: an H100 about 3.0 TB/s, an H200 4.25."""
    from kestrel.bench.roofline import card_rates

    device = torch.device("cuda")
    rates = card_rates(device)
    assert card_rates(device) is rates
    assert 1e12 < rates["bandwidth"] < 6e12 and 1e14 < rates["flops"] < 2e15
    args = Namespace(bandwidth=None, flops=5e14)
    from kestrel.bench.offline import card_ceilings

    fields = card_ceilings(args, device)
    assert fields == {
        "bandwidth": rates["bandwidth"],
        "bandwidth_from": "measured",
        "flops": 5e14,
        "flops_from": "--flops",
    }


def _bench_error(argv: str) -> str:
    with pytest.raises(SystemExit) as raised:
        main(argv.split())
    return str(raised.value)


def test_gpt_fast_peer_flags_are_checked_before_anything_is_built(tmp_path):
    assert "single stream" in _bench_error("bench throughput --shape tiny --peer gpt-fast")
    assert "--shape" in _bench_error("bench latency --peer gpt-fast --no-progress")
    refused = _bench_error("bench latency --shape nemotron-h-8b --peer gpt-fast")
    assert "'nemotron-h-8b'" in refused and "llama3-8b" in refused and "minicpm3-4b" in refused
    missing = _bench_error(f"bench latency --shape tiny --peer gpt-fast --gpt-fast {tmp_path}")
    assert "--gpt-fast" in missing and "make gpt-fast" in missing
    short = "bench latency --shape tiny --peer gpt-fast --latency-output-tokens 1"
    assert "--latency-output-tokens" in _bench_error(short)
    with pytest.raises(SystemExit):  # argparse: not one of the peers
        main("bench latency --shape tiny --peer vllm".split())


@needs_gpt_fast
def test_gpt_fast_llama3_8b_is_its_own_llama_3_1_8b():
    """The dense peer of llama3-8b is exactly the model gpt-fast names llama-3.1-8b."""
    model, _ = gpt_fast.load(GPT_FAST, gpt_fast.DENSE)
    peer = gpt_fast.peer_shape("llama3-8b")
    assert (peer.model_file, peer.differs) == (gpt_fast.DENSE, "")
    assert model.ModelArgs(**peer.args) == model.ModelArgs.from_name("llama-3.1-8b")


@needs_gpt_fast
@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_gpt_fast_peer_of_a_moe_or_mla_shape_reads_about_its_bytes(shape):
    """gpt-fast cannot build MLA, QK-norm or shared experts: the nearest model it can reads
    within 15% of the bytes a token of the shape reads (kestrel's roofline), and says what
    differs. The MoE shapes run on its Mixtral model."""
    from kestrel.bench.roofline import active_bytes_per_token
    from kestrel.weights.shapes import shape_config

    peer = gpt_fast.peer_shape(shape)
    module, _ = gpt_fast.load(GPT_FAST, peer.model_file)
    with torch.device("meta"):
        model = module.Transformer(module.ModelArgs(**peer.args)).to(torch.bfloat16)
    ours = active_bytes_per_token(shape_config(shape), torch.bfloat16)
    theirs = gpt_fast.active_bytes(model, peer.args)["active_weight_bytes"]
    assert 0.85 < theirs / ours < 1.15
    assert peer.differs and (peer.model_file == gpt_fast.MOE) == (shape != "minicpm3-4b")


@needs_gpt_fast
def test_gpt_fast_peer_and_transformers_beside_kestrel_in_one_run(tmp_path):
    """`--peer gpt-fast` runs gpt-fast's own generate() (eager on the CPU) in a child process;
    its ceiling counts its own model's bytes, and kestrel's record compares with every peer."""
    out = tmp_path / "bench.jsonl"
    argv = (
        "bench latency --shape tiny --peer gpt-fast --peer transformers --no-progress "
        f"--latency-prompt-tokens 6 --latency-output-tokens 4 --bandwidth 1e10 --gpt-fast "
        f"{GPT_FAST} -o {out}"
    )
    assert main(argv.split()) == 0
    peer, hf, ours = [json.loads(line) for line in out.read_text().splitlines()]
    assert (peer["engine"], peer["compiled"], peer["dtype"]) == (
        "gpt-fast eager",
        False,
        "bfloat16",
    )
    assert peer["prompt_tokens"] == ours["prompt_tokens"] == 6 and peer["output_tokens"] == 4
    step = peer["active_weight_bytes"] + peer["kv_bytes_per_token"] * 6
    assert peer["ceiling_decode_tok_s"] == pytest.approx(1e10 / step)
    assert peer["of_ceiling"] == pytest.approx(peer["decode_tok_s"] / peer["ceiling_decode_tok_s"])
    assert peer["peer_model"].startswith("gpt-fast model.py ") and peer["bandwidth"] == 1e10
    assert ours["vs_peers"] == {
        "gpt-fast eager": pytest.approx(ours["decode_tok_s"] / peer["decode_tok_s"]),
        hf["engine"]: pytest.approx(ours["decode_tok_s"] / hf["decode_tok_s"]),
    }


@needs_gpt_fast
def test_a_failing_gpt_fast_child_is_reported_in_its_record(tmp_path, capsys):
    """The child's error is the peer record's, and kestrel's own record still follows."""
    broken = tmp_path / "gpt-fast"
    for name in ("model.py", "generate.py", "mixtral-moe/model.py"):
        (broken / name).parent.mkdir(parents=True, exist_ok=True)
        (broken / name).write_text("raise ImportError('not gpt-fast')\n")
    out = tmp_path / "bench.jsonl"
    argv = (
        "bench latency --shape tiny --peer gpt-fast --no-progress --latency-prompt-tokens 6 "
        f"--latency-output-tokens 3 --gpt-fast {broken} -o {out}"
    )
    assert main(argv.split()) == 0
    peer, ours = [json.loads(line) for line in out.read_text().splitlines()]
    assert "status 1" in peer["error"] and "not gpt-fast" in peer["error"]
    assert "vs_peers" not in ours and ours["decode_tok_s"] > 0


@needs_cuda
@needs_gpt_fast
def test_gpt_fast_compiles_its_decode_on_cuda():
    opts = Namespace(shape="tiny", gpt_fast=str(GPT_FAST), device="cuda", seed=0,
                     prompt_tokens=16, output_tokens=8, temperature=0.0)  # fmt: skip
    numbers = gpt_fast.run(opts)
    assert numbers["compiled"] is True and numbers["decode_tok_s"] > 0


def test_place_gpt_fast_extracts_the_pinned_commit_of_a_checkout(tmp_path):
    """`make gpt-fast GPT_FAST=CHECKOUT`: the files of the pinned commit (not the work tree's),
    and COMMIT naming it."""
    import subprocess

    repo = tmp_path / "gpt-fast"
    files = ["LICENSE", "model.py", "generate.py", "tokenizer.py", "tp.py"]
    files += [f"mixtral-moe/{name}" for name in ("model.py", "generate.py", "tp.py")]
    for name in files:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(f"# {name} at the pinned commit\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "pinned"], check=True)
    pinned = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (repo / "model.py").write_text("# a later edit\n")
    dest = tmp_path / "placed"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "place_gpt_fast.sh"
    env = {**os.environ, "GPT_FAST_COMMIT": pinned.strip()}
    subprocess.run([str(script), str(repo), str(dest)], check=True, env=env, capture_output=True)
    assert (dest / "model.py").read_text() == "# model.py at the pinned commit\n"
    assert (dest / "mixtral-moe" / "tp.py").is_file()
    assert (dest / "COMMIT").read_text() == pinned


@needs_gpt_fast
def test_roofline_peers_script_on_the_cpu(tmp_path):
    """benchmarks/roofline_peers.sh end to end on a tiny shape: the card's record, kestrel and
    the gpt-fast peer's records, and the table printed from them."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DEVICE": "cpu",
        "EXTRA": "--latency-prompt-tokens 6 --latency-output-tokens 3",
        "PYTHONPATH": str(root / "src"),
    }
    script = [str(root / "benchmarks" / "roofline_peers.sh"), str(tmp_path), "tiny"]
    done = subprocess.run(script, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (card,) = [json.loads(line) for line in (tmp_path / "card.jsonl").read_text().splitlines()]
    assert card["mode"] == "card" and card["bandwidth"] > 0 and card["flops"] > 0
    records = (tmp_path / "roofline-peers.jsonl").read_text().splitlines()
    engines = [json.loads(line)["engine"] for line in records]
    assert engines == ["gpt-fast eager", "kestrel"]
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("| tiny |")]
    assert "gpt-fast eager" in row
