"""The command line: listing, inspecting, generating, and errors that name the problem."""

import json
import subprocess
import sys

from kestrel.weights.loader import resolve


def kestrel(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "kestrel", *args], capture_output=True, text=True, timeout=timeout
    )


def test_arch_lists_families():
    out = kestrel("arch").stdout.split()
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma3_text"} <= set(out)


def test_inspect_describes_gemma3():
    info = json.loads(kestrel("inspect", "-m", "gemma3-270m").stdout)
    assert info["architecture"] == "gemma3_text" and info["context_length"] == 32768
    assert 250e6 < info["parameters"] < 300e6
    # 18 layers x K and V x 1 KV head x 256 dims x 4 bytes
    assert info["kv_bytes_per_token"]["float32"] == 18 * 2 * 256 * 4


def test_inspect_counts_tensor_types_and_resident_bytes():
    # SmolLM2's Q4_1 file: 210 Q4_1 matrices, a Q8_0 embedding (the tied head reads it), F32 norms;
    # the CPU keeps the file's blocks where its native kernels build (weights/loader.py
    # keep_packed): about the file's bytes; it fits a GPU dequantized, so CUDA holds bfloat16
    info = json.loads(kestrel("inspect", "smollm2").stdout)  # the model as run takes it
    assert info["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    resident = info["resident_bytes"]
    file_bytes = resolve("smollm2").path.stat().st_size
    assert 0.9 * file_bytes < resident["cpu"] <= file_bytes < info["parameters"]
    assert resident["cuda"] == 2 * info["parameters"]


def test_generate_streams_greedy_text():
    result = kestrel(
        "generate", "-m", "smollm2", "-p", "The capital of France is", "-n", "4", "--temp", "0"
    )
    assert result.returncode == 0 and "Paris" in result.stdout


def test_run_one_shot_chat():
    result = kestrel("run", "smollm2", "-p", "What is the capital of France?", "--temp", "0")
    assert result.stdout.strip() == "The capital of France is Paris."


def test_missing_model_is_a_clear_error():
    result = kestrel("generate", "-m", "/no/such.gguf", "-p", "hi")
    assert result.returncode == 1 and "'/no/such.gguf' not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_sampling_flag_names_it():
    result = kestrel("generate", "-p", "hi", "--top-p", "2")
    assert result.returncode == 1 and "top_p" in result.stderr
