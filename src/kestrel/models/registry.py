"""model_type -> model class. One file per family; add a line here to serve a new one."""

import importlib

from kestrel.errors import UnsupportedModelError

# model_type (as in config.json) -> "module:Class" under kestrel.models
ARCHITECTURES: dict[str, str] = {
    "llama": "llama:LlamaForCausalLM",
    "mistral": "llama:LlamaForCausalLM",
    "qwen2": "llama:LlamaForCausalLM",
    "qwen3": "llama:LlamaForCausalLM",
    "gemma3_text": "gemma3:Gemma3ForCausalLM",
    "gemma3": "gemma3:Gemma3ForCausalLM",
    "nemotron_h": "nemotron_h:NemotronHForCausalLM",
    "jamba": "jamba:JambaForCausalLM",
    "minicpm3": "minicpm3:MiniCPM3ForCausalLM",
    "mistral4": "mistral4:Mistral4ForCausalLM",
    "glm4_moe_lite": "glm4_moe_lite:Glm4MoeLiteForCausalLM",
    "exaone_moe": "exaone_moe:ExaoneMoeForCausalLM",
    "gemma4": "gemma4:Gemma4ForCausalLM",
    "gemma4_text": "gemma4:Gemma4ForCausalLM",
    "nemotron-nas": "nemotron_nas:NemotronNasForCausalLM",
    "qwen2_vl": "qwen2_vl:Qwen2VLForConditionalGeneration",
    "qwen3_vl": "qwen3_vl:Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def model_class(model_type: str):
    """The class serving `model_type`, or a clear error listing what is supported."""
    target = ARCHITECTURES.get(model_type)
    if target is None:
        raise UnsupportedModelError(
            f"unknown architecture {model_type!r}; supported: {', '.join(supported_architectures())}"
        )
    module, cls = target.split(":")
    return getattr(importlib.import_module(f"kestrel.models.{module}"), cls)
