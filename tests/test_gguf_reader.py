"""Our GGUF header walker (`weights.gguf.GGUFFile`) reads what gguf-py's `GGUFReader` reads: the
same tensor records and bytes, the same metadata, on the embedded models and on small written
files of every value type; a file cut anywhere in its header is a ModelLoadError naming it."""

import gguf
import numpy as np
import pytest
from tests.gguf_writer import random_blocks

from kestrel.errors import ModelLoadError
from kestrel.weights.embedded import embedded_path
from kestrel.weights.gguf import _SKIPPED_KEYS, open_gguf

T = gguf.GGMLQuantizationType


def assert_same_as_gguf_py(path) -> None:
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape) == (b.tensor_type, tuple(int(d) for d in b.shape))
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset)
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert a.data.tobytes() == b.data.tobytes(), a.name
    assert set(ours.fields) == set(theirs.fields)
    for key, field in theirs.fields.items():
        if key not in _SKIPPED_KEYS:
            assert ours.fields[key].contents() == field.contents(), key


@pytest.mark.parametrize("alias", ["smollm2", "gemma3-270m"])
def test_embedded_models_read_as_gguf_py_reads_them(alias):
    assert_same_as_gguf_py(embedded_path(alias))


def test_vocabulary_is_read_when_asked_for():
    path = embedded_path("smollm2")
    tokens = open_gguf(path).fields["tokenizer.ggml.tokens"].contents()
    assert tokens == gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].contents()


def write_every_kind(path, endianess=gguf.GGUFEndian.LITTLE):
    """Each metadata value type, an alignment of 256 and tensors of odd sizes, so that a wrong
    skip or padding moves every offset after it."""
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_custom_alignment(256)
    writer.add_block_count(2)
    for i, vtype in enumerate(["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64"]):
        getattr(writer, f"add_{vtype}")(f"test.{vtype}", 7 + i)
    writer.add_int64("test.int64", -(2**40))
    writer.add_float32("test.float32", 0.1)
    writer.add_float64("test.float64", -2.5e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "naïve café")
    writer.add_array("test.ints", [3, 1, 4, 1, 5])
    writer.add_array("test.floats", [0.5, 1.25])
    writer.add_array("test.strings", ["a", "", "ccc"])
    writer.add_token_list(["<s>", "</s>", "héllo"])
    rng = np.random.default_rng(0)
    writer.add_tensor("a", rng.standard_normal((3, 5), dtype=np.float32))
    writer.add_tensor("bb", rng.standard_normal(7).astype(np.float16))
    writer.add_tensor("ccc", random_blocks((2, 256), T.Q4_K, rng), raw_dtype=T.Q4_K)
    writer.add_tensor("dddd", np.arange(9, dtype=np.int32).reshape(1, 3, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG], ids=str)
def test_written_file_reads_as_gguf_py_reads_it(endianess, tmp_path):
    path = write_every_kind(tmp_path / "model.gguf", endianess)
    assert_same_as_gguf_py(path)
    reader = open_gguf(path)
    assert reader.fields["test.strings"].contents() == ["a", "", "ccc"]
    assert reader.tensors[-1].data_offset % 256 == 0
    assert reader.tensors[0].data.tolist() == gguf.GGUFReader(path).tensors[0].data.tolist()


def test_file_cut_in_its_header_names_the_file(tmp_path):
    path = write_every_kind(tmp_path / "model.gguf")
    data = path.read_bytes()
    header_end = open_gguf(path).tensors[0].data_offset
    for size in range(header_end):
        path.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=f"{path}: truncated or corrupt"):
            open_gguf(path)
