"""Write tiny Hugging Face checkpoints as GGUF files the way llama.cpp's converter does for their
architecture (metadata keys, tensor names, layouts), so the GGUF loader is tested on files shaped
like real ones. Conventions per architecture, from llama.cpp's conversion code:

- gemma4: norms as stored (no +1), experts stacked as ffn_gate_up_exps, router scale as
  ffn_gate_inp.scale, per-expert scale as ffn_down_exps.scale, a rope_freqs tensor (1 for the
  rotated frequencies of full layers, 1e30 for the rest), per-layer KV heads/MLP widths.
- exaone-moe: no Q/K permutation; gate and up experts as separate stacked tensors; the score
  correction bias as exp_probs_b.bias; a sliding-window pattern per layer.
- deci: llama's Q/K row permutation with each layer's own KV heads; per-layer head counts and MLP
  widths (0 for no-op parts, KV heads 0 for linear attention); llama-3 RoPE as rope_freqs factors.
- llama: the Q/K row permutation; no output.weight when the embeddings are tied.

Quantized types: those gguf can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from the
checkpoint; for the k-quants, which gguf cannot write, each tensor is random valid blocks
(`random_blocks`) of the checkpoint tensor's shape.
"""

import math
from pathlib import Path

import gguf
import numpy as np
import torch

SLIDING, FULL = "sliding_attention", "full_attention"


def write_gguf(
    path: Path, arch: str, state: dict, config, quant: str = "F32", types: dict | None = None
) -> Path:
    """`state`: HF tensor name -> tensor; `config`: the HF config (object). quant: F32 or a
    quantized type name (Q8_0, Q4_K, ...) for every matrix whose rows are whole blocks; `types`
    gives the GGUF tensors whose names contain a key that key's type instead (llama.cpp's mixes
    keep some tensors in another type: {"ffn_up_exps": "Q6_K"})."""
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    n = config.num_hidden_layers
    table = gguf.get_tensor_name_map(
        next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), n
    )
    tensors = CONVERTERS[arch](writer, state, config, table)
    write_vocab(writer, config.vocab_size, "gpt2" if arch == "exaone-moe" else "llama")
    for name, tensor in tensors.items():
        own = next((qtype for part, qtype in types.items() if part in name), quant)
        add_tensor(writer, name, tensor, own)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tensor(writer, name: str, tensor: torch.Tensor, quant: str) -> None:
    array = tensor.detach().float().numpy()
    qtype = gguf.GGMLQuantizationType[quant]
    # llama.cpp keeps 1-D tensors (norms, scales) in F32; quantized rows are whole blocks
    if quant == "F32" or array.ndim < 2 or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, quantized_array(array, qtype), raw_dtype=qtype)


