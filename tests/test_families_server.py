"""Every seeded family through a real `kestrel serve` process and the CLI.

Each family gets a tiny random-weight checkpoint saved with SmolLM2's real tokenizer (so the
server can tokenize and apply the chat template). Through the `openai` client at temperature 0:
a chat completion and its streamed twin, then four prompts of different lengths sent at once
(one of them under a per-request `max_kv_size` shorter than its prompt) whose greedy outputs
must equal each request sent alone. `kestrel arch` lists every family and `kestrel inspect`
describes each checkpoint.
"""

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tests import test_models_exaone_moe as exaone_moe
from tests import test_models_gemma4 as gemma4
from tests import test_models_glm4_moe_lite as glm4_moe_lite
from tests import test_models_jamba as jamba
from tests import test_models_minicpm3 as minicpm3
from tests import test_models_mistral4 as mistral4
from tests import test_models_nemotron_h as nemotron_h
from tests import test_models_nemotron_nas as nemotron_nas
from tests.reference import save_tiny

from server_fixtures import start_server

ALIAS = "tiny"
NEW_TOKENS = 8
PREFILL_CHUNK = 16  # long prompts prefill over several steps while short ones already decode
KV_BOUND = 16  # below the longest prompt, above the server's keep (4)
LENGTHS = (5, 19, 37, 61)  # the four concurrent prompts, in tokens
QUESTION = [{"role": "user", "content": "Name three birds of prey."}]


@dataclass(frozen=True)
class Family:
    model_type: str
    build: object  # (folder, vocab_size) -> None: writes config.json and weights
    kv_bytes_fp32: int  # what inspect must report, counted from the family's config


def _transformers(config_cls, model_cls, settings: dict, tweak=None):
    def build(folder: Path, vocab: int) -> None:
        sized = {**settings, "vocab_size": vocab}
        if "vocab_size_per_layer_input" in settings:  # gemma4's per-layer inputs: same token ids
            sized["vocab_size_per_layer_input"] = vocab
        save_tiny(model_cls, config_cls(**sized), folder, tweak=tweak)

    return build


def _nemotron_nas(folder: Path, vocab: int) -> None:
    # DeciLM has no transformers class: the family test's mixed blocks (linear and no-op
    # attention/FFN, own KV grouping), with the embedding and head widened to the tokenizer
    config = {**nemotron_nas.nas_config(nemotron_nas.MIXED), "vocab_size": vocab}
    nemotron_nas.random_checkpoint(config, folder)
    weights = load_file(folder / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = torch.randn(vocab, nemotron_nas.HIDDEN) * 0.15
    save_file(weights, folder / "model.safetensors")


def _gemma4_kv_bytes() -> int:
    # KV sharing + per-layer inputs: only the first layers own caches (sliding 2x8, full 2x16)
    settings = {**gemma4.COMMON, **gemma4.VARIANTS["kv_shared_ple"]}
    owners = settings["layer_types"][
        : settings["num_hidden_layers"] - settings["num_kv_shared_layers"]
    ]
    return sum(2 * 2 * (16 if t == gemma4.F else 8) for t in owners) * 4


FAMILIES = {
    "gemma4": Family(
        "gemma4_text",
        _transformers(
            transformers.Gemma4TextConfig,
            gemma4.MODEL_CLS,
            {**gemma4.COMMON, **gemma4.VARIANTS["kv_shared_ple"]},
            gemma4._randomize_scalars,
        ),
        _gemma4_kv_bytes(),
    ),
    "exaone_moe": Family(
        "exaone_moe",
        _transformers(
            transformers.ExaoneMoeConfig,
            exaone_moe.MODEL_CLS,
            exaone_moe.CONFIG,
            exaone_moe._randomize_correction_bias,
        ),
        2 * 2 * 8 * 5 * 4,  # K and V x 2 KV heads x head_dim 8 x 5 layers x fp32
    ),
    "nemotron_nas": Family("nemotron-nas", _nemotron_nas, 2 * (4 + 1 + 2) * 8 * 4),
    "mistral4": Family(
        "mistral4",
        _transformers(
            transformers.Mistral4Config,
            mistral4.MODEL,
            # room for the chat template's system prompt (the family test uses 32 positions)
            {
                **mistral4.COMMON,
                **mistral4.VARIANTS["q_lora_interleaved"],
                "max_position_embeddings": 256,
            },
        ),
        (8 + 4) * 3 * 4,  # latent 8 + RoPE key 4, 3 layers, fp32
    ),
    "glm4_moe_lite": Family(
        "glm4_moe_lite",
        _transformers(
            transformers.Glm4MoeLiteConfig,
            glm4_moe_lite.MODEL,
            glm4_moe_lite.CONFIG,
            glm4_moe_lite.randomize_correction_bias,
        ),
        (8 + 4) * 3 * 4,
    ),
    "minicpm3": Family(
        "minicpm3",
        _transformers(transformers.MiniCPM3Config, minicpm3.MODEL, minicpm3.CONFIG),
        (8 + 4) * 3 * 4,
    ),
    "nemotron_h": Family(
        "nemotron_h",
        _transformers(
            transformers.NemotronHConfig,
            nemotron_h.MODEL_CLS,
            nemotron_h.CONFIG,
            nemotron_h.perturb,
        ),
        2 * 2 * (2 * 16) * 4,  # the two attention layers only: Mamba state is not per token
    ),
    "jamba": Family(
        "jamba",
        _transformers(transformers.JambaConfig, jamba.MODEL_CLS, jamba.CONFIG, jamba.perturb),
        2 * 2 * (2 * 16) * 4,
    ),
}


def kestrel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kestrel", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_tokenizer) -> dict[str, Path]:
    vocab = len(smollm2_tokenizer)
    folders = {}
    for name, family in FAMILIES.items():
        folder = folders[name] = tmp_path_factory.mktemp(name)
        family.build(folder, vocab)
        smollm2_tokenizer.save_pretrained(folder)  # carries the chat template
    return folders


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, checkpoints):
    args = ["-m", str(checkpoints[request.param]), "-a", ALIAS, "-c", "256"]
    # 8 slots: a step's budget (one chunk plus a token per slot) cannot fit every prompt's chunk,
    # so a KV-bounded request must wait for a whole chunk to be chunked alike alone and batched
    server = start_server([*args, "-np", "8", "--prefill-chunk-size", str(PREFILL_CHUNK)])
    yield request.param, server
    server.stop()


