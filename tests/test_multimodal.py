"""Image content parts of OpenAI chat requests: what loads, and the 400s (InvalidRequestError
naming the content part) for everything else."""

import base64
from pathlib import Path

import pytest
import torch
import transformers
from tests.vl_reference import image_part, png_data_url, special_ids, tiny_tokenizer

from kestrel.errors import InvalidRequestError
from kestrel.media import MediaLimits, collect_images
from kestrel.models.qwen_vl_processor import MultimodalProcessor

PATCH, MERGE = 4, 2


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look: "}, *parts]}]


def rejected(messages, limits: MediaLimits | None = None) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        collect_images(messages, limits or MediaLimits())
    return info.value


def test_data_url_image_loads_as_rgb():
    template_messages, images = collect_images(user(image_part(png_data_url(8, 12))), MediaLimits())
    assert [(im.mode, im.size) for im in images] == [("RGB", (12, 8))]
    assert template_messages[0]["content"][1] == {"type": "image"}


def test_network_url_is_refused_without_fetching():
    error = rejected(user(image_part("https://example.com/cat.png")))
    assert error.param == "messages[0].content[1]"
    assert "network" in str(error) and "data:image" in str(error)


@pytest.mark.parametrize(
    "url,reason",
    [
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "not an image"),
        ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "valid image"),
        ("data:image/png;base64,%%%not-base64%%%", "base64"),
        ("data:image/png,rawbytes", "base64"),
        ("ftp://host/cat.png", "scheme"),
    ],
)
def test_non_images_are_refused(url, reason):
    error = rejected(user(image_part(url)))
    assert error.param == "messages[0].content[1]" and reason in str(error)


def test_too_large_image_is_refused():
    url = png_data_url(64, 64)
    assert "too large" in str(rejected(user(image_part(url)), MediaLimits(max_image_bytes=1000)))
    error = rejected(user(image_part(url)), MediaLimits(max_image_pixels=64 * 63))
    assert "64x64 pixels is too large" in str(error)


def test_too_many_images_names_the_first_extra_part():
    parts = [image_part(png_data_url(8, 8, seed=i)) for i in range(3)]
    error = rejected(user(*parts), MediaLimits(max_images=2))
    assert error.param == "messages[0].content[3]" and "at most 2" in str(error)


def test_malformed_parts_are_refused():
    error = rejected(user({"type": "input_audio", "input_audio": {}}))
    assert error.param == "messages[0].content[1]" and "input_audio" in str(error)
    error = rejected(user({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}))
    assert error.param == "messages[0].content[1]" and '"url"' in str(error)


def test_local_files_only_inside_the_allowed_directory(tmp_path: Path):
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir(), outside.mkdir()
    png = base64.b64decode(png_data_url(8, 8).split(",", 1)[1])
    (allowed / "cat.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    limits = MediaLimits(allowed_local_media_path=allowed)

    _, images = collect_images(user(image_part(f"file://{allowed}/cat.png")), limits)
    assert images[0].size == (8, 8)
    assert "disabled" in str(rejected(user(image_part(f"file://{allowed}/cat.png"))))
    for escape in [
        f"file://{outside}/secret.png",
        f"file://{allowed}/../private/secret.png",
        f"file://{allowed}/link.png",
    ]:
        error = rejected(user(image_part(escape)), limits)
        assert error.param == "messages[0].content[1]" and "outside" in str(error)
    assert "does not exist" in str(rejected(user(image_part(f"file://{allowed}/no.png")), limits))


# --- the processor: chat template + image processor -> prompt inputs -------------------------------


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> MultimodalProcessor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder = tmp_path_factory.mktemp("vl_processor")
    tokenizer = tiny_tokenizer()
    vision = dict(patch_size=PATCH, spatial_merge_size=MERGE, depth=1, embed_dim=16, num_heads=2)
    config = transformers.Qwen2VLConfig(vision_config=vision, **special_ids(tokenizer))
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, min_pixels=64).save_pretrained(
        folder
    )
    return MultimodalProcessor.from_pretrained(folder)


def test_prompt_expands_each_image_to_its_tokens(processor):
    side = PATCH * MERGE
    parts = [image_part(png_data_url(3 * side, 2 * side)), image_part(png_data_url(side, side))]
    prompt = processor(user(*parts))
    assert prompt.image_grid_thw.tolist() == [[1, 6, 4], [1, 2, 2]]
    assert [e - s for s, e in prompt.image_spans] == [6, 1]
    ids = torch.tensor(prompt.token_ids)
    image_rows = (ids == processor.image_token_id).nonzero()[:, 0]
    assert image_rows.tolist() == prompt.image_rows().tolist()
    assert prompt.rope_positions.shape == (3, len(prompt.token_ids))
    assert prompt.rope_delta == (3 - 6) + (1 - 1)  # each image advances max(rows, cols) ids


def test_prompt_refuses_requests_whose_images_and_placeholders_disagree(processor):
    with pytest.raises(InvalidRequestError, match="no image parts"):
        processor(user({"type": "text", "text": "only text"}))
    sneaky = user({"type": "text", "text": "<|image_pad|>"}, image_part(png_data_url(8, 8)))
    with pytest.raises(InvalidRequestError, match="places 2 images for 1 sent"):
        processor(sneaky)
