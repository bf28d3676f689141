"""Resident memory of a quantized GGUF loaded by kestrel on the CPU, against the file's size.

Writes a Llama-3.1-8B-shaped Q4_K_M GGUF of random valid blocks (tests/gguf_writer.py's
`random_blocks`; llama.cpp's Q4_K_M mix: Q6_K for the head and for attn_v / ffn_down of the
layers llama.cpp gives more bits) into a temporary folder, loads it with kestrel in a fresh process
(weights packed, before any KV) and reports its peak RSS, then deletes the folder. Target: peak
RSS at most the file size + 1.5 GB. `--shape moe-30b-a3b` writes an MoE of Qwen3-30B-A3B's
dimensions (48 layers of 128 experts, 8 active, 768 wide; as an exaone-moe file with one shared
expert, the MoE architecture kestrel reads from GGUF metadata alone): its expert stacks stay
packed too.

    python benchmarks/quantized_memory.py --out benchmarks/results/cpu-quantized-memory.json
    python benchmarks/quantized_memory.py --shape llama-3.2-1b   # a smaller try first
"""

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tests.gguf_writer and kestrel from this tree

# hidden, intermediate, layers, heads, KV heads, vocab, RoPE base (the released configs)
SHAPES = {
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 128256, 500000.0),
}
MOE_SHAPES = {"moe-30b-a3b"}  # Qwen3-30B-A3B's dimensions (its config.json)


def moe_config():
    from transformers import ExaoneMoeConfig

    return ExaoneMoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        mlp_layer_types=["sparse"] * 48,
        layer_types=["full_attention"] * 48,
        sliding_window=4096,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )


def llama_config(shape: str):
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv, vocab, theta = SHAPES[shape]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
    )


def more_bits(layer: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def q4_k_m_tensors(c) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """(GGUF name, PyTorch shape, type) of every tensor, in llama.cpp's order."""
    h, i, d = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    kv, n = c.num_key_value_heads * d, c.num_hidden_layers
    out = [("token_embd.weight", (c.vocab_size, h), "Q4_K")]
    for b in range(n):
        big = "Q6_K" if more_bits(b, n) else "Q4_K"
        out += [
            (f"blk.{b}.attn_norm.weight", (h,), "F32"),
            (f"blk.{b}.attn_q.weight", (h, h), "Q4_K"),
            (f"blk.{b}.attn_k.weight", (kv, h), "Q4_K"),
            (f"blk.{b}.attn_v.weight", (kv, h), big),
            (f"blk.{b}.attn_output.weight", (h, h), "Q4_K"),
            (f"blk.{b}.ffn_norm.weight", (h,), "F32"),
            (f"blk.{b}.ffn_gate.weight", (i, h), "Q4_K"),
            (f"blk.{b}.ffn_up.weight", (i, h), "Q4_K"),
            (f"blk.{b}.ffn_down.weight", (h, i), big),
        ]
    return out + [("output_norm.weight", (h,), "F32"), ("output.weight", (c.vocab_size, h), "Q6_K")]


def moe_q4_k_m_tensors(writer, c) -> list[tuple[str, tuple[int, ...], str]]:
    """The exaone-moe metadata written, and (GGUF name, PyTorch shape, type) of every tensor: the
    converter's names for the model's parameters (built on the meta device), typed as llama.cpp's
    Q4_K_M types an MoE (routers and norms in F32; attn_v and the down projections of the
    more-bits layers, and the head, in Q6_K)."""
    import gguf
    import torch
    from tests.gguf_writer import exaone_moe, state_dict
    from transformers import ExaoneMoeForCausalLM

    with torch.device("meta"):
        state = state_dict(ExaoneMoeForCausalLM(c))
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == "exaone-moe")
    table = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    out = []
    for name, t in exaone_moe(writer, state, c, table).items():
        block = int(name.split(".")[1]) if name.startswith("blk.") else 0
        more = more_bits(block, c.num_hidden_layers)
        if t.dim() == 1 or "ffn_gate_inp" in name:
            kind = "F32"
        elif name == "output.weight" or (more and ("attn_v" in name or "ffn_down" in name)):
            kind = "Q6_K"
        else:
            kind = "Q4_K"
        out.append((name, tuple(t.shape), kind))
    return out


