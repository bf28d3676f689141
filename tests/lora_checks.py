"""Tiny checkpoints with PEFT adapters written by `peft` itself, and their oracle: transformers +
peft's `merge_and_unload()` model on the same checkpoint (shared by the LoRA tests)."""

from pathlib import Path

import peft
import torch
import transformers
from tests.reference import save_tiny
from tests.test_models_gemma3 import TEXT as GEMMA3
from tests.test_models_glm4_moe_lite import CONFIG as GLM
from tests.test_models_glm4_moe_lite import randomize_correction_bias
from tests.test_models_qwen3 import CONFIG as QWEN3

from kestrel.cache.sequence import SequenceCache
from kestrel.lora.manager import LoRAManager
from kestrel.models.batch import ForwardBatch
from kestrel.sampling import SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.1,
)
# family -> (transformers class, config, the modules its adapters adapt)
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**LLAMA), ATTENTION + MLP),
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**QWEN3), ATTENTION + MLP),
    "gemma3": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig(**GEMMA3),
        ATTENTION + MLP,
    ),
    # MLA's projections: told "gate_proj" (any, even a shared expert's), peft adapts the routed
    # experts' stacked weights as well, which kestrel refuses (tests/test_lora.py)
    "glm4_moe_lite": (
        transformers.Glm4MoeLiteForCausalLM,
        transformers.Glm4MoeLiteConfig(**GLM),
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    ),
}
TWEAKS = {"glm4_moe_lite": randomize_correction_bias}
PROMPT = [(i * 37 + 11) % 120 for i in range(20)]


def base_checkpoint(family: str, folder: Path, tokenizer=None, vocab: int | None = None) -> Path:
    """The family's tiny random checkpoint (with `tokenizer` and its `vocab` when given)."""
    model_cls, config, _ = FAMILIES[family]
    if vocab is not None:
        config = type(config)(**{**config.to_dict(), "vocab_size": vocab})
    return save_tiny(model_cls, config, folder, tokenizer, tweak=TWEAKS.get(family))


def write_adapter(base: Path, folder: Path, family: str, seed: int, rank: int = 8, **config):
    """A random (non-zero B) PEFT adapter of rank `rank` on `base`, saved by peft to `folder`;
    returns the merged transformers model (the oracle)."""
    model_cls, _, targets = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls.from_pretrained(base, dtype=torch.float32)
    settings = dict(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**{**settings, **config}))
    with torch.no_grad():  # peft's random init is small: make the adapter matter
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    adapted.save_pretrained(folder)
    return adapted.merge_and_unload().eval()


def oracle_logits(merged, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return merged(torch.tensor([ids])).logits[0].float()


def kestrel_logits(model, manager: LoRAManager, name: str | None, ids: list[int]) -> torch.Tensor:
    """The model's full-prompt logits with adapter `name` (None: the base) in a slot."""
    key = manager.key(name) if name else b""
    slot = manager.slot_for("probe", key)
    manager.set_step([slot] * len(ids))
    try:
        with torch.no_grad():
            return model(ForwardBatch.single(SequenceCache(model.cache_specs()), torch.tensor(ids)))
    finally:
        manager.release("probe")


def generate_all(engine, requests: dict[str, tuple[list[int], str | None]], max_tokens=8):
    """Greedy tokens (and the first step's log-probs) of requests id -> (prompt, adapter)
    added to `engine` together."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    for request_id, (prompt, lora) in requests.items():
        engine.add_request(request_id, prompt, params, lora=lora)
    tokens = {request_id: [] for request_id in requests}
    first = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            first.setdefault(out.request_id, out.new_logprobs[0] if out.new_logprobs else None)
            tokens[out.request_id] += out.new_token_ids
    return tokens, first
