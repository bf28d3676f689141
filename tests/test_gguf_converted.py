"""GGUF files written by llama.cpp's own converter (`convert_hf_to_gguf.py`) from tiny random
Hugging Face checkpoints: kestrel's logits from the file equal transformers' on the checkpoint,
for the full prompt, chunked prefill and greedy decoding. These are the files users download,
so a misread of llama.cpp's layout cannot hide behind a writer of our own."""

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from tests import (
    test_models_exaone_moe,
    test_models_gemma3,
    test_models_gemma4,
    test_models_glm4_moe_lite,
    test_models_llama,
    test_models_mistral,
    test_models_nemotron_h,
    test_models_qwen3,
)
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.llama_cpp_tools import convert
from tests.reference import (
    assert_close,
    chunked_logits,
    decode_logits,
    reference_logits,
    save_tiny,
)
from transformers import AutoTokenizer

from kestrel.weights.loader import load_model, load_tokenizer, resolve

PROMPT = [(i * 37 + 11) % 128 for i in range(24)]
# Every family is saved with SmolLM2's tokenizer, whose BPE pre-tokenizer the converter knows, or
# Gemma 3's where the converter wants a SentencePiece-style vocabulary.
# Not converted here (docs/models.md lists each, with what a user gets): qwen2 (transformers reads
# any tokenizer in a qwen2 folder as Qwen's, whose hash the converter knows only with Qwen's
# vocabulary), jamba and minicpm3 (kestrel reads them only from Hugging Face folders).
S, F = "sliding_attention", "full_attention"
GEMMA3_VOCAB = 262_144


@dataclass
class Case:
    model_cls: type
    config: transformers.PretrainedConfig
    tweak: object = None
    tokenizer: str = "smollm2"  # the embedded model whose tokenizer the checkpoint is saved with
    special_tokens: tuple[str, ...] = ()  # added to it, where the converter looks some up


def _gemma3(**changes):
    # llama.cpp writes no layer types: it reads Gemma 3's five sliding layers to one global
    layers = changes.get("num_hidden_layers", 6)
    types = [S if (i + 1) % 6 else F for i in range(layers)]
    text = {**test_models_gemma3.TEXT, "num_hidden_layers": 6, "layer_types": types}
    return transformers.Gemma3TextConfig(**{**text, **changes})


def _gemma4(variant: str) -> dict:
    config = {**test_models_gemma4.COMMON, **test_models_gemma4.VARIANTS[variant]}
    if config.get("vocab_size_per_layer_input"):
        config["vocab_size_per_layer_input"] = GEMMA3_VOCAB  # per-layer inputs span the vocabulary
    return config


