"""llama.cpp as a second oracle for kestrel's GGUF reading: the same file, the same token ids,
kestrel's logits against llama.cpp's (llama-cpp-python), and both against a third reading that
decides where they disagree: transformers on the file's weights as gguf-py dequantizes them.

Part `real`: the two embedded models (SmolLM2-135M-Instruct Q4_1, gemma-3-270m Q4_K_M). Per prompt,
log-probs over the whole vocabulary at every prompt position (teacher-forced, no sampling) and 32
greedy tokens from each engine: where they part and the top-2 margins that could flip.

Part `types`: a tiny random Llama (2 layers, hidden 256, SmolLM2's 49,152-token vocabulary) saved
by transformers, converted by llama.cpp's `convert_hf_to_gguf.py` (F32, F16, BF16, Q8_0) and the
F32 file requantized by `llama_model_quantize` into every type its quantizer makes (refusals are
recorded). Per file: kestrel vs llama.cpp, both vs transformers on the float checkpoint (the
quantization error itself, for scale), both vs the gguf-py oracle, llama.cpp vs that oracle with
llama.cpp's own activation rounding emulated (its CPU dot products quantize the activations to
Q8_0 / Q8_1 / Q8_K, or round them to F16 / BF16, by the weight's type), and every kestrel weight
against gguf-py's dequantization of the same tensor.

llama.cpp runs with an F32 KV cache and flash attention off (`--llama-kv f16` for its default
cache), `n_threads` = `--threads`. One JSON line per measurement, each naming the command,
machine, kestrel commit and library versions:

    LLAMA_CPP_CONVERT=PATH/TO/llama.cpp/convert_hf_to_gguf.py LLAMA_CPP_PYTHON=PATH/TO/python \\
        python benchmarks/llama_cpp_agreement.py --out benchmarks/results/llama-cpp-agreement.jsonl
    python benchmarks/llama_cpp_agreement.py --parts real          # no converter needed

(`LLAMA_CPP_CONVERT` / `--convert-script`: llama.cpp's converter, run from its own folder so it
finds llama.cpp's gguf-py beside it; `LLAMA_CPP_PYTHON` / `--convert-python`: an interpreter with
its requirements, default this one.)
"""

import argparse
import contextlib
import ctypes
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tests.reference and kestrel from this tree
from cpu_generate import cpu_name  # noqa: E402  (this folder: the script's own)
from gpu_gate import commit  # noqa: E402  (KESTREL_COMMIT, else git's)

REAL = {  # alias -> (prompt, chat-templated?)
    "smollm2": ("What is the capital of France?", True),
    "gemma3-270m": ("The history of the Roman Empire", False),
}
# what llama.cpp's quantizer is asked for, as LLAMA_FTYPE_MOSTLY_<name> (the _S / _L k-quant
# mixes hold the same tensor types as the _M ones; `--types` takes them too)
QUANTIZE = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K",
    "IQ4_XS", "IQ4_NL", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
    "IQ2_M", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4_MOE", "NVFP4", "Q1_0", "Q2_0",
]  # fmt: skip
CONVERT = ["f32", "f16", "bf16", "q8_0"]  # convert_hf_to_gguf.py --outtype
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1
# the activation format of llama.cpp's CPU dot product for each weight type (ggml-cpu.c's
# type_traits_cpu[type].vec_dot_type); a type not listed takes Q8_K
VEC_DOT = {
    "F32": "F32", "F16": "F16", "BF16": "BF16",
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "IQ4_NL": "Q8_0", "MXFP4": "Q8_0",
    "NVFP4": "Q8_0", "Q1_0": "Q8_0", "Q2_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1",
}  # fmt: skip


# --- the record ---------------------------------------------------------------------------------


def machine(threads: int) -> str:
    return f"{platform.platform()}, {cpu_name()}, {os.cpu_count()} CPUs, {threads} threads"


