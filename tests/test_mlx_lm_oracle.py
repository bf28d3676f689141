"""MLX affine checkpoints written by mlx-lm itself, read as mlx-lm reads them: per family, a tiny
random transformers checkpoint goes through `mlx_lm.convert` (4 bits in groups of 64; for llama
also 2, 3, 5, 6 and 8 bits, groups of 32 and 128, mlx-lm's mixed recipes, a custom per-layer
predicate and bfloat16 scales), and kestrel's float32 logits of the folder equal mlx-lm's own
forward of it on the CPU. tests/test_quant_formats.py checks the formats with kestrel's own
writer; here mlx-lm packs the values, names the tensors (its `switch_mlp` expert stacks, its
channels-last conv weights) and writes the per-layer config.

mlx-lm 0.32 reads some configs differently from transformers, and computes a few families
differently; the checkpoints are built so that both describe the same model (see `mlx_config`
and the families' notes), and windows are longer than the prompt (the families' own tests check
sliding windows against transformers). mlx-lm's vision-language modules (qwen2_vl, qwen3_vl,
qwen3_vl_moe) write text-only folders, which kestrel's multimodal classes do not serve; Gemma 3's
multimodal checkpoint is served as its text model, and is here.

Tolerance: mlx-lm computes in the checkpoint's dtype (float32 here) with its own kernels; the
measured differences are below 8e-5 at logits up to ~17, so `ATOL` leaves a 6x margin.
docs/verification-mlx-fp8.md lists the measured differences.
"""

import importlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.oracle_checks import assert_logits_match
from tests.reference import load_kestrel, save_tiny

from kestrel.models.layers.quant import QuantLinear

TEXT = "The quick brown fox jumps over the lazy dog, again and again, and then once more."
ATOL = 5e-4  # measured <= 8e-5 (float32 on both sides) at logits of magnitude 1-7
S, F = "sliding_attention", "full_attention"


def _tests(family: str):
    return importlib.import_module(f"tests.test_models_{family}")


@dataclass
class Spec:
    """A family's tiny checkpoint for mlx-lm: its test file's config with every quantized
    matrix's input width a multiple of 64 (mlx-lm leaves a matrix whose width is not a whole
    number of groups in float), and what mlx-lm needs to read it as transformers does."""

    model_cls: type
    config_cls: type
    config: dict
    tweak: object = None
    atol: float = ATOL
    extra: dict = field(default_factory=dict)  # config.json keys for mlx-lm's reading of it