CASES = {
    "llama": Case(
        transformers.LlamaForCausalLM, transformers.LlamaConfig(**test_models_llama.CONFIG)
    ),
    # llama.cpp's llama graph has no sliding window (Mistral-7B-v0.1's 4096 is dropped)
    "mistral": Case(
        transformers.MistralForCausalLM,
        transformers.MistralConfig(**{**test_models_mistral.CONFIG, "sliding_window": None}),
    ),
    # a head size that is not hidden / heads, like Qwen3-8B's 128 with 4096 / 32 heads; llama.cpp
    # has no sliding window for Qwen3 (released configs set use_sliding_window false)
    "qwen3": Case(
        transformers.Qwen3ForCausalLM,
        transformers.Qwen3Config(
            **{**test_models_qwen3.CONFIG, "head_dim": 24, "use_sliding_window": False}
        ),
    ),
    # Gemma-3-270m..12b: the query scale is the head size's
    "gemma3": Case(transformers.Gemma3ForCausalLM, _gemma3()),
    # Gemma-3-27B: 62 layers, query_pre_attn_scalar = hidden / heads (168), not the head size
    "gemma3-27b": Case(
        transformers.Gemma3ForCausalLM,
        _gemma3(
            hidden_size=96,
            num_hidden_layers=62,
            query_pre_attn_scalar=24,
        ),
    ),
    # transformers' config always holds MoE fields, so the converter writes "nemotron_h_moe"
    "nemotron_h": Case(
        transformers.NemotronHForCausalLM,
        transformers.NemotronHConfig(**test_models_nemotron_h.CONFIG),
        test_models_nemotron_h.perturb,
    ),
    "nemotron_h-dense": Case(
        transformers.NemotronHForCausalLM,
        transformers.NemotronHConfig(
            **{**test_models_nemotron_h.CONFIG, "hybrid_override_pattern": "M*-M-*M"}
        ),
        test_models_nemotron_h.perturb,
    ),
    # Gemma 4's converter wants a SentencePiece-style BPE (byte fallback): Gemma 3's
    **{
        f"gemma4-{variant}": Case(
            transformers.Gemma4ForCausalLM,
            transformers.Gemma4TextConfig(**_gemma4(variant)),
            test_models_gemma4._randomize_scalars,
            tokenizer="gemma3-270m",
        )
        for variant in sorted(test_models_gemma4.VARIANTS)
    },
    # GLM-4.7-Flash: llama.cpp writes it as "deepseek2", kv_b_proj split per head
    "glm4_moe_lite": Case(
        transformers.Glm4MoeLiteForCausalLM,
        transformers.Glm4MoeLiteConfig(**test_models_glm4_moe_lite.CONFIG),
        test_models_glm4_moe_lite.randomize_correction_bias,
        special_tokens=("[gMASK]", "<sop>", "<|user|>", "<|observation|>", "<|endoftext|>"),
    ),
    "exaone_moe": Case(
        transformers.ExaoneMoeForCausalLM,
        transformers.ExaoneMoeConfig(
            **{
                **test_models_exaone_moe.CONFIG,
                "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse"],
            }
        ),
        test_models_exaone_moe._randomize_correction_bias,
    ),
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizers():
    """The embedded models' tokenizers by alias, each loaded once; from `KESTREL_TEST_TOKENIZERS`
    (a folder of them saved with `save_pretrained`, one `<alias>/` each) where it is set, for a
    GPU machine that cannot install the embedded models' packages."""
    cache, saved = {}, os.environ.get("KESTREL_TEST_TOKENIZERS")

    def of(alias: str):
        if alias not in cache:
            cache[alias] = (
                AutoTokenizer.from_pretrained(Path(saved) / alias)
                if saved
                else load_tokenizer(resolve(alias))
            )
        return cache[alias]

    return of


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory, tokenizers):
    """(checkpoint folder, F32 GGUF converted by llama.cpp, transformers' prompt logits)."""
    case = CASES[request.param]
    tokenizer = copy.deepcopy(tokenizers(case.tokenizer))
    tokenizer.add_special_tokens({"additional_special_tokens": list(case.special_tokens)})
    case.config.vocab_size = len(tokenizer)  # the converter checks the vocabulary
    root = tmp_path_factory.mktemp(request.param)
    folder = save_tiny(case.model_cls, case.config, root / "hf", tokenizer, tweak=case.tweak)
    path = convert(folder, root / "model-f32.gguf")
    return folder, path, reference_logits(folder, case.model_cls, PROMPT), case.model_cls


def load_gguf(path):
    return load_model(resolve(str(path)), torch.float32, torch.device("cpu"), progress=False)


def test_converted_gguf_matches_transformers(converted):
    folder, path, expected, _ = converted
    model = load_gguf(path)
    assert_close(chunked_logits(model, PROMPT, len(PROMPT)), expected)
    assert_close(chunked_logits(model, PROMPT, 5), expected)


def test_converted_gguf_decodes_like_transformers(converted):
    folder, path, expected, _ = converted
    model = load_gguf(path)
    assert_close(decode_logits(model, PROMPT, 9), expected)


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_half_and_q8_0_files_match_transformers_reading_the_same_file(
    outtype, tmp_path, tokenizers
):
    """The converter's other out types (Q8_0 blocks made by its gguf-py): kestrel equals
    transformers' own GGUF loader on the same file, a second reading of the tensors and their
    dequantization. Mistral: transformers' loader drops Llama 3's rope_freqs."""
    case = CASES["mistral"]
    tokenizer = tokenizers(case.tokenizer)
    case.config.vocab_size = len(tokenizer)
    folder = save_tiny(case.model_cls, case.config, tmp_path / "hf", tokenizer)
    path = convert(folder, tmp_path / f"model-{outtype}.gguf", outtype)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = oracle(torch.tensor([PROMPT])).logits[0]
    assert_close(chunked_logits(load_gguf(path), PROMPT, 5), expected)
