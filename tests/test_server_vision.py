"""Image input end to end: OpenAI `image_url` content parts through a real `kestrel serve`
on a tiny random-weight qwen2_vl checkpoint (saved with its image processor and a chat template
that places the vision tokens), the LLM API on the same checkpoint, and the engine underneath.

Greedy outputs through the server (plain and streamed, data: and file:// URLs) equal the LLM
API's; the LLM API's equal the model driven directly (tests/vl_reference.py, itself checked against
transformers); image prompts batched with text prompts equal each run alone; a request under a
KV bound smaller than its image+text prompt succeeds and equals the model driven under the same
bound. Bad images, network URLs, files outside --allowed-local-media-path and images sent to a
text-only model answer 400 naming the content part.
"""

import base64
import io

import pytest
import torch
import transformers
from tests.reference import save_tiny
from tests.test_models_qwen2_vl import tiny_config
from tests.vl_reference import (
    image_part,
    kestrel_image_logits,
    png_data_url,
    save_tiny_vl,
    tiny_tokenizer,
    two_image_messages,
)
from tests.vl_suite import MERGE, PATCH

from kestrel.cache.sequence import SequenceCache
from kestrel.config import build_config
from kestrel.engine.paged_runner import pool_serves
from kestrel.llm import LLM
from kestrel.models.batch import ForwardBatch
from kestrel.models.qwen_vl_processor import chat_prompt
from kestrel.sampling import SamplingParams
from kestrel.tokenizer import apply_chat_template
from server_fixtures import start_server, wait_healthy

ALIAS = "tiny-vl"
NEW_TOKENS = 8
CHUNK = 8  # prefill chunk: image prompts (~50 tokens) prefill over several steps
SIDE = PATCH * MERGE  # one image token per SIDE x SIDE window
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def one_image_messages(seed: int = 3, text: str = "look: ") -> list[dict]:
    content = [{"type": "text", "text": text}, image_part(png_data_url(2 * SIDE, 3 * SIDE, seed))]
    return [{"role": "user", "content": content}]


