"""Images in OpenAI chat requests -> the inputs of a vision-language model (Qwen-VL families).

Content parts `{"type": "image_url", "image_url": {"url": ...}}` carry `data:image/...;base64,`
URLs, or `file://` URLs of files under the server's `--allowed-local-media-path` directory.
Nothing is fetched over the network. Bad input raises InvalidRequestError naming the content
part (`messages[i].content[j]`), which the server turns into a 400.

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

import base64
import binascii
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch

from kestrel.errors import InvalidRequestError
from kestrel.models.batch import ImageRows
from kestrel.models.mrope import prompt_rope_ids
from kestrel.models.qwen_vision import VisionFeatures

log = logging.getLogger("kestrel.multimodal")


@dataclass(frozen=True)
class MediaLimits:
    """What a request may send: images per request, bytes and pixels per image, and the one
    directory local files may come from (None: no local files)."""

    max_images: int = 8
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 50_000_000
    allowed_local_media_path: Path | None = None


# --- content parts -> images --------------------------------------------------------------------


def collect_images(messages: list[dict], limits: MediaLimits) -> tuple[list[dict], list]:
    """OpenAI chat messages -> (messages for the chat template, with each image part replaced
    by `{"type": "image"}`, and the decoded RGB images in order)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            parts.append(_template_part(part, param))
            if parts[-1]["type"] == "image":
                if len(images) == limits.max_images:
                    raise InvalidRequestError(
                        f"too many images: at most {limits.max_images} per request", param
                    )
                images.append(load_image(_image_url(part, param), param, limits))
        out.append({**message, "content": parts})
    return out, images


def _template_part(part, param: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return {"type": "text", "text": part.get("text", "")}
    if kind == "image_url":
        return {"type": "image"}
    raise InvalidRequestError(
        f"unsupported content part type {kind!r}; supported: text, image_url", param
    )


def _image_url(part: dict, param: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else None
    if not isinstance(url, str):
        raise InvalidRequestError('an image_url part needs "image_url": {"url": "..."}', param)
    return url


def load_image(url: str, param: str, limits: MediaLimits):
    """A data: or file: URL -> an RGB PIL image, within `limits`."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url_bytes(url, param, limits)
    elif scheme == "file":
        data = _local_file_bytes(url, param, limits)
    elif scheme in ("http", "https"):
        raise InvalidRequestError(
            "images are not fetched over the network; send the image inline as a "
            "data:image/...;base64,... URL",
            param,
        )
    else:
        raise InvalidRequestError(f"unsupported image URL scheme {scheme!r}", param)
    return _decode_image(data, param, limits)


_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)$", re.S
)


def _data_url_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    match = _DATA_URL.match(url)
    if match is None or ";base64" not in match["params"]:
        raise InvalidRequestError("an image data URL must be data:image/...;base64,...", param)
    if not (match["mime"] or "").lower().startswith("image/"):
        raise InvalidRequestError(f"not an image: data URL of type {match['mime']!r}", param)
    encoded = match["data"]
    if len(encoded) * 3 // 4 > limits.max_image_bytes:
        raise _too_large(param, limits)
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"the image data URL is not valid base64 ({e})", param) from e


def _local_file_bytes(url: str, param: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise InvalidRequestError(
            "local image files are disabled; start the server with --allowed-local-media-path DIR",
            param,
        )
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise InvalidRequestError(f"image file {path} is outside the allowed directory", param)
    if not path.is_file():
        raise InvalidRequestError(f"image file {path} does not exist", param)
    if path.stat().st_size > limits.max_image_bytes:
        raise _too_large(param, limits)
    return path.read_bytes()


def _decode_image(data: bytes, param: str, limits: MediaLimits):
    from PIL import Image

    if len(data) > limits.max_image_bytes:
        raise _too_large(param, limits)
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limits.max_image_pixels:
            raise InvalidRequestError(
                f"image of {image.width}x{image.height} pixels is too large: at most "
                f"{limits.max_image_pixels} pixels",
                param,
            )
        return image.convert("RGB")
    except InvalidRequestError:
        raise
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"image is too large ({e})", param) from e
    except (OSError, ValueError, SyntaxError) as e:
        raise InvalidRequestError(f"not a valid image ({e})", param) from e


def _too_large(param: str, limits: MediaLimits) -> InvalidRequestError:
    return InvalidRequestError(f"image is too large: at most {limits.max_image_bytes} bytes", param)


# --- images + chat template -> model inputs ---------------------------------------------------


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

    def __init__(self, tokenizer, image_processor, config, limits: MediaLimits = MediaLimits()):
        self.tokenizer, self.image_processor, self.limits = tokenizer, image_processor, limits
        self.image_token_id = config.image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.merge = config.vision_config.spatial_merge_size

    @classmethod
    def from_pretrained(cls, path, tokenizer=None, limits: MediaLimits = MediaLimits()):
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


def load_processor(takes_images: bool, path, tokenizer, limits: MediaLimits = MediaLimits()):
    """The MultimodalProcessor of a checkpoint folder whose model takes images (Engine.processor);
    None for text models, or (with a warning) when the folder has no image processor config."""
    if not takes_images:
        return None
    try:
        return MultimodalProcessor.from_pretrained(path, tokenizer, limits)
    except (OSError, ValueError) as e:
        log.warning("%s: no image processor (%s); serving text only", path, e)
        return None


def image_part_params(messages: list[dict]) -> list[str]:
    """`messages[i].content[j]` of every image part; empty for a text-only conversation."""
    return [
        f"messages[{i}].content[{j}]"
        for i, message in enumerate(messages)
        if isinstance(message.get("content"), list)
        for j, part in enumerate(message["content"])
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]


def chat_prompt(processor, messages: list[dict]) -> MultimodalPrompt:
    """The MultimodalPrompt of chat messages with image parts; a 400 naming the first image part
    when the model takes no images (`processor` None)."""
    params = image_part_params(messages)
    if processor is None and params:
        raise InvalidRequestError("this model does not take images (image_url parts)", params[0])
    return processor(messages)