class Lines:
    """Prints each record as one JSON line (and appends it to `--out`), with the run's fields."""

    def __init__(self, args):
        import gguf
        import llama_cpp
        import transformers

        self.common = {
            "command": " ".join(["python", *sys.argv]),
            "machine": machine(args.threads),
            "kestrel_commit": commit() or "unknown",
            "llama_cpp_python": llama_cpp.__version__,
            "gguf": _version("gguf", gguf),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "llama_kv": args.llama_kv,
        }
        self.out = open(args.out, "w") if args.out else None  # noqa: SIM115 (closed at exit)

    def emit(self, record: dict) -> None:
        line = json.dumps({**record, **self.common})
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()


def _version(name: str, module) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return getattr(module, "__version__", "unknown")


# --- comparisons --------------------------------------------------------------------------------


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """(n, V) logits of two readings of the same ids: max |Δ logit|, max |Δ log-prob| over the whole
    vocabulary at the last position (the first generated token) and over all positions, the same
    over the tokens either side gives log-prob >= -10 (those sampling can reach), the mean KL, the
    top-1 agreement and the positions whose log-probs agree within 1e-4 everywhere."""
    V = min(a.shape[-1], b.shape[-1])
    a, b = a[:, :V].double(), b[:, :V].double()
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    d = (la - lb).abs()
    likely = (la >= -10) | (lb >= -10)
    kl = (la.exp() * (la - lb)).sum(-1)
    agree = la.argmax(-1) == lb.argmax(-1)
    return {
        "max_abs_dlogit": round((a - b).abs().max().item(), 6),
        "max_abs_dlogprob_first_generated": round(d[-1].max().item(), 6),
        "max_abs_dlogprob_all_positions": round(d.max().item(), 6),
        "max_abs_dlogprob_likely_tokens": round(d[likely].max().item(), 6),
        "mean_kl": float(f"{kl.mean().item():.3g}"),
        "top1_agree": f"{int(agree.sum())}/{len(agree)}",
        "positions_within_1e-4": f"{int((d.amax(-1) < 1e-4).sum())}/{len(d)}",
    }


def margin(logits: torch.Tensor) -> tuple[int, int, float]:
    """(top-1 id, top-2 id, their log-prob gap) of one row of logits."""
    top = torch.log_softmax(logits.double(), -1).topk(2)
    return int(top.indices[0]), int(top.indices[1]), (top.values[0] - top.values[1]).item()


# --- llama.cpp ----------------------------------------------------------------------------------


def llama(path: Path, n_ctx: int, args):
    from llama_cpp import Llama

    kv = GGML_TYPE_F32 if args.llama_kv == "f32" else GGML_TYPE_F16
    with quiet_stderr():
        return Llama(
            str(path),
            logits_all=True,
            n_ctx=n_ctx,
            n_batch=max(512, n_ctx),
            n_threads=args.threads,
            n_threads_batch=args.threads,
            flash_attn=False,
            type_k=kv,
            type_v=kv,
            verbose=False,
        )


def llama_logits(llm, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) float32 logits of every position, the whole prompt in one batch."""
    llm.reset()
    llm.eval(ids)
    return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(out[-1:])
    return out


@contextlib.contextmanager
def quiet_stderr(keep: list | None = None):
    """Silence (or, with `keep`, capture into it) what C code writes to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if keep is not None:
                tmp.seek(0)
                keep.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def llama_log(keep: list[str]):
    """Collect llama.cpp's log lines (the quantizer's reasons) into `keep`, then give logging back
    to llama-cpp-python's own callback."""
    import llama_cpp
    from llama_cpp import _logger

    @llama_cpp.llama_log_callback
    def collect(level, text, user_data):
        keep.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


# --- kestrel and the oracles --------------------------------------------------------------------


def kestrel_model(path: Path):
    from kestrel.weights.loader import load_model, resolve

    return load_model(resolve(str(path)), torch.float32, torch.device("cpu"), progress=False)


def kestrel_logits(model, ids: list[int]) -> torch.Tensor:
    from tests.reference import chunked_logits

    return chunked_logits(model, ids, len(ids)).float()