# where each type keeps its float16 scales (d, and the min or dmin after it), in bytes of a block
SCALE_BYTES = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2]}
SCALE_BYTES |= {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# a scale that keeps random blocks' weights near +-0.05 (k-quants multiply by 6-bit scales too)
SCALE_SIZE = {"Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 1e-5}


def quantized_array(array: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """`array` quantized by gguf where it can; random valid blocks of its shape otherwise."""
    try:
        return gguf.quants.quantize(array, qtype)
    except NotImplementedError:
        return random_blocks(array.shape, qtype, np.random.default_rng(seed))


def random_blocks(shape: tuple, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s block layout for a tensor of `shape`, with finite float16 scales
    of a size that keeps the weights small. (rows..., bytes per row) uint8, as gguf stores it."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block, size), dtype=np.uint8)
    scale = SCALE_SIZE.get(qtype.name, 2e-3)
    for at in SCALE_BYTES[qtype.name]:
        d = rng.uniform(0.5, 1.5, size=blocks.shape[0]) * scale
        blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def mapped(table, name: str) -> str:
    """llama.cpp's map_tensor_name: every GGUF tensor name has a suffix."""
    out = table.get_name(name, try_suffixes=(".weight", ".bias"))
    assert out is not None, name
    return out if out.endswith((".weight", ".bias")) else out + ".weight"


def common_metadata(writer, config, n: int) -> None:
    writer.add_block_count(n)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


# --- gemma4 ---------------------------------------------------------------------------------


def gemma4(writer, state, c, table) -> dict:
    n = c.num_hidden_layers
    common_metadata(writer, c, n)
    # full layers have their own head dim and KV heads: read each layer's own config
    layer_kv = [c.per_layer_config[i].num_key_value_heads for i in range(n)]
    head_dim = c.per_layer_config[c.layer_types.index(SLIDING)].head_dim
    first_shared = n - c.num_kv_shared_layers
    widths = [
        c.intermediate_size * (2 if c.use_double_wide_mlp and i >= first_shared else 1)
        for i in range(n)
    ]
    writer.add_feed_forward_length(widths if len(set(widths)) > 1 else widths[0])
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(layer_kv if len(set(layer_kv)) > 1 else layer_kv[0])
    global_dim = c.per_layer_config[c.layer_types.index(FULL)].head_dim
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_rope_freq_base(c.rope_parameters[FULL]["rope_theta"])
    writer.add_rope_freq_base_swa(c.rope_parameters[SLIDING]["rope_theta"])
    writer.add_rope_dimension_count(global_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_sliding_window(c.sliding_window)
    writer.add_sliding_window_pattern([t == SLIDING for t in c.layer_types])
    writer.add_shared_kv_layers(c.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    if c.enable_moe_block:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.top_k_experts)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("router.scale"):
            out[f"blk.{layer}.ffn_gate_inp.scale"] = t
        elif name.endswith("router.per_expert_scale"):
            out[f"blk.{layer}.ffn_down_exps.scale"] = t
        else:
            out[mapped(table, name)] = t
    rotated = int(global_dim * c.rope_parameters[FULL]["partial_rotary_factor"] / 2)
    out["rope_freqs.weight"] = torch.tensor([1.0] * rotated + [1e30] * (global_dim // 2 - rotated))
    return out


# --- exaone-moe -----------------------------------------------------------------------------


def exaone_moe(writer, state, c, table) -> dict:
    n = c.num_hidden_layers
    common_metadata(writer, c, n)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_sliding_window_pattern([t == SLIDING for t in c.layer_types])
    writer.add_expert_count(c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_shared_count(c.num_shared_experts)
    writer.add_expert_shared_feed_forward_length(c.moe_intermediate_size * c.num_shared_experts)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    leading = next((i for i, t in enumerate(c.mlp_layer_types) if t != "dense"), n)
    writer.add_leading_dense_block_count(leading)
    writer.add_nextn_predict_layers(0)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("experts.gate_up_proj"):  # (E, 2I, H): gate rows first
            prefix = name.rsplit(".", 1)[0]
            gate, up = t.chunk(2, dim=1)
            out[mapped(table, prefix + ".gate_proj")] = gate
            out[mapped(table, prefix + ".up_proj")] = up
        elif name.endswith("e_score_correction_bias"):
            out[mapped(table, name.replace("_bias", ".bias"))] = t
        else:
            out[mapped(table, name)] = t
    return out


# --- deci (nemotron-nas) --------------------------------------------------------------------


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation: each head's rows from half-split to pair-interleaved."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama3_factors(theta: float, dim: int, rope: dict) -> torch.Tensor:
    """llama-3 RoPE as llama.cpp writes it: a divisor per frequency."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out)


def deci(writer, state, c, table) -> dict:
    n, hidden, heads = c.num_hidden_layers, c.hidden_size, c.num_attention_heads
    common_metadata(writer, c, n)
    q_heads, kv_heads, widths = [], [], []
    for b in c.block_configs:
        attn, ffn = b["attention"], b["ffn"]
        group = attn["n_heads_in_group"]
        kv_heads.append(heads // group if group else 0)
        q_heads.append(heads if group or attn["replace_with_linear"] else 0)
        mult = ffn["ffn_mult"]
        widths.append(-(-int(2 * mult * hidden / 3) // 256) * 256 if mult else 0)
    writer.add_head_count(q_heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_feed_forward_length(widths)
    writer.add_key_length(hidden // heads)
    writer.add_value_length(hidden // heads)
    rope = c.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(hidden // heads)
    out = {}
    for name, t in state.items():
        if name.endswith("q_proj.weight"):
            t = permute(t, heads)
        elif name.endswith("k_proj.weight"):
            t = permute(t, kv_heads[int(name.split(".")[2])])
        out[mapped(table, name)] = t
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_factors(rope["rope_theta"], hidden // heads, rope)
    return out


# --- llama ------------------------------------------------------------------------------------


def llama_metadata(writer, c) -> None:
    common_metadata(writer, c, c.num_hidden_layers)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])


def llama(writer, state, c, table) -> dict:
    llama_metadata(writer, c)
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.endswith("q_proj.weight"):
            t = permute(t, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            t = permute(t, c.num_key_value_heads)
        out[mapped(table, name)] = t
    return out


CONVERTERS = {"gemma4": gemma4, "exaone-moe": exaone_moe, "deci": deci, "llama": llama}


# --- vocabulary -----------------------------------------------------------------------------


def write_vocab(writer, size: int, model: str) -> None:
    """A minimal vocabulary of `size` tokens: sentencepiece-style ("llama") or byte-level BPE
    ("gpt2", with merges), with BOS/EOS/UNK as control tokens."""
    if model == "gpt2":
        specials = ["<unk>", "<s>", "</s>"]
        chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]
        merges = [f"Ġ {ch}" for ch in chars[:26]]
        words = [m.replace(" ", "") for m in merges]
    else:
        specials = ["<unk>", "<s>", "</s>"]
        chars = ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
        merges, words = [], [f"▁{ch}" for ch in chars[1:]]
    tokens = specials + chars + words
    tokens += [f"<extra_{i}>" for i in range(size - len(tokens))]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(chars) + len(words))
    types += [gguf.TokenType.USER_DEFINED] * (size - len(types))
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    if model == "gpt2":
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
    else:
        writer.add_token_scores([0.0] * 3 + [-float(i) for i in range(size - 3)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def state_dict(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
