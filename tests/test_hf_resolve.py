"""Hugging Face names: `org/repo` and `org/repo:QUANT` resolve from a Hugging Face cache folder laid
out as huggingface_hub lays it out (blobs, snapshots linking to them, refs/main), without the
network; a repo missing offline is a one-line error; a GGUF split as llama.cpp's gguf-split splits
it loads as the whole file does. No test reaches the network."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import huggingface_hub
import pytest
import torch
import transformers
from huggingface_hub.errors import RepositoryNotFoundError
from tests.reference import chunked_logits, save_tiny

from kestrel.errors import ModelLoadError
from kestrel.weights import hub
from kestrel.weights.loader import load_model, load_tokenizer, resolve

CPU = torch.device("cpu")
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SMOLLM2 = "SmolLM2-135M-Instruct"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache with the network off. huggingface_hub reads its environment
    once, at import: its constants are set too."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for name, value in {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("KESTREL_CACHE_DIR", str(tmp_path / "kestrel"))
    return cache


def cache_repo(cache: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """Put `files` (path in the repo -> local file) in the cache as a download leaves them:
    content in blobs/<sha256>, snapshots/<commit>/<path> a relative link to its blob,
    refs/main the commit. The snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True)
    for name, source in files.items():
        blob = storage / "blobs" / sha256(source)
        shutil.copyfile(source, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def split_gguf(path: Path, out: Path, shards: int) -> list[Path]:
    """`path` cut into `shards` files as llama.cpp's gguf-split cuts it: shard 1 holds all the
    metadata, every shard split.no (from 0, u16), split.count (u16), split.tensors.count (i32)
    and its run of the tensors in file order; named <prefix>-0000i-of-0000N.gguf."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tensors = reader.tensors
    per = -(-len(tensors) // shards)
    paths = []
    for no in range(shards):
        name = out.with_name(f"{out.name}-{no + 1:05d}-of-{shards:05d}.gguf")
        writer = gguf.GGUFWriter(str(name), arch)
        if no == 0:
            copy_metadata(reader, writer)
        else:  # gguf-split writes the split keys alone into the other shards
            writer.kv_data[0].clear()
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_NO, no)
        writer.add_uint16(gguf.Keys.Split.LLM_KV_SPLIT_COUNT, shards)
        writer.add_int32(gguf.Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT, len(tensors))
        for t in tensors[no * per : (no + 1) * per]:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(name)
    return paths


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own, and the one GGUFWriter writes
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)


@pytest.fixture(scope="module")
def smollm2_split(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("split") / f"{SMOLLM2}-Q4_1"
    return split_gguf(resolve("smollm2").path, out, 3)


def logits(source, ids=(1, 504, 3458, 7160, 20594, 10838)) -> torch.Tensor:
    model = load_model(source, torch.float32, CPU, progress=False)
    return chunked_logits(model, list(ids), chunk=8)


@pytest.fixture(scope="module")
def smollm2_logits() -> torch.Tensor:
    return logits(resolve("smollm2"))


# the rule: which files a repo's listing gives


def test_tag_picks_the_gguf_whose_name_contains_it_in_any_case():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "m-Q8_0.gguf"]
    assert hub.choose_files("o/r", files, "q8_0") == ["m-Q8_0.gguf"]
    assert hub.choose_files("o/r", files, "Q4_K_S") == ["m-Q4_K_S.gguf"]
    assert hub.choose_files("o/r", files, "Q4_XS") == ["m-IQ4_XS.gguf"]  # contained is enough
    with pytest.raises(ModelLoadError, match=r"no GGUF file matching 'Q5_K_M'; it has: .*m-Q8_0"):
        hub.choose_files("o/r", files, "Q5_K_M")


def test_a_tag_standing_alone_wins_over_a_longer_quant():
    files = ["m-Q8_0_L.gguf", "m-Q8_0.gguf", "m-UD-Q4_K_XL.gguf", "m-Q4_K_XL-extra.gguf"]
    assert hub.choose_files("o/r", files, "Q8_0") == ["m-Q8_0.gguf"]
    assert hub.choose_files("o/r", files, "UD-Q4_K_XL") == ["m-UD-Q4_K_XL.gguf"]


def test_no_tag_prefers_q4_k_m_then_the_first_gguf_never_an_mmproj():
    files = ["mmproj-F16.gguf", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-F16.gguf"]
    assert hub.choose_files("o/r", files, None) == ["m-Q4_K_M.gguf"]
    assert hub.choose_files("o/r", ["mmproj-F16.gguf", "m-Q8_0.gguf", "m-F16.gguf"], None) == [
        "m-F16.gguf"
    ]


def test_a_split_quant_is_all_its_shards():
    files = [f"Q4_K_M/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (2, 1, 3)] + ["Q8_0/m-Q8_0.gguf"]
    expected = [f"Q4_K_M/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert hub.choose_files("o/r", files, "q4_k_m") == expected
    assert hub.choose_files("o/r", files, None) == expected


def test_a_safetensors_repo_fetches_config_tokenizer_and_weights_only():
    files = [
        *("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"),
        *("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
        *("model.safetensors.index.json", "consolidated.safetensors", "tokenizer.model"),
        *("pytorch_model.bin", "model.pt", "onnx/model.onnx", "original/params.json"),
        *("README.md", "chat_template.jinja", "m-Q4_K_M.gguf"),
    ]
    assert hub.choose_files("o/r", files, None) == [
        *("config.json", "chat_template.jinja", "generation_config.json"),
        *("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
        *("model.safetensors.index.json", "tokenizer.json", "tokenizer.model"),
        "tokenizer_config.json",
    ]
    assert hub.choose_files("o/r", files, "Q4_K_M") == ["m-Q4_K_M.gguf"]  # a tag: the GGUF


def test_what_reads_as_a_repo_name():
    assert hub.parse("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        None,
    )
    assert hub.parse("unsloth/Qwen3-8B-GGUF:UD-Q4_K_XL") == ("unsloth/Qwen3-8B-GGUF", "UD-Q4_K_XL")
    for path_like in ("models/x.gguf", "/abs/org/repo", "./org/repo", "a/b/c", "smollm2", "o--x/r"):
        assert hub.parse(path_like) is None, path_like


# the cache, offline


def test_gguf_repo_resolves_offline_from_the_cache(hf_cache, tmp_path, smollm2_logits):
    decoy = tmp_path / "mmproj.gguf"
    decoy.write_bytes(b"GGUF not a model")
    smollm2 = resolve("smollm2").path
    snapshot = cache_repo(
        hf_cache,
        "org/SmolLM2-GGUF",
        {f"{SMOLLM2}-Q4_1.gguf": smollm2, "mmproj-SmolLM2-F16.gguf": decoy, "README.md": decoy},
    )
    for name in ("org/SmolLM2-GGUF", "org/SmolLM2-GGUF:Q4_1", "org/SmolLM2-GGUF:q4_1"):
        source = resolve(name)
        assert source.path == snapshot / f"{SMOLLM2}-Q4_1.gguf" and source.is_gguf, name
        assert source.name == name
    assert torch.equal(logits(resolve("org/SmolLM2-GGUF:Q4_1")), smollm2_logits)
    with pytest.raises(ModelLoadError, match="no GGUF file matching 'Q8_0'"):
        resolve("org/SmolLM2-GGUF:Q8_0")


def test_safetensors_repo_resolves_offline_from_the_cache(hf_cache, tmp_path, smollm2_tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=smollm2_tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    folder = save_tiny(
        transformers.LlamaForCausalLM, config, tmp_path / "tiny", tokenizer=smollm2_tokenizer
    )
    snapshot = cache_repo(
        hf_cache, "org/tiny-llama", {f.name: f for f in folder.iterdir() if f.is_file()}
    )
    source = resolve("org/tiny-llama")
    assert source.path == snapshot and not source.is_gguf
    assert torch.equal(logits(source), logits(resolve(str(folder))))
    assert load_tokenizer(source)("hello")["input_ids"] == smollm2_tokenizer("hello")["input_ids"]


def test_missing_repo_offline_names_it_and_the_cache(hf_cache):
    with pytest.raises(ModelLoadError) as e:
        resolve("org/missing")
    message = str(e.value)
    assert "'org/missing' is not in the local Hugging Face cache" in message
    assert str(hf_cache) in message and "HF_HUB_OFFLINE=1" in message and "\n" not in message


def test_unreachable_hub_falls_back_to_the_cache_in_one_line(hf_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):  # what the Hub client raises without a network
        raise hub._HTTP_ERROR("[Errno 101] Network is unreachable\nrequest details")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    with pytest.raises(ModelLoadError) as e:
        resolve("org/missing")
    assert "the Hub cannot be reached" in str(e.value) and "\n" not in str(e.value)
    snapshot = cache_repo(hf_cache, "org/cached-GGUF", {"m-Q4_1.gguf": resolve("smollm2").path})
    assert resolve("org/cached-GGUF").path == snapshot / "m-Q4_1.gguf"  # and no download tried


def test_online_lists_on_the_hub_and_downloads_only_the_chosen_files(hf_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    listing = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf"]
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision: listing)
    asked = {}

    def download(repo_id, **kwargs):  # snapshot_download, leaving what it was asked for
        asked.update(kwargs, repo_id=repo_id)
        folder = hf_cache / "snapshot"
        for name in kwargs["allow_patterns"]:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(b"GGUF")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert resolve("org/m-GGUF:Q8_0").path == hf_cache / "snapshot" / "m-Q8_0.gguf"
    assert asked == {
        "repo_id": "org/m-GGUF",
        "revision": None,
        "allow_patterns": ["m-Q8_0.gguf"],
        "local_files_only": False,
    }


def test_hub_refusals_are_one_line(hf_cache, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    response = SimpleNamespace(headers={}, status_code=404, request=None)
    error = RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found", response=response)

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "list_repo_files", refuse)
    with pytest.raises(ModelLoadError) as e:
        resolve("org/private")
    assert "'org/private' not found" in str(e.value) and "\n" not in str(e.value)


def test_cli_offline_missing_repo_is_one_line_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "kestrel", "generate", "-m", "org/missing", "-p", "hi", "-n", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "'org/missing'" in lines[0], result.stderr
    assert "not in the local Hugging Face cache" in lines[0]


# split GGUF checkpoints


def test_split_gguf_keeps_llama_cpp_layout(smollm2_split):
    first, second, _ = (gguf.GGUFReader(p) for p in smollm2_split)
    whole = gguf.GGUFReader(resolve("smollm2").path)
    assert "tokenizer.ggml.tokens" in first.fields and "tokenizer.ggml.tokens" not in second.fields
    assert second.fields["split.no"].contents() == 1 and first.fields["split.count"].contents() == 3
    assert len(first.tensors) + len(second.tensors) < len(whole.tensors)


def test_split_gguf_loads_as_the_whole_file(smollm2_split, smollm2_logits):
    source = resolve(str(smollm2_split[1]))  # any shard names the checkpoint
    assert source.path == smollm2_split[0]
    assert torch.equal(logits(source), smollm2_logits)


def test_split_gguf_in_a_repo_resolves_all_shards(
    hf_cache, smollm2_split, tmp_path, smollm2_logits
):
    decoy = tmp_path / "q8.gguf"
    decoy.write_bytes(b"GGUF not loaded")
    files = {f"Q4_1/{p.name}": p for p in smollm2_split} | {f"Q8_0/{SMOLLM2}-Q8_0.gguf": decoy}
    snapshot = cache_repo(hf_cache, "org/SmolLM2-split-GGUF", files)
    source = resolve("org/SmolLM2-split-GGUF:Q4_1")
    assert source.path == snapshot / "Q4_1" / smollm2_split[0].name
    assert torch.equal(logits(source), smollm2_logits)


def test_a_missing_shard_is_named(smollm2_split, tmp_path):
    for p in smollm2_split[:2]:
        (tmp_path / p.name).symlink_to(p)
    with pytest.raises(ModelLoadError, match=r"shard 3 of 3 is missing: .*-00003-of-00003.gguf"):
        load_model(resolve(str(tmp_path / smollm2_split[0].name)), torch.float32, CPU, False)
