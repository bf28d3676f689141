"""POST /v1/embeddings on a real `kestrel serve` process (smollm2), through the real `openai`
client: unit vectors of the model's hidden size, equal for equal texts and whether batched or
not, base64 equal to floats, usage, the 400s naming their parameter, and a chat completion that
runs beside embeddings undisturbed."""

import base64
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from server_fixtures import start_server, tiny_model

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["The cat sat on the mat.", "Quantum chromodynamics describes the strong force.", "Hi"]


def embed(client, texts, **kwargs) -> list[list[float]]:
    response = client.embeddings.create(model="smollm2", input=texts, **kwargs)
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return [d.embedding for d in response.data]


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def assert_all_close(vectors, expected, abs: float) -> None:
    assert len(vectors) == len(expected)
    for vector, want in zip(vectors, expected, strict=True):
        assert vector == pytest.approx(want, abs=abs)


def tokens(server, text: str) -> list[int]:
    status, body = server.post("/tokenize", {"content": text, "add_special": True})
    assert status == 200, body
    return body["tokens"]


def post_embeddings(server, body: dict) -> tuple[int, dict]:
    return server.post("/v1/embeddings", {"model": "smollm2", **body})


def test_embeddings_create_gives_unit_vectors(client):
    response = client.embeddings.create(model="smollm2", input="Hello, world")
    assert response.object == "list" and response.model == "smollm2"
    (item,) = response.data
    assert item.object == "embedding" and item.index == 0
    assert len(item.embedding) > 1
    assert norm(item.embedding) == pytest.approx(1.0, abs=1e-5)


def test_equal_texts_have_cosine_one_and_different_ones_less(client):
    same_a, same_b, other = embed(client, [TEXTS[0], TEXTS[0], TEXTS[1]])
    assert cosine(same_a, same_b) == pytest.approx(1.0, abs=1e-6)
    assert cosine(same_a, other) < 0.999


def test_batched_vectors_equal_single_calls(client):
    batched = embed(client, TEXTS)
    for text, vector in zip(TEXTS, batched, strict=True):
        (single,) = embed(client, text)
        assert single == pytest.approx(vector, abs=1e-5)


def test_base64_equals_float(server, client):
    status, floats = post_embeddings(server, {"input": TEXTS[:2], "encoding_format": "float"})
    assert status == 200, floats
    status, packed = post_embeddings(server, {"input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200, packed
    for as_float, as_b64 in zip(floats["data"], packed["data"], strict=True):
        raw = base64.b64decode(as_b64["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert list(decoded) == pytest.approx(as_float["embedding"], abs=1e-7)
    # the openai client asks for base64 unless told otherwise, and decodes it itself
    assert_all_close(embed(client, TEXTS[:2]), [d["embedding"] for d in floats["data"]], 1e-7)


def test_token_id_inputs_equal_their_text(server, client):
    ids = [tokens(server, text) for text in TEXTS[:2]]
    by_ids = embed(client, ids)
    (one_list,) = embed(client, ids[0])
    by_text = embed(client, TEXTS[:2])
    assert_all_close(by_ids, by_text, 1e-5)
    assert one_list == pytest.approx(by_text[0], abs=1e-5)


def test_usage_counts_the_prompt_tokens(server, client):
    response = client.embeddings.create(model="smollm2", input=TEXTS)
    expected = sum(len(tokens(server, text)) for text in TEXTS)
    assert response.usage.prompt_tokens == expected > len(TEXTS)
    assert response.usage.total_tokens == expected


def test_dimensions_other_than_the_hidden_size_is_400(client):
    (vector,) = embed(client, "size")
    (same,) = embed(client, "size", dimensions=len(vector))  # its own size is fine
    assert same == pytest.approx(vector, abs=1e-6)
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="smollm2", input="size", dimensions=len(vector) - 1)
    assert error.value.body["param"] == "dimensions"
    assert str(len(vector)) in error.value.body["message"]


@pytest.mark.parametrize(
    "value,param",
    [
        ("", "input"),
        ([], "input"),
        (["fine", ""], "input[1]"),
        ([[1, 2], []], "input[1]"),
        ([10**7], "input"),  # a token id outside the vocabulary
        ("word " * 1100, "input"),  # longer than the server's 1024-token context
    ],
)
def test_bad_input_is_400_naming_it(client, value, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="smollm2", input=value)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param


def test_wrong_types_and_unsupported_fields_are_400(server):
    status, body = post_embeddings(server, {"input": "x", "encoding_format": "int8"})
    assert status == 400 and body["error"]["param"] == "encoding_format"
    status, body = post_embeddings(server, {"input": [1, "x"]})
    assert status == 400 and body["error"]["param"].startswith("input")
    status, body = post_embeddings(server, {"input": "x", "truncate_prompt_tokens": 8})
    assert status == 400 and body["error"]["param"] == "truncate_prompt_tokens"
    status, body = post_embeddings(server, {"input": "x", "user": "someone"})
    assert status == 200, body


def test_model_is_optional_and_unknown_models_are_404(server):
    status, body = server.post("/v1/embeddings", {"input": "x"})
    assert status == 200 and body["model"] == "smollm2"
    status, body = server.post("/v1/embeddings", {"input": "x", "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_chat_beside_embeddings_answers_as_alone(client, server):
    def chat():
        response = client.chat.completions.create(
            model="smollm2", messages=QUESTION, temperature=0, max_tokens=16
        )
        return response.choices[0].message.content

    alone = chat()
    assert "Paris" in alone
    expected = embed(client, TEXTS)
    before = server.metrics()["kestrel_embeddings_total"]
    with ThreadPoolExecutor(4) as pool:
        answer = pool.submit(chat)
        vectors = [pool.submit(embed, client, TEXTS) for _ in range(3)]
        assert answer.result() == alone
        for future in vectors:
            assert_all_close(future.result(), expected, 1e-5)
    assert server.metrics()["kestrel_embeddings_total"] == before + 3 * len(TEXTS)


def test_mean_pooling_flag(tmp_path):
    """`--pooling mean` serves the L2-normalized mean of the final-norm hidden states: equal to
    kestrel's model run in this process over the whole prompt, and unlike last-token pooling."""
    import torch
    import torch.nn.functional as F

    from kestrel.cache.sequence import SequenceCache
    from kestrel.models.batch import ForwardBatch
    from kestrel.tokenizer import encode
    from kestrel.weights.loader import load

    folder = tiny_model()
    mean = start_server(["-m", folder, "--pooling", "mean"])
    last = start_server(["-m", folder])
    try:
        model, tokenizer, _ = load(folder, torch.float32, torch.device("cpu"), False)
        ids = torch.tensor(encode(tokenizer, TEXTS[1]))
        batch = ForwardBatch.single(SequenceCache(model.cache_specs()), ids)
        with torch.inference_mode():
            hidden = model.hidden(batch)  # (T, H)
        got = {}
        for name, server in (("mean", mean), ("last", last)):
            status, body = server.post("/v1/embeddings", {"input": TEXTS[1]})
            assert status == 200, body
            got[name] = body["data"][0]["embedding"]
        expected_mean = F.normalize(hidden.mean(0), dim=0).tolist()
        expected_last = F.normalize(hidden[-1], dim=0).tolist()
        assert got["mean"] == pytest.approx(expected_mean, abs=1e-5)
        assert got["last"] == pytest.approx(expected_last, abs=1e-5)
        assert cosine(got["mean"], got["last"]) < 0.999
    finally:
        mean.stop()
        last.stop()
