"""FP8 and NVFP4 checkpoints written by llm-compressor and by NVIDIA ModelOpt, read as
compressed-tensors and ModelOpt read them. llm-compressor: tiny random checkpoints of a dense family (llama) and MoE families (exaone_moe;
glm4_moe_lite, whose MLA kv_b_proj kestrel dequantizes at load) go through llm-compressor's
`oneshot` with the presets FP8 (per-tensor weights, static activations), FP8_DYNAMIC (per-row
weights), FP8_BLOCK (128 x 128 tiles), NVFP4A16 and NVFP4 (W4A4), and kestrel's float32 logits
of each folder equal transformers' float32 forward of the weights compressed-tensors decompresses
from it. tests/test_quant_formats.py checks the formats with kestrel's own writer; here
llm-compressor quantizes, packs and names (its per-expert Linear layers, its scale layouts and
global scales) and compressed-tensors decodes. ModelOpt (FP8_DEFAULT_CFG, NVFP4_DEFAULT_CFG, on
llama and exaone_moe) quantizes and exports on the CPU, but runs its quantized forward on CUDA
only: its oracle is its own decoding (FP8QTensor / NVFP4QTensor) of the exported tensors, run by
transformers in float32.

llm-compressor pins transformers <= 5.17, kestrel needs >= 5.24: the checkpoints are written by
tests/quant_oracle_writer.py in a virtual environment of its own (`make oracles-env`; its python
is $KESTREL_ORACLE_PYTHON, else .venv-oracles/bin/python), and the tests skip without it.
compressed-tensors (in the `oracles` extra) decompresses in kestrel's environment.

Activations: on the CPU kestrel multiplies float activations by the dequantized weights, also
for the schemes whose activations the GPU quantizes (FP8 static/dynamic, NVFP4's W4A4: kestrel
serves NVFP4 as weights only and ignores `input_global_scale`), so the oracle is the decompressed
weights with float activations.

The oracle decompresses module by module with compressed-tensors' own compressors into a float
checkpoint that transformers loads (transformers' own compressed-tensors loading fills fused MoE
experts from llm-compressor's per-expert NVFP4 tensors with garbage: 2.7e3 where the weights are
below 0.5). compressed-tensors unpacks NVFP4 to bfloat16 by default, rounding each weight to
bfloat16; the logits check unpacks to float32 (its `unpack_fp4_from_uint8(dtype=...)`), and a
separate check holds kestrel's float32 weights, rounded, to the bfloat16 ones.

Tolerance: measured below 1e-5 at logits of magnitude ~6 (float32 on both sides); ATOL leaves
a margin of 10x and more. docs/verification-mlx-fp8.md lists the measured differences.
"""

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.oracle_checks import assert_logits_match
from tests.reference import load_kestrel, reference_logits, save_tiny
from tests.test_models_exaone_moe import CONFIG as EXAONE
from tests.test_models_exaone_moe import MODEL_CLS as EXAONE_CLS
from tests.test_models_exaone_moe import _randomize_correction_bias
from tests.test_models_glm4_moe_lite import CONFIG as GLM
from tests.test_models_glm4_moe_lite import MODEL as GLM_CLS
from tests.test_models_glm4_moe_lite import randomize_correction_bias
from tests.test_models_llama import CONFIG as LLAMA

from kestrel.models.layers.moe import PackedStack
from kestrel.models.layers.quant import QuantLinear

ROOT = Path(__file__).resolve().parent.parent
WRITER = ROOT / "tests" / "quant_oracle_writer.py"
TEXT = "The quick brown fox jumps over the lazy dog, again and again, and then once more."
ATOL = 1e-4  # measured <= 1e-5 at logits of magnitude ~6
SCHEMES = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "NVFP4")
# scheme -> the layer type kestrel holds its weights as
QTYPES = {
    "FP8": "FP8_E4M3_TENSOR",
    "FP8_DYNAMIC": "FP8_E4M3_CHANNEL",
    "FP8_BLOCK": "FP8_E4M3_128x128",
    "NVFP4A16": "NVFP4",
    "NVFP4": "NVFP4",
}
# family -> (transformers class, config class, config, tweak, schemes). Widths: multiples of 16
# (NVFP4 groups); the MoE experts' 64 columns leave FP8_BLOCK a partial tile.
FAMILIES = {
    "llama": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig,
        {**LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2},
        None,
        SCHEMES,
    ),
    "exaone_moe": (
        EXAONE_CLS,
        transformers.ExaoneMoeConfig,
        {
            **EXAONE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "head_dim": 32,
            "sliding_window": 64,
        },
        _randomize_correction_bias,
        SCHEMES,
    ),
    "glm4_moe_lite": (
        GLM_CLS,
        transformers.Glm4MoeLiteConfig,
        {
            **GLM,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "q_lora_rank": 64,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
        },
        randomize_correction_bias,
        ("FP8_BLOCK", "NVFP4"),
    ),
}
# a family's first case runs the writer's process for all its cases (20-35 s on two cores)
CASES = [
    pytest.param(f, s, marks=[pytest.mark.slow] if s == spec[4][0] else [])
    for f, spec in FAMILIES.items()
    for s in spec[4]
]
# ModelOpt's configs -> kestrel's layer type, for the dense and one MoE family
MODELOPT = {"FP8_DEFAULT_CFG": "FP8_E4M3_TENSOR", "NVFP4_DEFAULT_CFG": "NVFP4"}
MODELOPT_CASES = [(f, c) for f in ("llama", "exaone_moe") for c in MODELOPT]


def writer_python() -> str | None:
    """The python of llm-compressor's own environment, if there is one."""
    python = os.environ.get("KESTREL_ORACLE_PYTHON") or str(ROOT / ".venv-oracles/bin/python")
    return python if Path(python).exists() else None


