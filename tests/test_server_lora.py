"""LoRA adapters through a real `kestrel serve` and the real `openai` client: adapters listed in
/v1/models with the base as parent, chosen by `model`; three adapters and the base mixed in one
batch give each its tokens alone; adapters loaded and unloaded while requests stream lose none;
bad adapters are 400s naming the problem, behind the API key."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from tests.lora_checks import base_checkpoint, write_adapter

from server_fixtures import API_KEY, start_server

PROMPTS = {"a0": "one two three", "a1": "red green blue", "a2": "cat dog bird", None: "up down"}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("lora-served")
    base = base_checkpoint("llama", root / "base", smollm2_tokenizer, len(smollm2_tokenizer))
    folders = {}
    for i in range(5):
        folders[f"a{i}"] = root / f"a{i}"
        write_adapter(base, folders[f"a{i}"], "llama", seed=20 + i)
    return base, folders


@pytest.fixture(scope="module")
def server(adapters):
    base, folders = adapters
    modules = [f"a{i}={folders[f'a{i}']}" for i in range(3)]
    args = ["-m", str(base), "-a", "tiny", "-c", "256", "-np", "8", "--api-key", API_KEY]
    server = start_server(
        [*args, "--max-lora-rank", "8", "--max-loras", "3", "--lora-modules", *modules]
    )
    yield server
    server.stop()


def _tokens(client, model: str | None, prompt: str, n: int = 8) -> str:
    out = client.completions.create(
        model=model or "tiny",
        prompt=prompt,
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def _post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=600)


def test_adapters_are_listed_with_the_base_as_parent(server):
    cards = {m.id: m for m in server.client().models.list().data}
    assert {"a0", "a1", "a2"} <= set(cards)
    assert all(cards[f"a{i}"].model_extra["parent"] == "tiny" for i in range(3))


def test_three_adapters_and_the_base_in_one_batch_equal_each_alone(server):
    client = server.client()
    alone = {name: _tokens(client, name, prompt) for name, prompt in PROMPTS.items()}
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        runs = [pool.submit(_tokens, client, n, p) for n, p in PROMPTS.items() for _ in range(2)]
        mixed = [run.result() for run in runs]
    assert mixed == [alone[name] for name in PROMPTS for _ in range(2)]
    assert len(set(alone.values())) == len(alone)  # each adapter changes the output


def test_loading_and_unloading_under_load_loses_no_request(server, adapters):
    _, folders = adapters
    client = server.client()
    expected = _tokens(client, "a0", PROMPTS["a0"], 16)

    def stream() -> str:
        chunks = client.completions.create(
            model="a0",
            prompt=PROMPTS["a0"],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(12) as pool:
        runs = [pool.submit(stream) for _ in range(12)]
        for name in ("a3", "a4"):
            assert (
                _post(
                    server,
                    "/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": str(folders[name])},
                ).status_code
                == 200
            )
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
        assert [run.result() for run in runs] == [expected] * 12
    assert _tokens(client, "a4", PROMPTS["a0"])  # four adapters now, three slots: LRU
    ids = {m.id for m in client.models.list().data}
    assert "a4" in ids and "a3" not in ids
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a4"}).status_code == 200


def test_bad_adapters_are_400s_naming_the_problem(server, tmp_path):
    missing = _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400
    assert "adapter_config.json" in missing.json()["error"]["message"]
    unknown = _post(server, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]["message"]
    assert (
        _post(
            server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "."}, key=None
        ).status_code
        == 401
    )
    with pytest.raises(Exception, match="404|does not exist"):
        _tokens(server.client(), "nope", "hello")
    assert _tokens(server.client(), "a1", PROMPTS["a1"])  # everyone else is still served


def test_chat_and_responses_run_the_adapter_that_model_names(server):
    client = server.client()

    def chat(model: str) -> str:
        messages = [{"role": "user", "content": "hello there"}]
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0
        )
        return out.choices[0].message.content

    response = client.responses.create(
        model="a2", input="hello there", max_output_tokens=8, temperature=0
    )
    assert response.output_text == chat("a2") != chat("tiny")
