"""kestrel: an LLM inference runtime and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "GenerationResult", "SamplingParams"]

_EXPORTS = {
    "LLM": "kestrel.llm",
    "CompletionOutput": "kestrel.llm",
    "GenerationResult": "kestrel.llm",
    "SamplingParams": "kestrel.sampling",
}


def __getattr__(name: str):
    # lazy, so torch-free parts (the scheduler) import without loading torch
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kestrel' has no attribute {name!r}")
