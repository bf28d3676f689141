"""Writes llm-compressor checkpoints for tests/test_llm_compressor_oracle.py. llm-compressor pins
an older transformers than kestrel needs, so this runs in a virtual environment of its own (the
Makefile's `oracles-env`), never importing kestrel:

    python tests/llm_compressor_writer.py SOURCE OUT:SCHEME [OUT:SCHEME ...]

For each pair it loads the float checkpoint SOURCE (MoE experts as one Linear each, as
llm-compressor quantizes them), runs `oneshot` with a QuantizationModifier of preset SCHEME
(FP8, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, NVFP4, ...) on every Linear but the head and the MoE
routers, calibrating on a few tokenized sentences (static activation scales: FP8, NVFP4), and
saves it compressed to OUT.
"""

import sys

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantized weights keep their scales beside them in the checkpoint.",
    "A kestrel hovers in the wind before it dives.",
    "Seven plus five is twelve, and twelve times two is twenty-four.",
]
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*router$"]


def write(source: str, out: str, scheme: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = linearize_moe(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32))
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES]
    # one length: llm-compressor's min-max observers of NVFP4's activation groups (W4A4) fail
    # on samples of different lengths in some modules (MLA's kv_b_proj)
    ids = [i[: min(map(len, ids))] for i in ids]
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=len(ids))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    for pair in sys.argv[2:]:
        out, scheme = pair.rsplit(":", 1)
        write(sys.argv[1], out, scheme)
