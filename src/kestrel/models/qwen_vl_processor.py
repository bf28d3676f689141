"""Chat messages with images -> the inputs of a Qwen-VL model (qwen2_vl, qwen3_vl, qwen3_vl_moe).

Images are preprocessed by transformers' image processor for the checkpoint
(AutoImageProcessor); the chat template places one image placeholder per image, expanded to
the image's token count as transformers' Qwen-VL processors do. The engine then:

    prompt = processor(messages)                          # MultimodalPrompt
    cache.rope_delta = prompt.rope_delta                  # text after the images is shifted
    features = model.encode_images(prompt.pixel_values, prompt.image_grid_thw)   # once
    rope, images = prompt.chunk_inputs(features, start, length)   # per prefill chunk
    SeqChunk(cache, row, length, rope_positions=rope, images=images)

and decodes as usual. (Runners that pack without SeqChunks put the same inputs on the
ForwardBatch, with batch rows.)
"""

import hashlib
import logging
from dataclasses import dataclass

import torch

from kestrel.errors import InvalidRequestError
from kestrel.media import DEFAULT_LIMITS, MediaLimits, collect_images, image_part_params
from kestrel.models.batch import ImageRows
from kestrel.models.layers.mrope import prompt_rope_ids
from kestrel.models.layers.qwen_vision import VisionFeatures

log = logging.getLogger("kestrel.qwen_vl_processor")


@dataclass
class MultimodalPrompt:
    """A tokenized prompt with images: token_ids (L,), rope_positions (3, L) M-RoPE ids,
    pixel_values (P, C*t*p*p) and image_grid_thw (n, 3) for `encode_images`, image_spans the
    token range [start, end) of each image."""

    token_ids: list[int]
    rope_positions: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_spans: list[tuple[int, int]]

    @property
    def rope_delta(self) -> int:
        """What the text after the prompt adds to its positions for RoPE."""
        return int(self.rope_positions.max()) + 1 - len(self.token_ids)

    def image_keys(self) -> tuple[tuple[int, bytes], ...]:
        """(first token, digest of its pixels and grid) of each image, for the prefix cache:
        the same text with another image is another prefix."""
        keys, row = [], 0
        for (start, _), grid in zip(self.image_spans, self.image_grid_thw.tolist(), strict=True):
            n = grid[0] * grid[1] * grid[2]
            pixels = self.pixel_values[row : row + n].float().contiguous().numpy().tobytes()
            digest = hashlib.blake2b(pixels, digest_size=16)
            digest.update(repr(grid).encode())
            keys.append((start, digest.digest()))
            row += n
        return tuple(keys)

    def image_rows(self) -> torch.Tensor:
        """(N,) prompt index of each image token, in the order of the encoded features."""
        return torch.cat([torch.arange(s, e) for s, e in self.image_spans])

    def chunk_inputs(
        self, features: VisionFeatures, start: int, length: int
    ) -> tuple[torch.Tensor, ImageRows | None]:
        """For prompt tokens [start, start + length): their (3, length) M-RoPE ids and the
        features of the image tokens among them (rows relative to `start`), or None."""
        rope = self.rope_positions[:, start : start + length]
        rows = self.image_rows()
        inside = (rows >= start) & (rows < start + length)
        if not bool(inside.any()):
            return rope, None
        device = features.embeds.device
        picked = inside.nonzero()[:, 0].to(device)
        deepstack = [d[picked] for d in features.deepstack]
        rows = (rows[inside] - start).to(device)
        return rope, ImageRows(rows, features.embeds[picked], deepstack)


class MultimodalProcessor:
    """Chat messages with image parts -> MultimodalPrompt, for one Qwen-VL checkpoint."""

    def __init__(self, tokenizer, image_processor, config, limits: MediaLimits = DEFAULT_LIMITS):
        self.tokenizer, self.image_processor, self.limits = tokenizer, image_processor, limits
        self.image_token_id = config.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.merge = config.vision_config.spatial_merge_size

    @classmethod
    def from_pretrained(cls, path, tokenizer=None, limits: MediaLimits = DEFAULT_LIMITS):
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
        image_processor = AutoImageProcessor.from_pretrained(path)
        return cls(tokenizer, image_processor, AutoConfig.from_pretrained(path), limits)

    def __call__(
        self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs
    ) -> MultimodalPrompt:
        template_messages, images = collect_images(messages, self.limits)
        if not images:
            raise InvalidRequestError("the request has no image parts", "messages")
        text = self.tokenizer.apply_chat_template(
            template_messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        if text.count(self.image_token) != len(images):
            raise InvalidRequestError(
                f"the prompt places {text.count(self.image_token)} images for {len(images)} sent "
                "(the chat template must place each image part once, and text may not contain "
                f"{self.image_token!r})",
                "messages",
            )
        return self._tokenize(text, images)

    def _tokenize(self, text: str, images: list) -> MultimodalPrompt:
        pixels = self.image_processor(images=images, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge**2).tolist()
        pieces = text.split(self.image_token)
        expanded = pieces[0] + "".join(
            self.image_token * n + piece for n, piece in zip(counts, pieces[1:], strict=True)
        )
        ids = self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
        token_ids = torch.tensor(ids)
        rope = prompt_rope_ids(token_ids, self.image_token_id, grid, self.merge)
        spans = _image_spans(token_ids == self.image_token_id, counts)
        return MultimodalPrompt(ids, rope, pixels["pixel_values"], grid, spans)


def _image_spans(is_image: torch.Tensor, counts: list[int]) -> list[tuple[int, int]]:
    """Token range of each image: the image tokens, taken `counts[i]` at a time."""
    rows = is_image.nonzero()[:, 0].tolist()
    spans, first = [], 0
    for n in counts:
        spans.append((rows[first], rows[first + n - 1] + 1))
        first += n
    return spans


def load_processor(takes_images: bool, path, tokenizer, limits: MediaLimits = DEFAULT_LIMITS):
    """The MultimodalProcessor of a checkpoint folder whose model takes images (Engine.processor);
    None for text models, or (with a warning) when the folder has no image processor config."""
    if not takes_images:
        return None
    try:
        return MultimodalProcessor.from_pretrained(path, tokenizer, limits)
    except (OSError, ValueError) as e:
        log.warning("%s: no image processor (%s); serving text only", path, e)
        return None


def chat_prompt(processor, messages: list[dict]) -> MultimodalPrompt:
    """The MultimodalPrompt of chat messages with image parts; a 400 naming the first image part
    when the model takes no images (`processor` None)."""
    params = image_part_params(messages)
    if processor is None and params:
        raise InvalidRequestError("this model does not take images (image_url parts)", params[0])
    return processor(messages)