class Oracle:
    """transformers over a GGUF file's weights as gguf-py dequantizes them. With `emulate`, each
    linear layer's input is first rounded as llama.cpp's CPU dot product rounds it for that
    weight's GGUF type (`types`: GGUF tensor name -> type name; see VEC_DOT), for Q4_1 / Q5_1
    weights the dot product's other term is added (llama.cpp multiplies each block's min `m` by
    Q8_1's `s`, the block's sum stored as float16; `mins`: GGUF name -> (rows, blocks) `m`, rows
    in transformers' order), and a GELU is looked up as llama.cpp's CPU GELU does (`TableGelu`).
    """

    def __init__(self, model, types: dict[str, str], arch_name: str, n_blocks: int, mins=None):
        import gguf

        mins = mins or {}
        self.model = model.eval()
        arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
        names = gguf.get_tensor_name_map(arch, n_blocks)
        self.emulate, self.unmapped = False, []
        tied = types.get("output.weight", types.get("token_embd.weight"))
        for name, module in self.model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            key = names.get_name(name)
            qtype = types.get(f"{key}.weight") if key else None
            if name.endswith("lm_head") and qtype is None:
                qtype = tied
            if qtype is None:
                self.unmapped.append(name)
                continue
            act = VEC_DOT.get(qtype, "Q8_K")
            m = mins.get(f"{key}.weight") if key else None
            if act == "Q8_1" and m is None:
                self.unmapped.append(f"{name} (Q8_1 sum term)")
            module.register_forward_pre_hook(self._pre_hook(act))
            if m is not None:
                module.register_forward_hook(self._sum_term(torch.from_numpy(m)))
        for module in list(self.model.modules()):  # GELU MLPs (gemma3): llama.cpp's table
            act = getattr(module, "act_fn", None)
            if isinstance(act, torch.nn.Module) and "gelu" in type(act).__name__.lower():
                module.act_fn = TableGelu(act, self)

    @classmethod
    def from_gguf(cls, path: Path) -> "Oracle":
        """transformers' own GGUF loading (gguf-py's `dequantize` per tensor, its own Q/K
        unpermute); the tensor types from kestrel's header walker (gguf-py's reader walks the
        whole vocabulary, tens of seconds for these files), used only by `emulate`."""
        import transformers

        from kestrel.weights import gguf as kg

        with quiet_stderr():  # its progress bars
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            )
        header = kg.open_gguf(path)
        types = {t.name: t.tensor_type.name for t in header.tensors}
        arch = kg.architecture(header)
        mins = {t.name: block_mins(t.tensor_type.name, t.data) for t in header.tensors}
        mins = {k: m for k, m in mins.items() if m is not None}
        if arch == "llama":
            mins = unpermuted(mins, model.config)
        elif mins:  # where llama.cpp's converter permutes rows is known here for llama only
            mins = {}
        n_blocks = int(header.fields[f"{arch}.block_count"].contents())
        return cls(model, types, arch, n_blocks, mins)

    @classmethod
    def tiny_llama(cls, folder: Path, types: dict, weights: dict, mins: dict) -> "Oracle":
        """The tiny float checkpoint's transformers Llama with every weight replaced by gguf-py's
        dequantization of the GGUF file's tensor (`gguf_py`'s `weights` and `mins`), Q/K
        unpermuted by transformers' own GGUF tensor processor."""
        import gguf
        import transformers

        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        c = model.config
        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
        rows = unpermuted(weights, c)
        state = {}
        for name in model.state_dict():
            key = table.get_name(name, try_suffixes=(".weight",))
            state[name] = torch.from_numpy(rows[key])
        model.load_state_dict(state, strict=True)
        return cls(model, types, "llama", c.num_hidden_layers, unpermuted(mins, c))

    def _pre_hook(self, act: str):
        def hook(module, inputs):
            if not self.emulate:
                return None
            x, module.q8_1_error = round_activations(inputs[0], act)
            return (x,)

        return hook

    def _sum_term(self, mins: torch.Tensor):
        """y += m . (s - d * sum(q)) per block: what Q8_1's float16 `s` adds to the product of
        the rounded activations."""

        def hook(module, inputs, output):
            if not self.emulate:
                return None
            return output + module.q8_1_error @ mins.T

        return hook

    def logits(self, ids: list[int], emulate: bool = False, attention="sdpa") -> torch.Tensor:
        """`attention` "eager" computes attention in other float order: with `emulate`, how far
        that alone moves the result is the noise floor of llama.cpp's rounding (an activation a
        hair from a rounding boundary lands on the other side)."""
        self.emulate = emulate
        self.model.set_attn_implementation(attention)
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float()