def write_file(path: Path, shape: str) -> None:
    """The GGUF, one tensor at a time: only one tensor's random blocks exist at once."""
    import gguf
    import numpy as np
    from tests.gguf_writer import llama_metadata, random_blocks, write_vocab

    if shape in MOE_SHAPES:
        config = moe_config()
        writer = gguf.GGUFWriter(str(path), "exaone-moe")
        tensors = moe_q4_k_m_tensors(writer, config)
        write_vocab(writer, config.vocab_size, "gpt2")
    else:
        config = llama_config(shape)
        writer = gguf.GGUFWriter(str(path), "llama")
        llama_metadata(writer, config)
        write_vocab(writer, config.vocab_size, "llama")
        tensors = q4_k_m_tensors(config)
    for name, dims, kind in tensors:
        count = int(np.prod(dims))
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * count)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            row = dims[-1] // block * size
            rows = count // dims[-1]
            byte_shape = (*dims[:-1], row)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * row, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for _, dims, kind in tensors:
        if kind == "F32":  # norms of ones; a router of ones picks its first experts
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
        else:
            writer.write_tensor_data(random_blocks(dims, gguf.GGMLQuantizationType[kind], rng))
    writer.close()


def rss_bytes() -> int:
    """The process's resident set now, from /proc (ru_maxrss is the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load_and_measure(path: str, forward: bool) -> dict:
    """Runs in a fresh process: kestrel's CPU load of the file, its RSS, and with `forward` the
    time of one 4-token forward (the model computes from its blocks)."""
    import torch

    from kestrel.cache.sequence import SequenceCache
    from kestrel.models.batch import ForwardBatch
    from kestrel.weights.loader import load_model, resolve

    before = rss_bytes()
    start = time.perf_counter()
    model = load_model(resolve(path), torch.float32, torch.device("cpu"), progress=False)
    load_s = time.perf_counter() - start
    loaded = rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    record = {
        "rss_before_load_bytes": before,
        "rss_after_load_bytes": loaded,
        "peak_rss_load_bytes": peak,
        "load_s": round(load_s, 1),
    }
    if forward:
        cache = SequenceCache(model.cache_specs())
        start = time.perf_counter()
        with torch.no_grad():
            model(ForwardBatch.single(cache, torch.tensor([1, 2, 3, 4]), all_logits=False))
        record["forward_4_tokens_s"] = round(time.perf_counter() - start, 1)
    return record


def commit() -> str:
    try:
        args = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
        return subprocess.check_output(args, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted({*SHAPES, *MOE_SHAPES}), default="llama-3.1-8b")
    parser.add_argument("--dir", help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--out", help="also write the JSON record to this file")
    parser.add_argument("--forward", action="store_true", help="also time one 4-token forward")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the child process: a GGUF path
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(load_and_measure(args.measure, args.forward)))
        return
    folder = Path(tempfile.mkdtemp(prefix="kestrel-qmem-", dir=args.dir))
    try:
        path = folder / f"{args.shape}-Q4_K_M.gguf"
        start = time.perf_counter()
        write_file(path, args.shape)
        write_s = time.perf_counter() - start
        env = {**os.environ, "KESTREL_CACHE_DIR": str(folder / "cache")}
        child = [sys.executable, __file__, "--measure", str(path)] + ["--forward"] * args.forward
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        record = json.loads(out.stdout.strip().splitlines()[-1])
        file_bytes = path.stat().st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record = {
        "shape": args.shape,
        "type": "Q4_K_M",
        "file_bytes": file_bytes,
        **record,
        "peak_rss_minus_file_bytes": record["peak_rss_load_bytes"] - file_bytes,
        "target": "peak RSS <= file size + 1.5 GB",
        "meets_target": record["peak_rss_load_bytes"] <= file_bytes + 1.5e9,
        "write_s": round(write_s, 1),
        "command": " ".join(["python", *sys.argv]),
        "commit": commit(),
        "machine": f"{platform.machine()}, {platform.python_version()}",
    }
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
