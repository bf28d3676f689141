"""The compiled single-stream peer: gpt-fast (pytorch-labs/gpt-fast, BSD-3), run, not copied.

`kestrel bench latency --shape S --peer gpt-fast` runs this module in a child process (gpt-fast's
generate.py sets inductor's global options when imported, and its CUDA graphs keep their memory
pool until the process ends): it imports gpt-fast's own `model.py` (the dense `Transformer`) or
`mixtral-moe/model.py` (the MoE one) and `generate.py` from a checkout (`--gpt-fast DIR`, placed by
`make gpt-fast`), builds the model at the shape's dimensions with random bf16 weights, compiles
`decode_one_token` (mode="reduce-overhead", fullgraph=True) as its `main(compile=True)` does
(prefill stays eager, its default: the decode rate is measured apart from the prefill), and times
its `generate()` after one warm-up call, as `main()` does. It prints one JSON line; the parent
adds the ceilings.

gpt-fast expresses Llama-like decoders and Mixtral's MoE only; `PEER_SHAPES` maps each shape to
the nearest model it can build and says what differs (a wider or narrower attention, no QK-norm,
shared experts and dense MLPs as extra routed experts that read the same bytes). The record
carries the bytes the peer's own model reads per token, so both are read against the card.
"""

import argparse
import importlib.util
import inspect
import json
import statistics
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

# where `make gpt-fast` places the checkout (an ignored folder the GPU run carries)
DEFAULT_DIR = "benchmarks/.peers/gpt-fast"
DENSE, MOE = "model.py", "mixtral-moe/model.py"
NUM_SAMPLES = 5  # generate.py's default --num_samples; tokens/s is their mean, as it prints


@dataclass(frozen=True)
class PeerShape:
    """gpt-fast's model nearest to a kestrel shape: which model file, its `ModelArgs` fields, and
    what differs from the shape (empty when nothing does)."""

    model_file: str
    args: dict
    differs: str


