"""Writes the quantized checkpoints of tests/test_llm_compressor_oracle.py with the outside tools:
llm-compressor (compressed-tensors format) and NVIDIA ModelOpt (its Hugging Face export).
llm-compressor pins an older transformers than kestrel needs, so this runs in a virtual
environment of its own (the Makefile's `oracles-env`), never importing kestrel:

    python tests/quant_oracle_writer.py SOURCE OUT:SCHEME [OUT:SCHEME ...]

For each pair it loads the float checkpoint SOURCE and writes OUT. A SCHEME of llm-compressor's
presets (FP8, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, NVFP4, ...) runs `oneshot` with a
QuantizationModifier on every Linear but the head and the MoE routers (MoE experts as one Linear
each), calibrating on a few tokenized sentences, and saves it compressed. `modelopt:CONFIG`
(FP8_DEFAULT_CFG, NVFP4_DEFAULT_CFG) runs ModelOpt's `mtq.quantize` with that config on the same
sentences and `export_hf_checkpoint`, then decodes the exported weights with ModelOpt's own
FP8QTensor / NVFP4QTensor into a float checkpoint OUT-dequantized (ModelOpt runs its quantized
forward on CUDA only, so its decoding is the oracle on the CPU).
"""

import json
import sys
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantized weights keep their scales beside them in the checkpoint.",
    "A falcon hovers in the wind before it dives.",
    "Seven plus five is twelve, and twelve times two is twenty-four.",
]
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*router$"]


def calibration(tokenizer) -> list[list[int]]:
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES]
    # one length: llm-compressor's min-max observers of NVFP4's activation groups (W4A4) fail
    # on samples of different lengths in some modules (MLA's kv_b_proj)
    return [i[: min(map(len, ids))] for i in ids]


def write_llm_compressor(source: str, out: str, scheme: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = linearize_moe(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))
    ids = calibration(tokenizer)
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=len(ids))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def write_modelopt(source: str, out: str, config: str) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    batches = [torch.tensor([i]) for i in calibration(tokenizer)]

    def forward_loop(m):
        for batch in batches:
            m(batch)

    model = mtq.quantize(model, getattr(mtq, config), forward_loop)
    export_hf_checkpoint(model, export_dir=out)
    tokenizer.save_pretrained(out)
    modelopt_decode(Path(out), Path(f"{out}-dequantized"))


def modelopt_decode(folder: Path, out: Path) -> None:
    """ModelOpt's exported weights decoded by ModelOpt's QTensor classes, saved as a float
    checkpoint (config.json without its quantization_config)."""
    import torch
    from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
    from safetensors.torch import load_file, save_file

    algo = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    tensors = load_file(folder / "model.safetensors")
    modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_scale")}
    dense = {}
    for name, t in tensors.items():
        module, _, role = name.rpartition(".")
        if module not in modules:
            dense[name] = t
        elif role == "weight" and algo["quant_algo"] == "FP8":
            q = FP8QTensor(t.shape, torch.float32, t)
            dense[name] = q.dequantize(scale=tensors[f"{module}.weight_scale"].float())
        elif role == "weight":  # NVFP4: two e2m1 values a byte
            shape = torch.Size([t.shape[0], t.shape[1] * 2])
            dense[name] = NVFP4QTensor(shape, torch.float32, t).dequantize(
                scale=tensors[f"{module}.weight_scale"],
                double_scale=tensors[f"{module}.weight_scale_2"].float(),
                block_sizes={-1: algo["group_size"]},
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.float().contiguous() for n, t in dense.items()}, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    for pair in sys.argv[2:]:
        out, scheme = pair.rsplit(":", 1)
        if out.endswith(":modelopt"):
            write_modelopt(sys.argv[1], out[: -len(":modelopt")], scheme)
        else:
            write_llm_compressor(sys.argv[1], out, scheme)