def test_arch_lists_every_family():
    listed = kestrel("arch").stdout.split()
    assert {f.model_type for f in FAMILIES.values()} <= set(listed)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_inspect_describes_the_checkpoint(checkpoints, name):
    result = kestrel("inspect", "-m", str(checkpoints[name]))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    config = json.loads((checkpoints[name] / "config.json").read_text())
    assert info["architecture"] == FAMILIES[name].model_type
    assert info["context_length"] == config["max_position_embeddings"]
    assert info["kv_bytes_per_token"]["float32"] == FAMILIES[name].kv_bytes_fp32
    assert info["kv_bytes_per_token"]["bfloat16"] == FAMILIES[name].kv_bytes_fp32 // 2
    stored = sum(t.numel() for t in load_file(checkpoints[name] / "model.safetensors").values())
    assert info["parameters"] == stored


def test_chat_and_its_stream_through_the_openai_client(served):
    _, server = served
    client = server.client()
    kwargs = dict(
        model=ALIAS,
        messages=QUESTION,
        temperature=0,
        max_tokens=NEW_TOKENS,
        extra_body={"ignore_eos": True},
    )
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    usage = response.usage
    assert usage.prompt_tokens > 10 and usage.completion_tokens == NEW_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content
    )
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS


def _prompt(length: int, vocab: int = 49152) -> list[int]:
    # token ids spread over the vocabulary, fixing each prompt's length exactly
    return [(1000 + i * 7919) % vocab for i in range(length)]


def _complete(client, prompt: list[int], kv_bound: int | None, start=None) -> str:
    body = {"ignore_eos": True}
    if kv_bound is not None:
        body["max_kv_size"] = kv_bound
    if start is not None:
        start.wait()
    response = client.completions.create(
        model=ALIAS, prompt=prompt, temperature=0, max_tokens=NEW_TOKENS, extra_body=body
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == NEW_TOKENS
    return choice.text


def test_concurrent_greedy_requests_equal_each_alone(served):
    _, server = served
    client = server.client()
    prompts = [_prompt(n) for n in LENGTHS]
    # the longest prompt runs under a KV bound shorter than itself, batched with the others
    bounds = [None] * (len(LENGTHS) - 1) + [KV_BOUND]
    assert len(prompts[-1]) > KV_BOUND

    before = server.metrics()
    alone = [_complete(client, p, b) for p, b in zip(prompts, bounds, strict=True)]
    middle = server.metrics()
    start = threading.Barrier(len(prompts))
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(
            pool.map(lambda pb: _complete(client, *pb, start), zip(prompts, bounds, strict=True))
        )
    after = server.metrics()

    assert together == alone
    steps = "kestrel_engine_steps_total"
    # batched: the four shared engine steps (alone, each needs its own)
    assert after[steps] - middle[steps] < middle[steps] - before[steps]
    trimmed = "kestrel_kv_trimmed_tokens_total"
    assert middle[trimmed] > before[trimmed] and after[trimmed] > middle[trimmed]