def _specs() -> dict[str, Spec]:
    wide = dict(hidden_size=128, intermediate_size=256)
    llama, mistral, qwen2, qwen3 = (_tests(f) for f in ("llama", "mistral", "qwen2", "qwen3"))
    gemma3, minicpm3, glm = _tests("gemma3"), _tests("minicpm3"), _tests("glm4_moe_lite")
    exaone, nemotron_h, jamba = _tests("exaone_moe"), _tests("nemotron_h"), _tests("jamba")
    mistral4, gemma4 = _tests("mistral4"), _tests("gemma4")
    gemma3_text = {
        **gemma3.TEXT,
        "hidden_size": 256,
        "intermediate_size": 256,
        "final_logit_softcapping": None,
        "sliding_window": 64,
    }
    mla = dict(kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    specs = {
        "llama": Spec(
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig,
            {**llama.CONFIG, **wide, "num_hidden_layers": 2, "head_dim": 16},
        ),
        "mistral": Spec(
            transformers.MistralForCausalLM,
            transformers.MistralConfig,
            {**mistral.CONFIG, **wide, "num_hidden_layers": 2, "sliding_window": None},
        ),
        "qwen2": Spec(
            transformers.Qwen2ForCausalLM,
            transformers.Qwen2Config,
            {**qwen2.CONFIG, **wide, "num_hidden_layers": 2, "use_sliding_window": False},
        ),
        "qwen3": Spec(
            transformers.Qwen3ForCausalLM,
            transformers.Qwen3Config,
            {**qwen3.CONFIG, **wide, "num_hidden_layers": 2, "use_sliding_window": False},
        ),
        # mlx-lm's gemma3_text has no final soft-capping (released Gemma 3 sets none) and rounds
        # the embedding scale sqrt(hidden) to bfloat16: hidden 256, whose root is exact
        "gemma3_text": Spec(
            transformers.Gemma3ForCausalLM,
            transformers.Gemma3TextConfig,
            gemma3_text,
        ),
        # the multimodal checkpoint Gemma 3 is released as: mlx-lm keeps its text model
        "gemma3": Spec(
            transformers.Gemma3ForConditionalGeneration,
            lambda **text: transformers.Gemma3Config(
                text_config=text,
                vision_config={"model_type": "siglip_vision_model", **gemma3.VISION},
                mm_tokens_per_image=1,
            ),
            gemma3_text,
        ),
        # untied: mlx-lm's tied MiniCPM3 head leaves out the logits' 1 / (hidden /
        # dim_model_base) scale (transformers and kestrel apply it either way); one LongRoPE
        # factor list: mlx-lm's SuScaledRoPE applies `long_factor` at every length
        "minicpm3": Spec(
            minicpm3.MODEL,
            transformers.MiniCPM3Config,
            {
                **minicpm3.CONFIG,
                **mla,
                "hidden_size": 128,
                "intermediate_size": 128,
                "q_lora_rank": 64,
                "v_head_dim": 32,  # mlx-lm takes v_head_dim = hidden / heads
                "tie_word_embeddings": False,
                "rope_parameters": {
                    **minicpm3.CONFIG["rope_parameters"],
                    "short_factor": [2.0, 4.0, 3.0, 2.5],
                    "long_factor": [2.0, 4.0, 3.0, 2.5],
                },
            },
        ),
        "glm4_moe_lite": Spec(
            glm.MODEL,
            transformers.Glm4MoeLiteConfig,
            {
                **glm.CONFIG,
                **mla,
                "hidden_size": 128,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "q_lora_rank": 64,
            },
            glm.randomize_correction_bias,
        ),
        "mistral4": Spec(
            mistral4.MODEL,
            transformers.Mistral4Config,
            {
                **mistral4.COMMON,
                **mistral4.VARIANTS["q_lora_interleaved"],
                **mla,
                "hidden_size": 128,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "q_lora_rank": 64,
            },
        ),
        "exaone_moe": Spec(
            exaone.MODEL_CLS,
            transformers.ExaoneMoeConfig,
            {
                **exaone.CONFIG,
                "hidden_size": 128,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "head_dim": 16,
                "sliding_window": 64,
            },
            exaone._randomize_correction_bias,
            # mlx-lm reads the dense/sparse layers from `is_moe_layer`
            extra={"is_moe_layer": [t == "sparse" for t in exaone.CONFIG["mlp_layer_types"]]},
        ),
        "nemotron_h": Spec(
            nemotron_h.MODEL_CLS,
            transformers.NemotronHConfig,
            {
                **nemotron_h.CONFIG,
                "hidden_size": 128,
                "intermediate_size": 128,
                "moe_intermediate_size": 64,
                "moe_shared_expert_intermediate_size": 128,
                "moe_latent_size": 64,
            },
            nemotron_h.perturb,
        ),
        # every expert chosen: mlx-lm's Jamba renormalizes the chosen experts' softmax,
        # transformers' (and kestrel's) weights them by the softmax over all experts
        "jamba": Spec(
            jamba.MODEL_CLS,
            transformers.JambaConfig,
            {
                **jamba.CONFIG,
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_experts": 2,
                "num_experts_per_tok": 2,
            },
            jamba.perturb,
        ),
    }
    for variant in ("dense", "moe", "kv_shared_ple"):
        config = {
            **gemma4.COMMON,
            **gemma4.VARIANTS[variant],
            "hidden_size": 128,
            "intermediate_size": 128,
            "head_dim": 32,
            "global_head_dim": 64,
            "sliding_window": 64,
        }
        if variant == "moe":
            config["moe_intermediate_size"] = 64
        if variant == "kv_shared_ple":
            config["hidden_size_per_layer_input"] = 64
            config["vocab_size_per_layer_input"] = None  # the tokenizer's vocabulary
        # transformers keeps the full layers' head size and KV heads as per-layer overrides;
        # mlx-lm reads them from these keys
        extra = {"global_head_dim": 64}
        if config.get("num_global_key_value_heads"):
            extra["num_global_key_value_heads"] = config["num_global_key_value_heads"]
        specs[f"gemma4_text-{variant}"] = Spec(
            gemma4.MODEL_CLS,
            transformers.Gemma4TextConfig,
            config,
            gemma4._randomize_scalars,
            extra=extra,
        )
    return specs


SPECS = _specs()

# llama in every width and group size kestrel serves, and mlx-lm's mixed recipes
LLAMA_CASES = {
    "q2-g64": dict(q_bits=2, q_group_size=64),
    "q3-g32": dict(q_bits=3, q_group_size=32),
    "q4-g128": dict(q_bits=4, q_group_size=128),
    "q5-g64": dict(q_bits=5, q_group_size=64),
    "q6-g64": dict(q_bits=6, q_group_size=64),
    "q8-g32": dict(q_bits=8, q_group_size=32),
    "mixed_3_6": dict(q_group_size=64, quant_predicate="mixed_3_6"),
    "mixed_2_6": dict(q_group_size=32, quant_predicate="mixed_2_6"),
}


def custom_predicate(path: str, module) -> bool | dict:
    """Per layer: layer 0's attention at 8 bits in groups of 32, layer 1's down_proj float,
    the head at 6 bits in groups of 128, the rest at the default (4 bits, groups of 64)."""
    if "layers.0.self_attn" in path:
        return {"group_size": 32, "bits": 8, "mode": "affine"}
    if path.endswith("layers.1.mlp.down_proj"):
        return False
    if path == "lm_head":
        return {"group_size": 128, "bits": 6, "mode": "affine"}
    return True


def mlx_config(folder: Path, extra: dict) -> None:
    """Rewrite config.json so that mlx-lm 0.32 reads the model transformers reads: every field
    written out (transformers leaves out its defaults, where mlx-lm has its own), RoPE also under
    the pre-5.0 keys mlx-lm reads (`rope_theta`, `rope_scaling`; Gemma 3's
    `rope_local_base_freq` and `sliding_window_pattern`), a multimodal checkpoint's vocabulary
    size also at the top, and the family's `extra` keys."""
    config = transformers.AutoConfig.from_pretrained(folder).to_dict()
    text = config.get("text_config") or config
    rope = text.get("rope_parameters") or {}
    if "rope_type" in rope:
        text["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            text["rope_scaling"] = rope
    elif text["model_type"] == "gemma3_text":
        text["rope_theta"] = rope[F]["rope_theta"]
        text["rope_local_base_freq"] = rope[S]["rope_theta"]
        text["sliding_window_pattern"] = text["layer_types"].index(F) + 1
    config["vocab_size"] = text["vocab_size"]
    (folder / "config.json").write_text(json.dumps({**config, **extra}, indent=2))


@pytest.fixture(scope="session")
def mlx():
    """(mlx.core, mlx_lm): the optional `oracles` extra."""
    mx = pytest.importorskip("mlx.core", reason="the oracles extra (mlx[cpu]) is not installed")
    return mx, pytest.importorskip("mlx_lm", reason="the oracles extra (mlx-lm) is not installed")


@pytest.fixture(scope="session")
def prompt(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="session")
def float_folder(tmp_path_factory, smollm2_tokenizer):
    """family -> its tiny float32 checkpoint (with SmolLM2's tokenizer, which mlx-lm loads)."""
    root, made = tmp_path_factory.mktemp("mlx-float"), {}

    def build(family: str) -> Path:
        if family not in made:
            spec = SPECS[family]
            vocab = {"vocab_size": len(smollm2_tokenizer)}
            if "vocab_size_per_layer_input" in spec.config:
                vocab["vocab_size_per_layer_input"] = len(smollm2_tokenizer)
            config = spec.config_cls(**{**spec.config, **vocab})
            folder = save_tiny(
                spec.model_cls, config, root / family, smollm2_tokenizer, tweak=spec.tweak
            )
            mlx_config(folder, spec.extra)
            made[family] = folder
        return made[family]

    return build


@pytest.fixture(scope="session")
def converted(tmp_path_factory, float_folder, mlx):
    """(family, case name, convert options) -> the folder mlx_lm.convert writes (once)."""
    root, made = tmp_path_factory.mktemp("mlx-converted"), {}

    def build(family: str, name: str, **options) -> Path:
        if (family, name) not in made:
            out = root / f"{family}-{name}"
            shutil.rmtree(out, ignore_errors=True)
            options = {"dtype": "float32", **options}
            mlx[1].convert(str(float_folder(family)), str(out), quantize=True, **options)
            made[family, name] = out
        return made[family, name]

    return build


def mlx_logits(mlx, folder: Path, ids: list[int], dtype=None) -> torch.Tensor:
    """mlx-lm's own forward of the folder on the CPU, as float32 (the model cast to `dtype`
    first when given)."""
    mx, mlx_lm = mlx
    model, _ = mlx_lm.load(str(folder))
    if dtype is not None:
        model.set_dtype(dtype)
    logits = model(mx.array([ids]))[0].astype(mx.float32)
    return torch.from_numpy(np.array(logits))


def check(folder: Path, expected: torch.Tensor, prompt: list[int], atol: float) -> float:
    """kestrel's logits of the folder (whole prompt and in chunks of 5) within `atol` of
    `expected`; returns the largest difference. Every quantized matrix stays quantized."""
    model = load_kestrel(folder)
    assert any(isinstance(m, QuantLinear) for m in model.modules())
    assert expected.abs().max() > 0.5
    return assert_logits_match(model, folder.name, expected, prompt, atol)


def quantized_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization"]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_family_4_bit_groups_of_64_equals_mlx_lm(family, converted, mlx, prompt):
    folder = converted(family, "q4-g64", q_bits=4, q_group_size=64)
    assert quantized_config(folder)["bits"] == 4
    check(folder, mlx_logits(mlx, folder, prompt), prompt, SPECS[family].atol)


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_bits_groups_and_mixed_recipes_equal_mlx_lm(case, converted, mlx, prompt):
    folder = converted("llama", case, **LLAMA_CASES[case])
    if case.startswith("mixed"):  # per-layer overrides in config.json: two widths at least
        overrides = {k: v for k, v in quantized_config(folder).items() if isinstance(v, dict)}
        assert len({v["bits"] for v in overrides.values()}) == 2, overrides
    check(folder, mlx_logits(mlx, folder, prompt), prompt, ATOL)


def test_custom_predicate_mixes_widths_groups_and_float_layers(converted, mlx, prompt):
    folder = converted(
        "llama", "custom", q_bits=4, q_group_size=64, quant_predicate=custom_predicate
    )
    q = quantized_config(folder)
    assert q["model.layers.0.self_attn.q_proj"]["bits"] == 8 and q["lm_head"]["bits"] == 6
    check(folder, mlx_logits(mlx, folder, prompt), prompt, ATOL)
    model = load_kestrel(folder)
    assert not isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)


def test_mixed_recipe_on_moe_experts(converted, mlx, prompt):
    # mlx-lm's recipe gives the switch_mlp stacks their own widths
    folder = converted("glm4_moe_lite", "mixed_4_6", q_group_size=64, quant_predicate="mixed_4_6")
    check(folder, mlx_logits(mlx, folder, prompt), prompt, ATOL)


def test_bfloat16_scales(converted, mlx, prompt):
    """mlx-lm's usual output: bfloat16 scales, biases and float weights. kestrel computes in
    float32 from them: equal to mlx-lm's forward with the model cast to float32 (the bfloat16
    values are exact in float32), and near mlx-lm's own bfloat16 forward (its rounding:
    measured 0.33 at logits of ~5, so 1.0 here)."""
    mx = mlx[0]
    folder = converted("llama", "q4-g64-bf16", q_bits=4, q_group_size=64, dtype="bfloat16")
    check(folder, mlx_logits(mlx, folder, prompt, dtype=mx.float32), prompt, ATOL)
    check(folder, mlx_logits(mlx, folder, prompt), prompt, 1.0)


def test_mlx_conv_weight_layout_loads_as_transformers_layout():
    """mlx-lm saves depthwise conv weights channels-last, (channels, kernel, 1)."""
    from kestrel.models.layers.mamba import conv_weight

    hf = torch.randn(6, 1, 4)
    mlx_layout = hf.transpose(1, 2).contiguous()
    name = "model.layers.0.mamba.conv1d.weight"
    assert torch.equal(conv_weight(name, mlx_layout), hf)
    assert conv_weight(name, hf) is hf
    assert conv_weight("model.layers.0.mamba.in_proj.weight", mlx_layout) is mlx_layout


def test_nemotron_nas_equals_mlx_lm(mlx, tmp_path):
    """DeciLM blocks of their own KV grouping and MLP width, and no-op attention or MLP, through
    mlx-lm's quantize_model and save (its `convert` loads a tokenizer through transformers, which
    needs the remote code a nemotron-nas config names). No linear-replacement blocks: mlx-lm names
    their weight `linear`, published checkpoints `linear_attn` / `linear_mlp`, so mlx-lm cannot
    load those. The test file's hidden size 32 is one group of 32."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model
    from tests.test_models_nemotron_nas import PROMPT, block, nas_config, random_checkpoint

    blocks = [
        block("gqa", group=1, mult=1.0),
        block("gqa", group=4, ffn="none"),
        block("none", ffn="mlp", mult=13.0),
        block("gqa", group=2, mult=1.0),
    ]
    random_checkpoint(nas_config(blocks), tmp_path)
    model, config = quantize_model(*load_model(tmp_path), group_size=32, bits=4)
    folder = tmp_path / "nemotron-nas-q4-g32"
    save_model(folder, model)
    save_config(config, folder / "config.json")
    model = load_model(folder)[0]
    expected = torch.from_numpy(np.array(model(mlx[0].array([PROMPT]))[0].astype(mlx[0].float32)))
    check(folder, expected, PROMPT, ATOL)
