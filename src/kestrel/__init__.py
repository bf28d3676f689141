"""kestrel: an LLM inference runtime and OpenAI-compatible server on PyTorch."""

from kestrel.llm import LLM, CompletionOutput, GenerationResult
from kestrel.sampling import SamplingParams

__all__ = ["LLM", "CompletionOutput", "GenerationResult", "SamplingParams"]
__version__ = "0.1.0"