def text_messages(text: str = "no pictures here, only words") -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The qwen2_vl checkpoint, a text-only qwen2 one (same tokenizer), a media folder, both
    servers (started together, waited for after the in-process LLM is built) and the LLM."""
    tokenizer = tiny_tokenizer()
    vl = tmp_path_factory.mktemp("qwen2_vl")
    save_tiny_vl(
        transformers.Qwen2VLForConditionalGeneration, tiny_config(), vl, tokenizer, PATCH, MERGE
    )
    text = tmp_path_factory.mktemp("qwen2_text")
    text_config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
    )
    save_tiny(transformers.Qwen2ForCausalLM, text_config, text, tokenizer)
    media = tmp_path_factory.mktemp("media")
    common = ["-a", ALIAS, "-np", "4", "--prefill-chunk-size", str(CHUNK)]
    servers = [
        start_server(
            ["-m", str(vl), *common, "--allowed-local-media-path", str(media)], wait=False
        ),
        start_server(["-m", str(text), *common], wait=False),
    ]
    llm = LLM(
        str(vl),
        prefill_chunk_size=CHUNK,
        max_num_seqs=4,
        progress=False,
        allowed_local_media_path=str(media),
    )
    for server in servers:
        wait_healthy(server)
    yield dict(
        llm=llm,
        vl=servers[0],
        text=servers[1],
        media=media,
        outside=tmp_path_factory.mktemp("outside"),
    )
    for server in servers:
        server.stop()


def _chat(server, messages, **kwargs):
    return server.client().chat.completions.create(
        model=ALIAS,
        messages=messages,
        temperature=0,
        max_tokens=NEW_TOKENS,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


# --- through the server -------------------------------------------------------------------------


def test_image_chat_through_openai_client_equals_llm_api(setup):
    messages = two_image_messages(PATCH, MERGE)
    with_logprobs = SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0
    )
    expected = setup["llm"].chat(messages, with_logprobs)[0]
    response = _chat(setup["vl"], messages, logprobs=True)
    choice = response.choices[0]
    assert choice.message.content == expected.outputs[0].text
    served = [entry.logprob for entry in choice.logprobs.content]
    out = expected.outputs[0]
    local = [lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    assert served == pytest.approx(local, abs=1e-4)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == NEW_TOKENS
    # the image is read: another image, same text, gives other next-token log-probs
    other = [{"role": "user", "content": list(messages[0]["content"])}]
    other[0]["content"][3] = image_part(png_data_url(2 * SIDE, 2 * SIDE, seed=99))
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    a, b = (setup["llm"].chat(m, first)[0].outputs[0].logprobs[0] for m in (messages, other))
    assert a.keys() != b.keys() or max(abs(a[t] - b[t]) for t in a) > 1e-4


def test_image_chat_stream_equals_the_plain_response(setup):
    messages = one_image_messages()
    plain = _chat(setup["vl"], messages).choices[0].message.content
    chunks = list(_chat(setup["vl"], messages, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    assert plain == setup["llm"].chat(messages, GREEDY)[0].outputs[0].text


def test_local_file_under_the_allowed_directory_equals_its_data_url(setup):
    data_url = one_image_messages()[0]["content"][1]["image_url"]["url"]
    path = setup["media"] / "picture.png"
    path.write_bytes(base64.b64decode(data_url.split(",", 1)[1]))
    by_file = one_image_messages()
    by_file[0]["content"][1] = image_part(path.as_uri())
    expected = _chat(setup["vl"], one_image_messages()).choices[0].message.content
    assert _chat(setup["vl"], by_file).choices[0].message.content == expected


def _post_image(server, url: str, n_images: int = 1) -> tuple[int, dict]:
    content = [{"type": "text", "text": "what is it?"}] + [image_part(url)] * n_images
    body = {"model": ALIAS, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return server.post("/v1/chat/completions", body)


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _bad_requests(setup) -> dict[str, tuple[str, int, str]]:
    """name -> (image URL, images sent, words the message must contain)."""
    from PIL import Image

    outside = setup["outside"] / "secret.png"
    outside.write_bytes(_png_bytes(Image.new("RGB", (SIDE, SIDE))))
    escape = setup["media"].as_uri() + "/../" + setup["outside"].name + "/secret.png"
    huge = Image.new("1", (8000, 8000))  # 64M pixels over the 50M limit, a small file
    huge_url = "data:image/png;base64," + base64.b64encode(_png_bytes(huge)).decode()
    ok = png_data_url(SIDE, SIDE)
    return {
        "network": ("https://example.com/cat.png", 1, "network"),
        "not_an_image": (
            "data:image/png;base64," + base64.b64encode(b"hello").decode(),
            1,
            "not a valid image",
        ),
        "not_base64": ("data:image/png;base64,@@@", 1, "base64"),
        "too_large": (huge_url, 1, "too large"),
        "too_many": (ok, 9, "too many images"),
        "outside_dir": (outside.as_uri(), 1, "outside the allowed directory"),
        "escape_dir": (escape, 1, "outside the allowed directory"),
    }


def test_bad_images_answer_400_naming_the_part(setup):
    for name, (url, count, words) in _bad_requests(setup).items():
        status, body = _post_image(setup["vl"], url, count)
        assert status == 400, (name, body)
        error = body["error"]
        assert words in error["message"], (name, error)
        assert error["param"].startswith("messages[0].content["), (name, error)
        assert error["type"] == "invalid_request_error"
    assert _post_image(setup["vl"], png_data_url(SIDE, SIDE))[0] == 200  # and it still serves


def test_malformed_image_parts_answer_400_through_the_openai_client(setup):
    import openai

    client = setup["vl"].client()
    bad = [
        {"type": "image_url", "image_url": {}},  # no url
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    ]
    for part in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=ALIAS, messages=[{"role": "user", "content": [part]}], max_tokens=2
            )
        assert caught.value.body["param"].startswith("messages[0].content")


def test_text_only_model_answers_400_to_an_image(setup):
    server = setup["text"]
    status, body = _post_image(server, png_data_url(SIDE, SIDE))
    assert status == 400 and "does not take images" in body["error"]["message"]
    assert body["error"]["param"] == "messages[0].content[1]"
    parts = [{"role": "user", "content": [{"type": "text", "text": "only text parts"}]}]
    for messages in (text_messages(), parts):  # text chat still works, as string or parts
        text = server.client().chat.completions.create(model=ALIAS, messages=messages, max_tokens=2)
        assert text.choices[0].finish_reason in ("length", "stop")


def test_vl_server_serves_text_only_chat(setup):
    response = _chat(setup["vl"], text_messages())
    assert response.choices[0].message.content == (
        setup["llm"].chat(text_messages(), GREEDY)[0].outputs[0].text
    )


# --- the engine ---------------------------------------------------------------------------------


def _greedy_reference(model, prompt, new: int, max_kv_size=None, keep=0) -> list[int]:
    """The model driven directly: prefill in CHUNK-token chunks (M-RoPE ids and image rows per
    chunk), then greedy decode, trimming the KV to `max_kv_size` before every step."""
    features = model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
    cache = SequenceCache(model.cache_specs())
    cache.rope_delta = prompt.rope_delta
    tokens = []
    with torch.no_grad():
        for start in range(0, len(prompt.token_ids), CHUNK):
            piece = torch.tensor(prompt.token_ids[start : start + CHUNK])
            rope, images = prompt.chunk_inputs(features, start, len(piece))
            cache.make_room(len(piece), max_kv_size, keep)
            logits = model(ForwardBatch.single(cache, piece, False, rope, images))
            cache.advance(len(piece))
        while True:
            tokens.append(int(logits[-1].argmax()))
            if len(tokens) == new:
                return tokens
            cache.make_room(1, max_kv_size, keep)
            logits = model(ForwardBatch.single(cache, torch.tensor(tokens[-1:])))
            cache.advance(1)


def test_llm_image_chat_equals_the_model_driven_directly(setup):
    llm = setup["llm"]
    prompt = llm.engine.processor(two_image_messages(PATCH, MERGE))
    out = llm.chat(two_image_messages(PATCH, MERGE), GREEDY)[0]
    assert out.prompt_token_ids == prompt.token_ids
    assert out.outputs[0].token_ids == _greedy_reference(llm.model, prompt, NEW_TOKENS)
    # the same through the whole-prompt logits of vl_reference (checked against transformers)
    logits = kestrel_image_logits(llm.model, prompt, 64, out.outputs[0].token_ids[:-1])
    assert logits[len(prompt.token_ids) - 1 :].argmax(-1).tolist() == out.outputs[0].token_ids


def test_image_prompts_batched_with_text_prompts_equal_each_alone(setup):
    llm = setup["llm"]
    conversations = [
        two_image_messages(PATCH, MERGE),
        text_messages(),
        one_image_messages(seed=5, text="and this one? "),
        text_messages("a second, rather longer text-only prompt that prefills over chunks"),
    ]
    batched = llm.chat(conversations, GREEDY)
    for conversation, together in zip(conversations, batched, strict=True):
        alone = llm.chat(conversation, GREEDY)[0]
        assert together.outputs[0].token_ids == alone.outputs[0].token_ids
    assert len({tuple(r.outputs[0].token_ids) for r in batched}) == len(conversations)
    assert not llm.engine.runner.image_features  # released once each prompt was in


def test_kv_bound_smaller_than_the_image_prompt_succeeds(setup):
    """max_kv_size 16 for a ~50-token prompt with two images, prefilled in chunks of 8 (boundaries
    inside the images): the request finishes, with the tokens of the model driven under the same
    bound; a text request batched with it is unaffected."""
    llm, kv = setup["llm"], 16
    engine = llm.engine
    keep = engine.config.cache.keep
    prompt = engine.processor(two_image_messages(PATCH, MERGE))
    assert len(prompt.token_ids) > 2 * kv
    trimmed = engine.scheduler.blocks.tokens_trimmed
    engine.add_request("bounded", prompt, GREEDY, max_kv_size=kv)
    engine.add_request("text", apply_chat_template(llm.tokenizer, text_messages()), GREEDY)
    tokens = {"bounded": [], "text": []}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    assert engine.scheduler.blocks.tokens_trimmed > trimmed
    assert tokens["bounded"] == _greedy_reference(llm.model, prompt, NEW_TOKENS, kv, keep)
    assert tokens["text"] == llm.chat(text_messages(), GREEDY)[0].outputs[0].token_ids


def test_vision_models_are_served_by_the_paged_pool(setup):
    """On CUDA a VL model gets the paged runner (its M-RoPE ids and image rows packed per batch;
    tests/vl_suite.py checks it equals the reference): every cache kind it has fits the pool."""
    assert pool_serves(setup["llm"].model)


def test_preempted_image_requests_recompute_to_the_same_output(setup):
    """Under a KV capacity the decodes outgrow, the newest image request is preempted and
    recomputed from its prompt and output (chunks crossing the prompt's end): every request
    still ends with the tokens it has alone."""
    from kestrel.engine.engine import Engine

    llm = setup["llm"]
    config = build_config(max_num_seqs=4, prefill_chunk_size=CHUNK, kv_capacity=120)
    engine = Engine(llm.model, llm.tokenizer, config)
    engine.processor = llm.engine.processor
    conversations = [two_image_messages(PATCH, MERGE), one_image_messages(seed=7)]
    params = SamplingParams(temperature=0, max_tokens=3 * NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for i, conversation in enumerate(conversations):
        engine.add_request(str(i), chat_prompt(engine.processor, conversation), params)
        tokens[str(i)] = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    assert engine.scheduler.num_preempted > 0
    for i, conversation in enumerate(conversations):
        assert tokens[str(i)] == llm.chat(conversation, params)[0].outputs[0].token_ids
