"""Single-stream decode speed with and without speculative decoding (n-gram, a draft model), on
an input-grounded task: "rewrite this code with one change" over a ~500-token Python file, greedy,
on the embedded real models. Both runs load the same weights in the same process, one after the other, so the
ratio holds on a noisy machine; the greedy tokens of the two runs must be equal (lossless).

One JSON line per run and one with the speed-up, per model, on stdout; `--out` appends them.

    python benchmarks/speculative.py --out benchmarks/results/cpu-speculative-ngram.jsonl
    python benchmarks/speculative.py --device cuda --out benchmarks/results/h200-speculative.jsonl
    python benchmarks/speculative.py --methods ngram draft  # each model also drafting for itself
"""

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

from kestrel import LLM, SamplingParams

# ~500 tokens of code the answer copies almost whole
SOURCE = '''
import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1
    tags: list[str] = field(default_factory=list)


@dataclass
class Order:
    customer: str
    items: list[Item] = field(default_factory=list)
    discount: float = 0.0

    def add(self, item: Item) -> None:
        """Add an item to the order, merging it with one of the same name."""
        for existing in self.items:
            if existing.name == item.name:
                existing.quantity += item.quantity
                return
        self.items.append(item)

    def remove(self, name: str) -> bool:
        """Remove the item with this name; whether there was one."""
        for index, existing in enumerate(self.items):
            if existing.name == name:
                del self.items[index]
                return True
        return False

    def subtotal(self) -> float:
        total = 0.0
        for item in self.items:
            total += item.price * item.quantity
        return total

    def total(self) -> float:
        subtotal = self.subtotal()
        return round(subtotal * (1.0 - self.discount), 2)

    def tagged(self, tag: str) -> list[Item]:
        return [item for item in self.items if tag in item.tags]

    def to_json(self) -> str:
        return json.dumps(
            {
                "customer": self.customer,
                "discount": self.discount,
                "items": [
                    {"name": i.name, "price": i.price, "quantity": i.quantity, "tags": i.tags}
                    for i in self.items
                ],
            }
        )


def load_order(text: str) -> Order:
    data = json.loads(text)
    order = Order(data["customer"], discount=data.get("discount", 0.0))
    for entry in data["items"]:
        order.add(Item(entry["name"], entry["price"], entry["quantity"], entry.get("tags", [])))
    return order
'''
TASK = "Rewrite this Python code with one change: rename the class `Order` to `Basket`."


def prompt_ids(llm: LLM) -> list[int]:
    """The task as a chat turn where the model has a chat template, else as plain text."""
    tokenizer = llm.tokenizer
    if getattr(tokenizer, "chat_template", None):
        message = f"{TASK} Answer with the whole code only.\n\n```python{SOURCE}```"
        return llm._chat_prompt([{"role": "user", "content": message}])
    return tokenizer.encode(f"# {TASK}\n# Original:\n{SOURCE}\n# Rewritten:\n")


def decode_speed(llm: LLM, ids: list[int], tokens: int) -> dict:
    """Greedy decode of `tokens` after the prompt: tok/s after the first token, and the ids."""
    engine = llm.engine
    engine.add_request("bench", ids, SamplingParams(temperature=0, max_tokens=tokens))
    out, first, drafted, accepted = [], None, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for step in engine.step():
            out += step.new_token_ids
            drafted, accepted = step.num_draft_tokens, step.num_accepted_tokens
        if first is None and out:
            first = time.perf_counter()  # the prompt is in (one chunk) and a token drawn
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    decode = time.perf_counter() - first
    rate = accepted / drafted if drafted else None
    return {
        "prompt_tokens": len(ids),
        "generated_tokens": len(out),
        "ttft_s": first - start,
        "decode_tok_s": (len(out) - 1) / decode,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": rate,
        "ids": out,
    }


def environment(device: str) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "command": " ".join(["python", *sys.argv]),
        "machine": platform.processor() or platform.machine(),
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "commit": commit.stdout.strip() or None,
        "torch": torch.__version__,
    }


def bench_model(args, model: str, env: dict, out) -> None:
    settings = dict(device=args.device, dtype=args.dtype, prefill_chunk_size=1024, max_num_seqs=1)
    methods = {
        "plain": {},
        "ngram": {"speculative": "ngram"},
        # a draft model: --draft-model, else the model itself (every proposal is accepted:
        # the upper bound of a draft, at the draft's full cost)
        "draft": {"speculative": "draft", "draft_model": args.draft_model or model},
    }
    runs = {}
    for label in ["plain", *args.methods]:
        spec = {**methods[label], "num_speculative_tokens": args.k} if label != "plain" else {}
        llm = LLM(model, progress=False, **settings, **spec)
        ids = prompt_ids(llm)
        decode_speed(llm, ids, 4)  # warm-up (kernels, graphs)
        runs[label] = decode_speed(llm, ids, args.tokens)
        record = {"model": model, "speculative": label, "k": args.k if spec else 0, **env}
        if label == "draft":
            record["draft_model"] = spec["draft_model"]
        emit({**record, **{k: v for k, v in runs[label].items() if k != "ids"}}, out)
        del llm
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for label in args.methods:
        same = runs["plain"]["ids"] == runs[label]["ids"]
        speedup = runs[label]["decode_tok_s"] / runs["plain"]["decode_tok_s"]
        record = {"model": model, "speculative": label, "speedup": speedup, "same_tokens": same}
        emit({**record, **env}, out)


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per run")
    p.add_argument("-k", type=int, default=5, help="--num-speculative-tokens")
    p.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "draft"])
    p.add_argument("--draft-model", help="draft's model (default: each model drafts for itself)")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args()
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    args.device = device
    out = open(args.out, "a") if args.out else None
    for model in args.models:
        bench_model(args, model, environment(device), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
