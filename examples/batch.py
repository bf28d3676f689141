"""The Python API, offline (no server): load a model once and generate for a batch of prompts,
which run together with continuous batching; then a batch of chats.

    python examples/batch.py            # KESTREL_MODEL: an alias, a .gguf file or an HF folder
"""

import os

from kestrel import LLM, SamplingParams

llm = LLM(os.environ.get("KESTREL_MODEL", "smollm2"), progress=False)
params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=32, seed=0)

prompts = ["Once upon a time", "The three primary colors are", "def fibonacci(n):"]
for prompt, result in zip(prompts, llm.generate(prompts, params), strict=True):
    print(f"{prompt!r} -> {result.outputs[0].text!r}")

chats = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Say hello in Spanish."}],
]
greedy = SamplingParams(temperature=0, max_tokens=32)
for chat, result in zip(chats, llm.chat(chats, greedy), strict=True):
    print(f"{chat[0]['content']!r} -> {result.outputs[0].text!r}")
llm.shutdown()