class TableGelu(torch.nn.Module):
    """A tanh-GELU that, while its oracle emulates llama.cpp, computes as ggml-cpu's (vec.h,
    GGML_GELU_FP16): the input rounded to float16, the float16 table value of the tanh GELU there;
    0 at or below -10, the input at or above 10."""

    def __init__(self, act: torch.nn.Module, oracle: Oracle):
        super().__init__()
        self.act, self.oracle = act, oracle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.oracle.emulate:
            return self.act(x)
        table = F.gelu(x.half().float(), approximate="tanh").half().to(x.dtype)
        return torch.where(x >= 10, x, torch.where(x <= -10, torch.zeros_like(x), table))


def gguf_py(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """GGUF tensor name -> type name, -> float32 array, and -> Q4_1 / Q5_1 block mins, read and
    dequantized by gguf-py alone (arrays in GGUF order reversed, rows as the file has them)."""
    import gguf

    reader = gguf.GGUFReader(path)
    types, arrays, mins = {}, {}, {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        types[t.name] = t.tensor_type.name
        arrays[t.name] = np.asarray(array, dtype=np.float32).reshape(shape)
        m = block_mins(t.tensor_type.name, t.data)
        if m is not None:
            mins[t.name] = m
    return types, arrays, mins


def unpermuted(arrays: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """Per-row arrays of llama GGUF tensors with attn_q / attn_k rows put back in transformers'
    order by transformers' own GGUF tensor processor (undoing llama.cpp's converter)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    heads = {"num_attention_heads": config.num_attention_heads}
    processor = LlamaTensorProcessor(heads | {"num_key_value_heads": config.num_key_value_heads})
    return {
        key: np.ascontiguousarray(processor.process(a, key).weights, dtype=np.float32)
        for key, a in arrays.items()
    }


def round_activations(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` as llama.cpp's CPU matmul sees it after converting it to `act` (ggml-quants.c's
    quantize_row_q8_0/q8_1/q8_K_ref; F16/BF16 a plain rounding), and for Q8_1 the per-block
    error of its float16 sum `s` against the rounded values' sum, (..., blocks); else None."""
    if act == "F32":
        return x, None
    if act == "F16":
        return x.half().to(x.dtype), None
    if act == "BF16":
        return x.bfloat16().to(x.dtype), None
    block = 256 if act == "Q8_K" else 32
    b = x.float().reshape(-1, block)
    if act == "Q8_K":  # float32 scale from the signed value of largest magnitude
        big = b.gather(-1, b.abs().argmax(-1, keepdim=True))
        iscale = torch.where(big != 0, -127.0 / big, torch.zeros_like(big))
        q = torch.round(b * iscale).clamp(max=127)
        out = torch.where(big != 0, q * (1 / iscale), torch.zeros_like(b))
        return out.reshape(x.shape).to(x.dtype), None
    # Q8_0 / Q8_1: scale absmax / 127 stored as float16; x * (127 / absmax) rounded to nearest
    # even (the x86 AVX path of quantize_row_q8_0 / q8_1, which this machine runs)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127
    q = torch.round(b * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    d16 = d.half().float()
    out = (q * d16).reshape(x.shape).to(x.dtype)
    if act != "Q8_1":
        return out, None
    total = q.sum(-1, keepdim=True)
    error = (d * total).half().float() - d16 * total
    return out, error.reshape(*x.shape[:-1], -1).to(x.dtype)


def block_mins(qtype: str, blocks: np.ndarray) -> np.ndarray | None:
    """(rows, blocks) float32 `m` of a Q4_1 / Q5_1 tensor's (rows, bytes) blocks (ggml-common.h:
    float16 d, float16 m, then the quants); None for other types."""
    size = {"Q4_1": 20, "Q5_1": 24}.get(qtype)
    if size is None:
        return None
    b = np.ascontiguousarray(blocks).reshape(blocks.shape[0], -1, size)
    return np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)


# --- part 1: the embedded models ----------------------------------------------------------------


def real_models(args, lines: Lines) -> None:
    from kestrel import LLM, SamplingParams
    from kestrel.tokenizer import apply_chat_template
    from kestrel.weights.loader import load_tokenizer, resolve

    for alias in args.models:
        prompt, chat = REAL[alias]
        source = resolve(alias)
        tokenizer = load_tokenizer(source)
        if chat:
            ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = list(tokenizer(prompt)["input_ids"])  # BOS as the tokenizer adds it
        n = args.greedy_tokens
        t0 = time.time()
        model = kestrel_model(source.path)
        k = kestrel_logits(model, ids)
        llm = llama(source.path, len(ids) + n + 8, args)
        lc = llama_logits(llm, ids)
        oracle = Oracle.from_gguf(source.path) if args.oracle else None
        base = {"part": "real", "model": alias, "file": source.path.name, "prompt": prompt}
        base.update(chat_template=chat, prompt_tokens=len(ids))
        record = {**base, "measurement": "logprobs", "kestrel_vs_llama_cpp": compare(k, lc)}
        if oracle is not None:
            o = oracle.logits(ids)
            record["kestrel_vs_oracle"] = compare(k, o)
            record["llama_cpp_vs_oracle"] = compare(lc, o)
            emulated = oracle.logits(ids, emulate=True)
            record["llama_cpp_vs_emulated_oracle"] = compare(lc, emulated)
            eager = oracle.logits(ids, emulate=True, attention="eager")
            record["emulated_oracle_sdpa_vs_eager"] = compare(emulated, eager)
            record["oracle_unmapped_linears"] = oracle.unmapped
        lines.emit(record)
        bound = record["kestrel_vs_llama_cpp"]["max_abs_dlogprob_all_positions"]
        if args.dequantized:  # the same weights in float32: what is left besides the rounding
            lines.emit(
                {**base, "measurement": "logprobs_dequantized_f32"}
                | dequantized(source.path, ids, args)
            )

        # greedy: kestrel's engine and llama.cpp's repeated eval/argmax on the same ids
        engine = LLM(str(source.path), progress=False, dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        ours = list(engine.generate(ids, params)[0].outputs[0].token_ids)
        engine.shutdown()
        del engine
        theirs = llama_greedy(llm, ids, n)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), n)
        # each side's logits along its own path: kestrel teacher-forced, llama.cpp as it ran
        k_own = kestrel_logits(model, ids + ours)[len(ids) - 1 :]
        l_own = torch.from_numpy(np.array(llm.scores[len(ids) - 1 : len(ids) + n - 1]))
        k_theirs = kestrel_logits(model, ids + theirs)[len(ids) - 1 :]
        low = []
        for step in range(n):
            for side, rows in (("kestrel", k_own), ("llama_cpp", l_own)):
                top1, top2, gap = margin(rows[step])
                if gap < bound:
                    low.append({"step": step, "path": side, "top2": [top1, top2], "margin": gap})
        record = {**base, "measurement": "greedy", "tokens": n, "bound": bound}
        record.update(
            agree_tokens=same,
            kestrel_tokens=ours,
            llama_cpp_tokens=theirs,
            kestrel_engine_matches_its_argmax=[margin(r)[0] for r in k_own[:n]] == ours,
            low_margin_steps=[{**s, "margin": round(s["margin"], 6)} for s in low],
        )
        if same < n:  # the parting step: each side's margin between the two choices
            lp_k = torch.log_softmax(k_theirs[same].double(), -1)
            lp_l = torch.log_softmax(l_own[same].double(), -1)
            a, b = ours[same], theirs[same]
            parting = {
                "step": same,
                "kestrel_token": a,
                "llama_cpp_token": b,
                "kestrel_logprob_gap": round((lp_k[a] - lp_k[b]).item(), 6),
                "llama_cpp_logprob_gap": round((lp_l[a] - lp_l[b]).item(), 6),
            }
            if oracle is not None:
                o = oracle.logits(ids + theirs[:same] + [b])[len(ids) + same - 1]
                lp_o = torch.log_softmax(o.double(), -1)
                parting["oracle_logprob_gap"] = round((lp_o[a] - lp_o[b]).item(), 6)
                parting["oracle_token"] = int(lp_o.argmax())
            record["parting"] = parting
        record["seconds"] = round(time.time() - t0, 1)
        lines.emit(record)
        llm.close()
        del model, llm, oracle


def dequantized(path: Path, ids: list[int], args) -> dict:
    """kestrel vs llama.cpp on the file requantized to all-F32 by llama.cpp's quantizer (each
    weight exactly its quantized value, in float32): llama.cpp's dot products then round nothing,
    so any gap left is in the rest of the forward pass (norms, RoPE, attention, activations);
    against the oracle too, which with `emulate` rounds nothing here but a GELU's input."""
    work = Path(tempfile.mkdtemp(prefix="llama-cpp-agreement-", dir=args.work))
    out, why = quantize(path, "F32", work, args, allow_requantize=True)
    if out is None:
        return {"refused_by": "llama_model_quantize", "why": why}
    try:
        llm = llama(out, len(ids) + 8, args)
        lc = llama_logits(llm, ids)
        llm.close()
        k = kestrel_logits(kestrel_model(out), ids)
        record = {"kestrel_vs_llama_cpp": compare(k, lc), "file_bytes": out.stat().st_size}
        if args.oracle:
            oracle = Oracle.from_gguf(out)
            o = oracle.logits(ids)
            record["kestrel_vs_oracle"] = compare(k, o)
            record["llama_cpp_vs_oracle"] = compare(lc, o)
            record["llama_cpp_vs_emulated_oracle"] = compare(lc, oracle.logits(ids, emulate=True))
        return record
    finally:
        out.unlink()
        work.rmdir()


# --- part 2: every GGUF type on a tiny checkpoint -----------------------------------------------


def tiny_checkpoint(work: Path, tokenizer) -> Path:
    import transformers
    from tests.reference import save_tiny

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # logits spread over a few nats: top-1 means something
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return save_tiny(transformers.LlamaForCausalLM, config, work / "tiny-llama", tokenizer)


def convert(folder: Path, outtype: str, work: Path, args) -> tuple[Path | None, str]:
    out = work / f"tiny-{outtype.upper()}-convert.gguf"
    command = [args.convert_python, Path(args.convert_script).name, str(folder)]
    command += ["--outfile", str(out), "--outtype", outtype]
    run = subprocess.run(
        command, cwd=Path(args.convert_script).parent, capture_output=True, text=True
    )
    return (out if run.returncode == 0 else None), run.stderr[-600:]


def quantize(
    source: Path, name: str, work: Path, args, allow_requantize: bool = False
) -> tuple[Path | None, str]:
    """`source` through `llama_model_quantize` to type `name` (LLAMA_FTYPE_MOSTLY_<name>, or
    ALL_F32): the new file, or None and the quantizer's last error lines."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name}", None)
    ftype = llama_cpp.LLAMA_FTYPE_ALL_F32 if name == "F32" else ftype
    if ftype is None:
        return None, f"llama_cpp has no LLAMA_FTYPE_MOSTLY_{name}"
    out = work / f"{source.stem}-{name}-quantize.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, args.threads
    params.allow_requantize = allow_requantize
    log: list[str] = []
    with llama_log(log):
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(out).encode(), ctypes.byref(params)
        )
    ok = rc == 0 and out.exists()
    lines = [s for s in "".join(log).splitlines() if s.strip()]
    errors = [s for s in lines if "error" in s.lower() or "fail" in s.lower()]
    return (out if ok else None), "\n".join((errors or lines)[-4:])


def weight_check(model, path: Path, types: dict[str, str], arrays: dict) -> dict:
    """Max |kestrel's weight - gguf-py's dequantization| per GGUF type, over every tensor kestrel
    loads: packed layers through their own decoding (`weight_rows`, the native kernel on the CPU;
    `kernels.quant.dequantize`, the torch path), the rest as the dense parameter. gguf-py's values
    (`arrays`, from `gguf_py`) pass through the family's `gguf_tensor` (llama's Q/K unpermute)
    first, as kestrel's do. The name mapping comes from the model built anew (packed layers no
    longer have a `weight` parameter to map)."""
    from kestrel.kernels import quant as kq
    from kestrel.kernels.formats import GGUFFormat
    from kestrel.models.layers.quant import Quantized
    from kestrel.weights import gguf as kg
    from kestrel.weights.loader import build_model

    empty = build_model(model.config, torch.float32, torch.device("cpu"), empty=True)
    out: dict[str, dict] = {}
    for name, record in kg.read_tensors(kg.open_gguf(path), empty.gguf_names):
        target = empty.checkpoint_name(name)
        slot_name = target if isinstance(target, str) else target.name
        qtype = types[record.name]
        ref = empty.gguf_tensor(slot_name, torch.from_numpy(arrays[record.name]))
        owner, _, attr = slot_name.rpartition(".")
        module = model.get_submodule(owner)
        row = out.setdefault(qtype, {"tensors": 0, "packed": 0, "max_abs_diff": 0.0})
        if isinstance(module, Quantized):
            got = module.weight_rows(slice(None))
            row["packed"] += 1
            if isinstance(module.fmt, GGUFFormat) and module.qtype in kq.BLOCKS:
                torch_path = kq.dequantize(module.qweight, module.qtype, module.cols)
                gap = (torch_path - ref).abs().max().item()
                row["torch_path_max_abs_diff"] = max(row.get("torch_path_max_abs_diff", 0.0), gap)
        else:
            got = getattr(module, attr)
            if not isinstance(target, str):
                got = target.of(got).transpose(-1, -2) if target.transpose else target.of(got)
        row["tensors"] += 1
        row["max_abs_diff"] = max(row["max_abs_diff"], (got.float() - ref).abs().max().item())
        row["max_abs_weight"] = max(row.get("max_abs_weight", 0.0), ref.abs().max().item())
    return out


def all_types(args, lines: Lines) -> None:
    import transformers
    from tests.reference import reference_logits

    from kestrel.tokenizer import apply_chat_template
    from kestrel.weights import gguf as kg
    from kestrel.weights.loader import load_tokenizer, resolve

    tokenizer = load_tokenizer(resolve("smollm2"))
    prompt = [{"role": "user", "content": REAL["smollm2"][0]}]
    ids = apply_chat_template(tokenizer, prompt)
    work = Path(args.work)
    folder = tiny_checkpoint(work, tokenizer)
    reference = reference_logits(folder, transformers.LlamaForCausalLM, ids)
    files: list[tuple[str, str, Path | None, str]] = []
    for outtype in CONVERT:
        path, why = convert(folder, outtype, work, args)
        files.append((outtype.upper(), "convert_hf_to_gguf", path, why))
    f32 = files[0][2]
    if f32 is None:
        raise SystemExit(f"convert_hf_to_gguf.py --outtype f32 failed: {files[0][3]}")
    for name in args.types:
        path, why = quantize(f32, name, work, args)
        files.append((name, "llama_model_quantize", path, why))
    spread = {
        "logits_std": round(reference.std().item(), 4),
        "top2_margin_min": round(min(margin(r)[2] for r in reference), 5),
    }
    lines.emit(
        {"part": "types", "measurement": "tiny_checkpoint", "prompt_tokens": len(ids)} | spread
    )
    for name, made_by, path, why in files:
        t0 = time.time()
        record = {"part": "types", "measurement": "type", "file_type": name, "made_by": made_by}
        if path is None:
            lines.emit({**record, "refused_by": made_by, "why": why})
            continue
        try:
            types, arrays, mins = gguf_py(path)
        except (NotImplementedError, ValueError) as e:  # a type gguf-py cannot read: no oracle
            record["gguf_py_error"] = f"{type(e).__name__}: {e}"
            types, arrays = {}, None
            with contextlib.suppress(Exception):  # kestrel's walker names the types it knows
                types = {t.name: t.tensor_type.name for t in kg.open_gguf(path).tensors}
        counts: dict[str, int] = {}
        for qtype in types.values():
            counts[qtype] = counts.get(qtype, 0) + 1
        record.update(tensor_types=counts, file_bytes=path.stat().st_size)
        try:
            llm = llama(path, len(ids) + 8, args)
            lc = llama_logits(llm, ids)
            llm.close()
        except Exception as e:  # noqa: BLE001 (recorded)
            lc, record["llama_cpp_error"] = None, f"{type(e).__name__}: {e}"
        try:
            model = kestrel_model(path)
            k = kestrel_logits(model, ids)
        except Exception as e:  # noqa: BLE001 (recorded)
            model = k = None
            record["kestrel_error"] = (
                f"{type(e).__name__}: {str(e).replace(str(work), 'WORK')[:300]}"
            )
        try:
            if arrays is None:
                raise ValueError("gguf-py cannot dequantize this file")
            oracle = Oracle.tiny_llama(folder, types, arrays, mins)
            o, oe = oracle.logits(ids), oracle.logits(ids, emulate=True)
            oe_eager = oracle.logits(ids, emulate=True, attention="eager")
        except Exception as e:  # noqa: BLE001 (recorded)
            oracle = o = oe = oe_eager = None
            record["oracle_error"] = (
                f"{type(e).__name__}: {str(e).replace(str(work), 'WORK')[:300]}"
            )
        pairs = {
            "kestrel_vs_llama_cpp": (k, lc),
            "kestrel_vs_transformers_f32": (k, reference),
            "llama_cpp_vs_transformers_f32": (lc, reference),
            "kestrel_vs_oracle": (k, o),
            "llama_cpp_vs_oracle": (lc, o),
            "llama_cpp_vs_emulated_oracle": (lc, oe),
            "emulated_oracle_sdpa_vs_eager": (oe, oe_eager),
            "oracle_vs_transformers_f32": (o, reference),
        }
        for key, (a, b) in pairs.items():
            if a is not None and b is not None:
                record[key] = compare(a, b)
        if model is not None and arrays is not None:
            record["weights_vs_gguf_py"] = weight_check(model, path, types, arrays)
        if oracle is not None and oracle.unmapped:
            record["oracle_unmapped_linears"] = oracle.unmapped
        record["seconds"] = round(time.time() - t0, 1)
        lines.emit(record)
        del model, oracle, arrays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["real", "types"], choices=["real", "types"])
    parser.add_argument("--models", nargs="+", default=list(REAL), choices=list(REAL))
    parser.add_argument("--types", nargs="+", default=QUANTIZE, help="quantizer ftypes to try")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--llama-kv", choices=["f32", "f16"], default="f32")
    parser.add_argument(
        "--no-oracle", dest="oracle", action="store_false", help="part real: skip transformers"
    )
    parser.add_argument("--convert-script", default=os.environ.get("LLAMA_CPP_CONVERT"))
    parser.add_argument(
        "--convert-python", default=os.environ.get("LLAMA_CPP_PYTHON", sys.executable)
    )
    parser.add_argument(
        "--no-dequantized",
        dest="dequantized",
        action="store_false",
        help="part real: skip the all-F32 requantized file",
    )
    parser.add_argument("--work", help="folder for the tiny checkpoint and its GGUF files")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args()
    if "types" in args.parts and not args.convert_script:
        parser.error("part types needs --convert-script (or LLAMA_CPP_CONVERT)")
    args.work = args.work or tempfile.mkdtemp(prefix="llama-cpp-agreement-")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lines = Lines(args)
    t0 = time.time()
    if "real" in args.parts:
        real_models(args, lines)
    if "types" in args.parts:
        all_types(args, lines)
    lines.emit({"measurement": "wall", "seconds": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
