"""Bad model arguments fail with a clear error that names the thing."""

import json

import gguf
import numpy as np
import pytest
import torch

from kestrel.errors import ModelLoadError, UnsupportedModelError
from kestrel.weights.loader import load, resolve

CPU = torch.device("cpu")


def test_missing_path_names_it():
    with pytest.raises(ModelLoadError, match="'/no/such/model.gguf' not found"):
        resolve("/no/such/model.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve(str(tmp_path))


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(
        UnsupportedModelError, match=r"unknown architecture 'gpt2'; supported: .*llama"
    ):
        load(str(tmp_path), torch.float32, CPU, progress=False)


def write_gguf(path, tensor_type=gguf.GGMLQuantizationType.F32):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    data = np.zeros((4, 32), dtype=np.float32)
    if tensor_type == gguf.GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", data)
    else:  # raw bytes declared with a type we cannot dequantize
        writer.add_tensor(
            "token_embd.weight", np.zeros((4, 8), dtype=np.uint8), raw_dtype=tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_truncated_gguf_is_reported(tmp_path):
    path = write_gguf(tmp_path / "model.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load(str(path), torch.float32, CPU, progress=False)


def test_garbage_file_is_reported(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load(str(path), torch.float32, CPU, progress=False)


def test_unsupported_quantization_type_is_named(tmp_path):
    from kestrel.weights.gguf import check_quant_types, open_gguf

    path = write_gguf(tmp_path / "model.gguf", gguf.GGMLQuantizationType.I8)
    with pytest.raises(
        UnsupportedModelError, match="token_embd.weight has unsupported quantization type I8"
    ):
        check_quant_types(open_gguf(path), path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        resolve(str(path))
