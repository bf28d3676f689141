"""llama.cpp in a process of its own, for cpu_generate.py: one GGUF file loaded through
llama-cpp-python's `Llama`, then greedy requests of token ids, each answered with its timings.

It runs under the python of the llama.cpp build being measured (benchmarks/.venv: built without
AMX; benchmarks/.venv-default: the default build), so one benchmark measures both builds beside
kestrel, and a build that crashes on a file takes down only its own process. It needs only
llama-cpp-python and the standard library.

One JSON object per line. First from the parent: {"model": PATH, "n_ctx": N, "n_batch": N,
"threads": N}; the answer: {"construct_s", "llama_cpp_python", "system_info"}. Then per request
{"prompt": [ids], "new_tokens": N}; the answer: {"first_token_s", "decode_s", "prefill_steps"}.
A Python error is answered {"error": "..."}; end of input ends the worker.
"""

import json
import math
import os
import sys
import time


def load(spec: dict):
    """llama-cpp-python's Llama on the file; n_batch sets prefill's batches."""
    from llama_cpp import Llama

    return Llama(
        model_path=spec["model"],
        n_ctx=spec["n_ctx"],
        n_batch=spec["n_batch"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        verbose=False,
    )


def describe(construct_s: float) -> dict:
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return {"construct_s": construct_s, "llama_cpp_python": llama_cpp.__version__} | {
        "system_info": info
    }


def run(llm, prompt: list[int], new_tokens: int, n_batch: int) -> dict:
    """`reset()` forgets the previous prompt so none of its KV is reused; `generate()` then
    evaluates the prompt in batches of n_batch and each token after it, greedy (temperature 0, no
    repeat penalty), never stopping on EOS."""
    llm.reset()
    start = time.perf_counter()
    tokens = llm.generate(prompt, temp=0.0, repeat_penalty=1.0)
    next(tokens)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        next(tokens)
    end = time.perf_counter()
    tokens.close()
    steps = math.ceil(len(prompt) / n_batch)
    return {"first_token_s": first - start, "decode_s": end - first, "prefill_steps": steps}


def serve(requests, answer) -> None:
    spec = json.loads(next(requests))
    start = time.perf_counter()
    llm = load(spec)
    answer(describe(time.perf_counter() - start))
    for line in requests:
        request = json.loads(line)
        try:
            answer(run(llm, request["prompt"], request["new_tokens"], spec["n_batch"]))
        except Exception as error:  # the parent records it; a crash it sees as the pipe closing
            answer({"error": f"{type(error).__name__}: {error}"})


def main() -> None:
    # the answers get stdout's descriptor to themselves: whatever llama.cpp's C code prints goes
    # to stderr instead of into the protocol
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def answer(record: dict) -> None:
        channel.write(json.dumps(record) + "\n")
        channel.flush()

    serve(sys.stdin, answer)


if __name__ == "__main__":
    main()
