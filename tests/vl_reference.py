"""Helpers for the vision-language families: a tiny checkpoint with a byte-level tokenizer, a
Qwen-style chat template and an image processor; images as data URLs; kestrel's chunked prefill
and decode of an image prompt; transformers' forward on the same inputs (the oracle)."""

import base64
import io
from pathlib import Path

import numpy as np
import torch
from tests.reference import save_tiny

from kestrel.cache.sequence import SequenceCache
from kestrel.models.batch import ForwardBatch
from kestrel.models.qwen_vl_processor import MultimodalProcessor

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """Byte-level tokenizer (one token per byte, 256 ids) plus Qwen's chat/vision specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", additional_special_tokens=SPECIAL
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def special_ids(tokenizer) -> dict:
    """The config fields naming the vision tokens."""
    ids = dict(zip(SPECIAL, tokenizer.convert_tokens_to_ids(SPECIAL), strict=True))
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def save_tiny_vl(model_cls, config, folder: Path, tokenizer, patch: int, merge: int) -> Path:
    """A random checkpoint with tokenizer and image processor (patch size, merge size)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    save_tiny(model_cls, config, folder, tokenizer, tweak=_sharpen_attention)
    Qwen2VLImageProcessorPil(
        min_pixels=4 * (patch * merge) ** 2,
        max_pixels=64 * (patch * merge) ** 2,
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=2,
    ).save_pretrained(folder)
    return folder


def _sharpen_attention(model) -> None:
    # random init (std 0.02) leaves attention near uniform, blind to positions; sharpen it
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "attn.qkv.weight")):
            p.mul_(8.0)


def png_data_url(height: int, width: int, seed: int = 0) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def two_image_messages(patch: int, merge: int) -> list[dict]:
    """A user turn: text, a (3 x 4 windows) image, text, a (2 x 2 windows) image, text."""
    side = patch * merge
    content = [
        {"type": "text", "text": "hi "},
        image_part(png_data_url(3 * side, 4 * side, seed=1)),
        {"type": "text", "text": " and "},
        image_part(png_data_url(2 * side, 2 * side, seed=2)),
        {"type": "text", "text": " what?"},
    ]
    return [{"role": "user", "content": content}]


def image_prompt(folder: Path, patch: int, merge: int):
    return MultimodalProcessor.from_pretrained(folder)(two_image_messages(patch, merge))


def hf_inputs(prompt, image_token_id: int, continuation=()) -> dict:
    """transformers' forward kwargs for the prompt plus `continuation` text tokens."""
    ids = torch.tensor([prompt.token_ids + list(continuation)])
    return dict(
        input_ids=ids,
        pixel_values=prompt.pixel_values,
        image_grid_thw=prompt.image_grid_thw,
        mm_token_type_ids=(ids == image_token_id).int(),
    )


def hf_logits(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits[0].float()


def hf_masked_logits(model, inputs: dict, masks: dict) -> torch.Tensor:
    """transformers' forward under dense (n, n) bool masks, {layer_type: mask}; the M-RoPE ids
    come from transformers' own get_rope_index (the 4-D masks replace the padding mask it reads)."""
    position_ids, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    floor = torch.finfo(torch.float32).min
    additive = {
        t: torch.zeros(m.shape).masked_fill(~m, floor)[None, None] for t, m in masks.items()
    }
    if len(additive) == 1:  # one layer type: transformers takes the mask itself
        additive = next(iter(additive.values()))
    return hf_logits(model, **inputs, position_ids=position_ids, attention_mask=additive)


def kestrel_image_logits(
    model, prompt, chunk: int, continuation=(), max_kv_size=None, keep=0
) -> torch.Tensor:
    """Encode the images once, prefill the prompt in chunks of `chunk` (each with its M-RoPE ids
    and image rows), then decode `continuation` one token at a time. (L + C, V) logits."""
    features = model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    cache = SequenceCache(model.cache_specs())
    cache.rope_delta = prompt.rope_delta
    out = []
    with torch.no_grad():
        for start in range(0, len(prompt.token_ids), chunk):
            piece = torch.tensor(prompt.token_ids[start : start + chunk])
            rope, images = prompt.chunk_inputs(features, start, len(piece))
            cache.make_room(len(piece), max_kv_size, keep)
            out.append(model(ForwardBatch.single(cache, piece, True, rope, images)))
            cache.advance(len(piece))
        for token in continuation:
            out.append(model(ForwardBatch.single(cache, torch.tensor([token]))))
            cache.advance(1)
    return torch.cat(out)


def chunk_boundaries_inside_images(prompt, chunk: int) -> int:
    """How many chunk boundaries fall strictly inside an image's tokens."""
    return sum(
        s < b < e for b in range(chunk, len(prompt.token_ids), chunk) for s, e in prompt.image_spans
    )


_TINY_VL: list[Path] = []


def tiny_vl_checkpoint() -> Path:
    """tests/test_models_qwen2_vl.py's tiny qwen2_vl checkpoint (PATCH x MERGE windows, as
    tests/vl_suite.py), saved once per session: servers that take images share it."""
    if not _TINY_VL:
        import tempfile

        import transformers
        from tests.server_fixtures import SESSION_DIR
        from tests.test_models_qwen2_vl import tiny_config
        from tests.vl_suite import MERGE, PATCH

        folder = Path(tempfile.mkdtemp(prefix="tiny-vl-", dir=SESSION_DIR))
        model_cls = transformers.Qwen2VLForConditionalGeneration
        save_tiny_vl(model_cls, tiny_config(), folder, tiny_tokenizer(), PATCH, MERGE)
        _TINY_VL.append(folder)
    return _TINY_VL[0]