@pytest.fixture(scope="session")
def compressed_tensors():
    return pytest.importorskip(
        "compressed_tensors", reason="the oracles extra (compressed-tensors) is not installed"
    )


@pytest.fixture(scope="session")
def prompt(smollm2_tokenizer) -> list[int]:
    return smollm2_tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="session")
def written(tmp_path_factory, smollm2_tokenizer):
    """family -> {scheme: folder}: the float checkpoint, llm-compressor's and ModelOpt's folders
    of it (and ModelOpt's decoding, `<folder>-dequantized`), written once per family (one writer
    process for all its schemes)."""
    python = writer_python()
    if python is None:
        pytest.skip("no llm-compressor environment: make oracles-env (or KESTREL_ORACLE_PYTHON)")
    root, made = tmp_path_factory.mktemp("llm-compressor"), {}

    def build(family: str) -> dict[str, Path]:
        if family not in made:
            model_cls, config_cls, config, tweak, schemes = FAMILIES[family]
            config = config_cls(**{**config, "vocab_size": len(smollm2_tokenizer)})
            source = save_tiny(model_cls, config, root / family, smollm2_tokenizer, tweak=tweak)
            folders = {s: root / f"{family}-{s}" for s in schemes}
            pairs = [f"{folder}:{s}" for s, folder in folders.items()]
            if family in {f for f, _ in MODELOPT_CASES}:
                for c in MODELOPT:
                    folders[c] = root / f"{family}-modelopt-{c}"
                    pairs.append(f"{folders[c]}:modelopt:{c}")
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            run = subprocess.run(
                [python, str(WRITER), str(source), *pairs], capture_output=True, text=True, env=env
            )
            assert run.returncode == 0, run.stderr[-4000:]
            made[family] = {"float": source, **folders}
        return made[family]

    return build


def decompress(folder: Path, out: Path, float32: bool = True) -> Path:
    """A float checkpoint of `folder`'s weights as compressed-tensors' compressors decompress
    them, module by module (`float32`: NVFP4 unpacked to float32, not its default bfloat16)."""
    from compressed_tensors.compressors import nvfp4
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((folder / "config.json").read_text())
    q = QuantizationConfig.model_validate(config.pop("quantization_config"))
    (scheme,) = q.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or q.format)
    tensors = load_file(folder / "model.safetensors")
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale")}
    dense = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] not in modules}
    unpack = nvfp4.base.unpack_fp4_from_uint8
    if float32:
        nvfp4.base.unpack_fp4_from_uint8 = functools.partial(unpack, dtype=torch.float32)
    try:
        for module in modules:
            local = {
                n[len(module) + 1 :]: t for n, t in tensors.items() if n.startswith(module + ".")
            }
            dense[f"{module}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    finally:
        nvfp4.base.unpack_fp4_from_uint8 = unpack
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in dense.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def kestrel_weights(model) -> dict[str, torch.Tensor]:
    """Every quantized layer's weight as kestrel decodes it, float32 (experts: one per expert)."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            t = {r: getattr(module, r) for r in module.roles}
            weights[name] = module.fmt.dequantize_rows(t, slice(None), module.in_features)
    return weights


@pytest.mark.parametrize(("family", "scheme"), CASES)
def test_logits_equal_compressed_tensors_decompression(
    family, scheme, written, compressed_tensors, prompt, tmp_path
):
    folder = written(family)[scheme]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    model = load_kestrel(folder)
    assert {m.qtype for m in model.modules() if isinstance(m, QuantLinear)} == {QTYPES[scheme]}
    if family != "llama":  # the experts stay in their checkpoint's format (scales per row)
        assert any(isinstance(m, PackedStack) for m in model.modules())
    expected = reference_logits(
        decompress(folder, tmp_path / "decompressed"), transformers.AutoModelForCausalLM, prompt
    )
    assert expected.abs().max() > 1
    assert_logits_match(model, folder.name, expected, prompt, ATOL)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "NVFP4"])
def test_nvfp4_weights_round_to_compressed_tensors_bfloat16(
    scheme, written, compressed_tensors, tmp_path
):
    """compressed-tensors' stock NVFP4 decompression rounds each weight to bfloat16: kestrel's
    float32 weights, rounded to bfloat16, are those (to one bfloat16 step: compressed-tensors
    multiplies by the scale in bfloat16)."""
    folder = written("llama")[scheme]
    stock = load_file(decompress(folder, tmp_path / "stock", float32=False) / "model.safetensors")
    for name, weight in kestrel_weights(load_kestrel(folder)).items():
        ref = stock[f"{name}.weight"]
        step = ref.abs().clamp(min=1e-30) * 2**-7  # one bfloat16 step
        assert ((weight.bfloat16().float() - ref).abs() <= step).all(), name


@pytest.mark.parametrize(("family", "config"), MODELOPT_CASES)
def test_modelopt_logits_equal_modelopt_decoding(family, config, written, prompt):
    """ModelOpt's export (hf_quant_config.json; FP8 per tensor, NVFP4 in groups of 16 with a
    second scale) against its own FP8QTensor / NVFP4QTensor decoding of the same tensors."""
    folder = written(family)[config]
    quant = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == config.split("_")[0]
    model = load_kestrel(folder)
    assert {m.qtype for m in model.modules() if isinstance(m, QuantLinear)} == {MODELOPT[config]}
    if family != "llama":
        assert any(isinstance(m, PackedStack) for m in model.modules())
    decoded = Path(f"{folder}-dequantized")
    expected = reference_logits(decoded, transformers.AutoModelForCausalLM, prompt)
    assert expected.abs().max() > 1
    assert_logits_match(model, folder.name, expected, prompt, ATOL)
