"""Images in OpenAI chat requests: content parts -> decoded images, under the server's limits.

Content parts `{"type": "image_url", "image_url": {"url": ...}}` carry `data:image/...;base64,`
URLs, or `file://` URLs of files under the server's `--allowed-local-media-path` directory.
Nothing is fetched over the network. Bad input raises InvalidRequestError naming the content
part (`messages[i].content[j]`), which the server turns into a 400. What a model makes of the
images is its family's business (models/qwen_vl_processor.py for the Qwen-VL families).
"""

import base64
import binascii
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from kestrel.errors import InvalidRequestError

log = logging.getLogger("kestrel.media")


@dataclass(frozen=True)
class MediaLimits:
    """What a request may send: images per request, bytes and pixels per image, and the one
    directory local files may come from (None: no local files)."""

    max_images: int = 8
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 50_000_000
    allowed_local_media_path: Path | None = None


DEFAULT_LIMITS = MediaLimits()


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


def image_part_params(messages: list[dict]) -> list[str]:
    """`messages[i].content[j]` of every image part; empty for a text-only conversation."""
    return [
        f"messages[{i}].content[{j}]"
        for i, message in enumerate(messages)
        if isinstance(message.get("content"), list)
        for j, part in enumerate(message["content"])
        if isinstance(part, dict) and part.get("type") == "image_url"
    ]
