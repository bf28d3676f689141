"""Every vision-language family through a real `kestrel serve`: an image chat through the
`openai` client, and requests of different lengths (images of two sizes, and text) sent together
give the greedy text each gives alone."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import transformers
from tests.test_models_qwen2_vl import tiny_config as qwen2_vl_config
from tests.test_models_qwen3_vl import text_config, vision_config
from tests.test_models_qwen3_vl_moe import MOE
from tests.vl_reference import image_part, png_data_url, save_tiny_vl, special_ids, tiny_tokenizer
from tests.vl_suite import MERGE, PATCH

from server_fixtures import start_server

pytestmark = pytest.mark.slow
ALIAS = "tiny-vl"
SIDE = PATCH * MERGE


def qwen3_vl_config(moe: bool):
    tokenizer = tiny_tokenizer()
    text = {**text_config(tokenizer), **(MOE if moe else {})}
    config_cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    return config_cls(text_config=text, vision_config=vision_config(), **special_ids(tokenizer))


FAMILIES = {
    "qwen2_vl": (transformers.Qwen2VLForConditionalGeneration, qwen2_vl_config),
    "qwen3_vl": (transformers.Qwen3VLForConditionalGeneration, lambda: qwen3_vl_config(False)),
    "qwen3_vl_moe": (
        transformers.Qwen3VLMoeForConditionalGeneration,
        lambda: qwen3_vl_config(True),
    ),
}


def image_messages(height: int, width: int, seed: int, text: str) -> list[dict]:
    content = [
        {"type": "text", "text": text},
        image_part(png_data_url(height * SIDE, width * SIDE, seed)),
    ]
    return [{"role": "user", "content": content}]


CONVERSATIONS = [
    image_messages(2, 3, seed=1, text="what is here?"),
    image_messages(4, 4, seed=2, text="describe this picture in detail, please"),
    [{"role": "user", "content": "no picture, just a question about words"}],
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def server(request, tmp_path_factory):
    model_cls, config = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_vl(model_cls, config(), folder, tiny_tokenizer(), PATCH, MERGE)
    process = start_server(
        ["-m", str(folder), "-a", ALIAS, "-np", "4", "--prefill-chunk-size", "8"]
    )
    yield process
    process.stop()


def chat(server, messages) -> str:
    response = server.client().chat.completions.create(
        model=ALIAS, messages=messages, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 6
    return response.choices[0].message.content


def test_image_chat_and_batched_requests_equal_each_alone(server):
    alone = [chat(server, messages) for messages in CONVERSATIONS]
    assert all(alone)
    with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:
        together = list(pool.map(lambda m: chat(server, m), CONVERSATIONS))
    assert together == alone