def _dense(f: dict, differs: str = "") -> PeerShape:
    """A Llama-like shape, from its config fields, as gpt-fast's dense `ModelArgs`."""
    heads = f["num_attention_heads"]
    if f.get("head_dim", f["hidden_size"] // heads) * heads != f["hidden_size"]:
        raise ValueError("gpt-fast's heads are hidden_size / num_attention_heads wide")
    rope = f.get("rope_scaling")
    args = dict(
        block_size=f["max_position_embeddings"],
        vocab_size=f["vocab_size"],
        n_layer=f["num_hidden_layers"],
        n_head=heads,
        n_local_heads=f["num_key_value_heads"],
        dim=f["hidden_size"],
        intermediate_size=f["intermediate_size"],
        rope_base=f["rope_theta"],
        norm_eps=f["rms_norm_eps"],
        rope_scaling=rope and {k: v for k, v in rope.items() if k != "rope_type"},
    )
    if f.get("tie_word_embeddings"):
        differs += "; an untied head (a token reads it whole either way)"
    return PeerShape(DENSE, args, differs.removeprefix("; "))


def _moe(f: dict, head_dim: int, kv_heads: int, experts: int, top_k: int, ffn: int) -> dict:
    """gpt-fast's Mixtral `ModelArgs` at a shape's width, with `head_dim`-wide heads (its heads
    are dim / n_head wide) and `top_k` of `experts` routed experts of `ffn` columns."""
    rope = f.get("rope_parameters", {})
    return dict(
        block_size=f["max_position_embeddings"],
        vocab_size=f["vocab_size"],
        n_layer=f["num_hidden_layers"],
        n_head=f["hidden_size"] // head_dim,
        n_local_heads=kv_heads,
        dim=f["hidden_size"],
        intermediate_size=ffn,
        rope_base=rope.get("rope_theta", f.get("rope_theta", 10000.0)),
        norm_eps=f.get("rms_norm_eps", 1e-6),
        num_experts=experts,
        num_activated_experts=top_k,
    )


def _qwen3_vl_moe(f: dict) -> PeerShape:
    t = f["text_config"]
    args = _moe(t, t["head_dim"], t["num_key_value_heads"], t["num_experts"],
                t["num_experts_per_tok"], t["moe_intermediate_size"])  # fmt: skip
    differs = (
        f"{args['n_head']} query heads of {t['head_dim']} where the model has "
        f"{t['num_attention_heads']} (q and o projections half as large); no QK-norm; plain RoPE "
        "for interleaved M-RoPE; the vision tower left out (a text token never reads it)"
    )
    return PeerShape(MOE, args, differs)


def _gemma4_moe(f: dict) -> PeerShape:
    f = dict(f, rope_parameters=f["rope_parameters"]["sliding_attention"])  # 5 of 6 layers
    dense_as_experts = f["intermediate_size"] // f["moe_intermediate_size"]  # 2112 = 3 x 704
    heads = f["hidden_size"] // f["head_dim"]
    args = _moe(f, f["head_dim"], heads, f["num_experts"],
                f["top_k_experts"] + dense_as_experts, f["moe_intermediate_size"])  # fmt: skip
    differs = (
        f"{heads} query and {heads} KV heads of {f['head_dim']} on every layer (the model: "
        f"{f['num_attention_heads']} and {f['num_key_value_heads']} on sliding layers, "
        f"{f['num_global_key_value_heads']} KV heads of {f['global_head_dim']} with K = V on "
        "full ones); no sliding window (none binds below 1024 tokens); the dense MLP beside the "
        f"experts as {dense_as_experts} more routed experts (top-{args['num_activated_experts']}: "
        "the same bytes a token reads); no QK/V norms, no logit softcapping; an untied head"
    )
    return PeerShape(MOE, args, differs)


def _glm4_moe_lite(f: dict) -> PeerShape:
    head_dim = 128
    heads = f["hidden_size"] // head_dim
    top_k = f["num_experts_per_tok"] + f["n_shared_experts"]
    args = _moe(f, head_dim, heads, f["n_routed_experts"], top_k, f["moe_intermediate_size"])
    differs = (
        f"MLA ({f['num_attention_heads']} heads, a latent KV of "
        f"{f['kv_lora_rank'] + f['qk_rope_head_dim']}) as multi-head attention, {heads} heads "
        f"of {head_dim}; the shared expert as a routed one (top-{top_k}: the same bytes); "
        f"layer 0's dense MLP ({f['intermediate_size']} columns) as an MoE layer"
    )
    return PeerShape(MOE, args, differs)


def _minicpm3(f: dict) -> PeerShape:
    """A dense MLA model: gpt-fast's dense Transformer with grouped attention, 8 KV heads."""
    fields = dict(f, num_key_value_heads=8, rope_theta=f["rope_parameters"]["rope_theta"])
    latent = f["kv_lora_rank"] + f["qk_rope_head_dim"]
    differs = (
        f"MLA (a latent KV of {latent}) as grouped attention, {f['num_attention_heads']} heads "
        "and 8 KV heads of 64; no muP scalings of the embedding, residuals and logits"
    )
    return _dense(fields, differs)


def _shapes() -> dict:
    from kestrel.weights.shapes import SHAPES

    dense = ["llama3-8b", "llama3-70b", "llama3.2-1b", "smollm2-135m", "tiny"]
    table = {name: (lambda n: lambda: _dense(SHAPES[n]))(name) for name in dense}
    table["qwen2.5-0.5b"] = lambda: _dense(SHAPES["qwen2.5-0.5b"], "no q/k/v biases")
    table["qwen3-vl-30b-a3b"] = lambda: _qwen3_vl_moe(SHAPES["qwen3-vl-30b-a3b"])
    table["gemma4-26b-a4b"] = lambda: _gemma4_moe(SHAPES["gemma4-26b-a4b"])
    table["glm-4.7-flash"] = lambda: _glm4_moe_lite(SHAPES["glm-4.7-flash"])
    table["minicpm3-4b"] = lambda: _minicpm3(SHAPES["minicpm3-4b"])
    return table


PEER_SHAPES = _shapes()


def peer_shape(name: str) -> PeerShape:
    """gpt-fast's nearest model to the named shape; a clear error where it has none."""
    if name not in PEER_SHAPES:
        raise SystemExit(
            f"--peer gpt-fast: gpt-fast builds no model near shape {name!r}; "
            f"shapes it can run: {', '.join(PEER_SHAPES)}"
        )
    return PEER_SHAPES[name]()


# -- loading gpt-fast's files as they are ---------------------------------------------------------


def checkout(root: str | Path) -> Path:
    """The gpt-fast checkout at `root`, or an error that says how to place one."""
    root = Path(root)
    if not (root / DENSE).is_file() or not (root / MOE).is_file():
        raise SystemExit(
            f"--gpt-fast: no gpt-fast checkout at {root} (model.py, mixtral-moe/model.py); "
            "place one with `make gpt-fast` (or `make gpt-fast GPT_FAST=CHECKOUT`)"
        )
    return root


def load(root: Path, model_file: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(model module, generate module) of gpt-fast's dense or Mixtral folder, imported from its
    files unchanged. Both folders name their modules `model`, `generate` and `tp`, so each is
    loaded under a private name with the imports it makes bound while it runs; the tokenizers it
    imports (sentencepiece, tiktoken) stand aside: a benchmark on token ids never calls them."""
    folder = (root / model_file).parent
    kind = "moe" if model_file == MOE else "dense"
    model = _exec(folder / "model.py", f"gpt_fast_{kind}_model", {})
    provides = {"model": model, "tokenizer": _unused("tokenizer", "get_tokenizer")}
    if not _importable("sentencepiece"):
        provides["sentencepiece"] = _unused("sentencepiece", "SentencePieceProcessor")
    if kind == "moe":  # mixtral-moe/generate.py imports its own tp.py, which imports its model
        provides["tp"] = _exec(folder / "tp.py", f"gpt_fast_{kind}_tp", {"model": model})
    generate = _exec(folder / "generate.py", f"gpt_fast_{kind}_generate", provides)
    return model, generate


def _exec(path: Path, name: str, provides: dict) -> types.ModuleType:
    """The file at `path` run as module `name` (registered, as an import would: torch.compile
    looks functions' modules up by name)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with _modules(provides, path.parent):
        spec.loader.exec_module(module)
    return module


@contextmanager
def _modules(provides: dict, folder: Path):
    """`provides` as importable modules, and `folder` on sys.path, while a file executes."""
    saved = {name: sys.modules.get(name) for name in provides}
    sys.modules.update(provides)
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _unused(name: str, attr: str) -> types.ModuleType:
    """A module whose `attr` refuses to run: gpt-fast imports it, this benchmark never calls it."""
    module = types.ModuleType(name)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name}.{attr} is not available in kestrel's gpt-fast peer")

    setattr(module, attr, refuse)
    return module


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# -- the model and its timing ----------------------------------------------------------------------


def build(model_module, args: dict, dtype, device, seed: int):
    """gpt-fast's Transformer of `args` with random weights, built on the meta device and
    materialized once on `device` in `dtype` (kestrel's shapes use the same initialization)."""
    from kestrel.weights.shapes import randomize

    with torch.device("meta"):
        model = model_module.Transformer(model_module.ModelArgs(**args))
    model = model.to(dtype=dtype).to_empty(device=device)
    torch.manual_seed(seed)
    randomize(model)
    return model.eval()


def active_bytes(model, args: dict) -> dict:
    """Weight bytes of the peer's model, and those one decoded token reads: one embedding row,
    top-k of E experts, the rest whole; KV bytes a token adds."""
    share = args.get("num_activated_experts", 1) / args.get("num_experts", 1)
    total = active = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if name == "tok_embeddings.weight":
            size = p.shape[1] * p.element_size()
        elif ".cond_ffn." in name:
            size *= share
        active += size
    head_dim = args["dim"] // args["n_head"]
    kv = 2 * args["n_layer"] * args["n_local_heads"] * head_dim * 2  # its KV cache is bf16
    return {"weight_bytes": total, "active_weight_bytes": active, "kv_bytes_per_token": kv}


def compile_like_main(generate) -> None:
    """What gpt-fast's `main(compile=True)` does before generating (no speculative draft)."""
    generate.decode_one_token = torch.compile(
        generate.decode_one_token, mode="reduce-overhead", fullgraph=True
    )


def measure(generate, model, prompt: torch.Tensor, output_tokens: int, sampling: dict) -> dict:
    """gpt-fast's `main()` loop: one warm-up `generate()` (compiles), then NUM_SAMPLES timed
    ones; tokens/s as it prints them (new tokens over the whole call, mean of the samples), the
    prefill alone, and decode's rate from the medians of the two (comparable with kestrel's
    decode_tok_s)."""
    dense = "batch_size" in inspect.signature(generate.generate).parameters
    extra = dict(batch_size=1, draft_model=None) if dense else {}
    device = prompt.device

    def call() -> float:
        _sync(device)
        start = time.perf_counter()
        generate.generate(model, prompt, output_tokens, interactive=False, **extra, **sampling)
        _sync(device)
        return time.perf_counter() - start

    call()  # warm-up: compiles, captures the CUDA graphs
    totals = [call() for _ in range(NUM_SAMPLES)]
    positions = torch.arange(0, prompt.numel(), device=device)

    @torch.no_grad()
    def prefill() -> float:  # generate()'s first call, alone: the time to the first token
        _sync(device)
        start = time.perf_counter()
        generate.prefill(model, prompt.view(1, -1), positions, **sampling)
        _sync(device)
        return time.perf_counter() - start

    ttft = statistics.median(prefill() for _ in range(NUM_SAMPLES))
    total = statistics.median(totals)
    return {
        "ttft_s": ttft,
        "decode_tok_s": (output_tokens - 1) / max(total - ttft, 1e-9),
        "total_s": total,
        "tokens_per_sec": sum(output_tokens / t for t in totals) / len(totals),
    }


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(opts) -> dict:
    """The record's numbers for one shape: gpt-fast's timing and its model's bytes."""
    from kestrel.bench.workload import Workload

    peer = peer_shape(opts.shape)
    root = checkout(opts.gpt_fast)
    device = torch.device(opts.device)
    model_module, generate = load(root, peer.model_file)
    model = build(model_module, peer.args, torch.bfloat16, device, opts.seed)
    compiled = device.type == "cuda"  # on the CPU, eager: there are no CUDA graphs to capture
    if compiled:
        compile_like_main(generate)
    work = Workload(1, opts.prompt_tokens, opts.output_tokens, seed=opts.seed)
    prompt = torch.tensor(work.prompts(peer.args["vocab_size"])[0], device=device)
    sampling = {"temperature": opts.temperature, "top_k": None}
    numbers = measure(generate, model, prompt, opts.output_tokens, sampling)
    return {
        **numbers,
        **active_bytes(model, peer.args),
        "compiled": compiled,
        "peer_model": f"gpt-fast {peer.model_file} {_commit(root)}",
        "peer_args": peer.args,
        "peer_differs": peer.differs,
    }


def _commit(root: Path) -> str:
    """The gpt-fast commit `make gpt-fast` wrote beside the files ("unknown" without it)."""
    stamp = root / "COMMIT"
    return stamp.read_text().strip()[:12] if stamp.is_file() else "unknown"


def child_command(shape: str, work, seed: int, device, temperature: float, root: str) -> list:
    """The command line that runs this module for one shape in a child process."""
    return [
        sys.executable, "-m", "kestrel.bench.gpt_fast", "--shape", shape,
        "--prompt-tokens", str(work.prompt_tokens), "--output-tokens", str(work.output_tokens),
        "--seed", str(seed), "--device", str(device), "--temperature", str(temperature),
        "--gpt-fast", str(root),
    ]  # fmt: skip


def main(argv=None) -> int:
    """The child process `kestrel bench --peer gpt-fast` starts (child_command's flags)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--shape", "--device", "--gpt-fast"):
        p.add_argument(flag, required=True)
    for flag in ("--prompt-tokens", "--output-tokens", "--seed"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--temperature", type=float, required=True)
    opts = p.parse_args(argv)
    if opts.output_tokens < 2:
        raise SystemExit("--output-tokens: gpt-fast's generate() needs at least 2")
    print(json.dumps(run(opts)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
