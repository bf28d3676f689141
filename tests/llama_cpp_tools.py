"""llama.cpp's own tools, as the outside world that writes the GGUF files users bring.

The converter (`convert_hf_to_gguf.py`, with its `conversion/` package and its own `gguf-py`)
ships inside llama-cpp-python's source distribution; `make setup` unpacks it into
`.venv/llama.cpp` (`LLAMA_CPP_DIR` overrides). It runs in a subprocess, exactly as a user runs it.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_DIR", ROOT / ".venv" / "llama.cpp"))
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"


def require_converter() -> Path:
    if not CONVERTER.exists():
        pytest.fail(f"llama.cpp's converter is not at {CONVERTER}: run `make setup`")
    return CONVERTER


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert a Hugging Face folder with llama.cpp's converter; the GGUF file's path."""
    command = [sys.executable, str(require_converter()), str(folder), "--outfile", str(out)]
    done = subprocess.run(
        [*command, "--outtype", outtype], capture_output=True, text=True, cwd=LLAMA_CPP
    )
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {folder}:\n{done.stderr[-3000:]}")
    return out
