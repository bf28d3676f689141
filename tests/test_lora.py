"""LoRA adapters written by `peft` itself on tiny random checkpoints: kestrel's logits with an
adapter equal transformers + peft's merged model (fp32, CPU) for three dense families and one MoE
family; a batch mixing three adapters and the base gives each request its tokens alone; bad
adapters are refused with the problem named, and the engine keeps serving."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tests.family_suite import one_thread  # noqa: F401  (tiny tensors: one thread is faster)
from tests.lora_checks import (
    FAMILIES,
    MLP,
    PROMPT,
    base_checkpoint,
    generate_all,
    kestrel_logits,
    oracle_logits,
    write_adapter,
)
from tests.reference import assert_close, assert_differ, load_kestrel
from tests.test_gguf_quantized import CONFIG as GGUF_CONFIG
from tests.test_gguf_quantized import load, tiny_llama_gguf

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequestError
from kestrel.kernels.lora import grouped_lora
from kestrel.lora.manager import LoRAManager
from kestrel.models.layers.quant import QuantLinear

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, base folder, model with 2 LoRA slots, {adapter: (folder, merged oracle)})."""
    name = request.param
    base = base_checkpoint(name, tmp_path_factory.mktemp(name))
    adapters = {}
    for i, rank in enumerate((8, 4)):  # a rank below --max-lora-rank is zero-padded
        folder = tmp_path_factory.mktemp(f"{name}-adapter{i}")
        adapters[f"a{i}"] = folder, write_adapter(base, folder, name, seed=i, rank=rank)
    model = load_kestrel(base)
    manager = LoRAManager(model, 2, 8, 64, CPU, torch.float32)
    for adapter, (folder, _) in adapters.items():
        manager.load(adapter, str(folder))
    return name, base, model, manager, adapters


def test_adapter_logits_equal_peft_merged_model(family):
    _, base, model, manager, adapters = family
    for adapter, (_, merged) in adapters.items():
        ours = kestrel_logits(model, manager, adapter, PROMPT)
        assert_close(ours, oracle_logits(merged, PROMPT))


def test_base_requests_are_untouched_by_loaded_adapters(family):
    name, base, model, manager, adapters = family
    _, merged = adapters["a0"]
    ours = kestrel_logits(model, manager, None, PROMPT)
    model_cls = FAMILIES[name][0]
    reference = model_cls.from_pretrained(base, dtype=torch.float32).eval()
    assert_close(ours, oracle_logits(reference, PROMPT))
    assert_differ(ours, oracle_logits(merged, PROMPT))


def test_more_adapters_than_slots_evict_the_least_recently_used(family, tmp_path):
    name, base, model, manager, adapters = family
    folder = tmp_path / "third"
    merged = write_adapter(base, folder, name, seed=7)
    manager.load("third", str(folder))
    try:  # two slots: "third" evicts whichever of a0/a1 ran least recently, and back again
        for adapter, oracle in [("third", merged), ("a0", adapters["a0"][1]), ("third", merged)]:
            assert_close(
                kestrel_logits(model, manager, adapter, PROMPT), oracle_logits(oracle, PROMPT)
            )
    finally:
        manager.unload("third")


def test_grouped_lora_adds_each_tokens_own_adapter():
    # slot 0 is the base model; tokens of slots 1 and 2 interleave
    torch.manual_seed(0)
    a, b = torch.randn(3, 2 * 4, 16), torch.randn(3, 10, 4)
    a[0], b[0] = 0, 0
    x, slots = torch.randn(5, 16), [1, 0, 2, 1, 2]
    y = torch.zeros(5, 10)
    groups = [(s, torch.tensor([i for i, t in enumerate(slots) if t == s])) for s in (1, 2)]
    grouped_lora(y, x, a, b, groups, [6, 4])
    for i, s in enumerate(slots):
        expect = torch.cat([(a[s, :4] @ x[i]) @ b[s, :6].T, (a[s, 4:] @ x[i]) @ b[s, 6:].T])
        torch.testing.assert_close(y[i], expect, rtol=1e-5, atol=1e-5)


# -- bad adapters ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base = base_checkpoint("llama", tmp_path_factory.mktemp("llama-base"))
    folder = tmp_path_factory.mktemp("llama-good")
    write_adapter(base, folder, "llama", seed=0)
    manager = LoRAManager(load_kestrel(base), 2, 8, 64, CPU, torch.float32)
    return base, folder, manager


def _refused(manager, path, *words, name="bad"):
    with pytest.raises(InvalidRequestError) as error:
        manager.load(name, str(path))
    for word in words:
        assert word in str(error.value), str(error.value)
    assert name not in manager.loaded()


def test_an_adapter_of_another_base_shape_is_refused(llama, tmp_path):
    _, _, manager = llama
    other = base_checkpoint("qwen3", tmp_path / "qwen3")
    write_adapter(other, tmp_path / "qwen3-adapter", "qwen3", seed=0)
    _refused(manager, tmp_path / "qwen3-adapter", "does not fit this base model")


def test_missing_files_are_refused(llama, tmp_path):
    base, good, manager = llama
    _refused(manager, tmp_path / "nowhere", "adapter_config.json")
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text(
        (good / "adapter_config.json").read_text()
    )
    _refused(manager, tmp_path / "config-only", "adapter_model.safetensors")


def test_a_rank_over_the_limit_is_refused(llama, tmp_path):
    base, _, manager = llama
    write_adapter(base, tmp_path / "rank16", "llama", seed=0, rank=16)
    _refused(manager, tmp_path / "rank16", "rank 16", "--max-lora-rank 8")


def test_unsupported_peft_options_are_refused(llama, tmp_path):
    base, _, manager = llama
    write_adapter(base, tmp_path / "dora", "llama", seed=0, use_dora=True)
    _refused(manager, tmp_path / "dora", "use_dora")


def test_moe_expert_adapters_are_refused_by_name(tmp_path):
    base = base_checkpoint("glm4_moe_lite", tmp_path / "glm")
    # kv_b_proj: MLA's per-head up-projection, which kestrel splits at load
    write_adapter(base, tmp_path / "kvb", "glm4_moe_lite", seed=0, target_modules=["kv_b_proj"])
    manager = LoRAManager(load_kestrel(base), 1, 8, 64, CPU, torch.float32)
    _refused(manager, tmp_path / "kvb", "kv_b_proj", "cannot adapt")
    # "gate_proj"/"up_proj"/"down_proj": peft adapts the routed experts' stacked weights too
    write_adapter(base, tmp_path / "experts", "glm4_moe_lite", seed=0, target_modules=MLP)
    _refused(manager, tmp_path / "experts", "routed MoE experts", "mlp.experts")


def test_a_bad_adapter_leaves_the_others_serving(llama, tmp_path):
    base, good, manager = llama
    manager.load("good", str(good))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="safetensors|header|deserializ"):
        manager.load("broken", str(broken))
    assert sorted(manager.loaded()) == ["good"]
    manager.unload("good")


# -- the engine: batches that mix adapters ----------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer):
    """LLM over a tiny llama (SmolLM2's tokenizer) with three adapters, and their oracles."""
    base = base_checkpoint(
        "llama", tmp_path_factory.mktemp("served"), smollm2_tokenizer, len(smollm2_tokenizer)
    )
    adapters, oracles = {}, {}
    for i in range(3):
        folder = tmp_path_factory.mktemp(f"served-a{i}")
        oracles[f"a{i}"] = write_adapter(base, folder, "llama", seed=10 + i)
        adapters[f"a{i}"] = str(folder)
    llm = LLM(
        str(base),
        progress=False,
        device="cpu",
        dtype="float32",
        lora_modules=adapters,
        max_lora_rank=8,
        max_loras=3,
        max_num_seqs=8,
    )
    return llm, oracles, base


def test_the_engines_first_token_log_probs_equal_the_merged_model(served):
    llm, oracles, _ = served
    prompt = PROMPT[:12]
    for name, merged in oracles.items():
        _, first = generate_all(llm.engine, {f"lp-{name}": (prompt, name)}, max_tokens=1)
        expected = torch.log_softmax(oracle_logits(merged, prompt)[-1], -1)
        for token, logprob in first[f"lp-{name}"].items():
            assert abs(logprob - expected[token].item()) < 1e-4


def test_a_batch_mixing_three_adapters_and_the_base_gives_each_its_tokens_alone(served):
    llm, _, _ = served
    prompts = {
        name: [(i * 7 + k) % 500 for i in range(9 + k)]
        for k, name in enumerate(["a0", "a1", "a2", None])
    }
    alone = {}
    for name, prompt in prompts.items():
        tokens, _ = generate_all(llm.engine, {f"alone-{name}": (prompt, name)})
        alone[name] = tokens[f"alone-{name}"]
    mixed, _ = generate_all(llm.engine, {f"mixed-{n}": (p, n) for n, p in prompts.items()})
    for name in prompts:
        assert mixed[f"mixed-{name}"] == alone[name], name
    assert len({tuple(t) for t in alone.values()}) == 4  # the adapters change the output


def test_prefix_cache_hits_never_cross_adapters(served):
    llm, _, _ = served
    prompt = [(i * 11 + 3) % 500 for i in range(150)]  # more than two 64-token blocks
    generate_all(llm.engine, {"warm-base": (prompt, None)}, max_tokens=1)
    request = llm.engine.add_request("cold-a0", prompt, SamplingParams(max_tokens=1), lora="a0")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.num_cached_tokens == 0
    request = llm.engine.add_request("warm-a0", prompt, SamplingParams(max_tokens=1), lora="a0")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.num_cached_tokens >= 128


def test_unknown_adapters_are_refused_by_name(served):
    llm, _, _ = served
    with pytest.raises(InvalidRequestError, match="no adapter 'nope'"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=1), lora="nope")
    assert llm.generate([1, 2, 3], SamplingParams(max_tokens=1), lora="a1")[0].outputs[0].token_ids


INTERPRETED = """
import sys, torch
from pathlib import Path
from tests.lora_checks import PROMPT, base_checkpoint, oracle_logits, write_adapter
from tests.reference import load_kestrel
from kestrel.cache.sequence import SequenceCache
from kestrel.lora.manager import LoRAManager
from kestrel.models.batch import ForwardBatch, SeqChunk
from kestrel.models.layers.fused import fuse_model

root = Path(sys.argv[1])
base = base_checkpoint("llama", root / "base")
merged = [write_adapter(base, root / f"a{i}", "llama", seed=i) for i in range(2)]
model = load_kestrel(base)
manager = LoRAManager(model, 2, 8, 64, torch.device("cpu"), torch.float32)
assert manager.tokens.kernels
fuse_model(model)  # q/k/v and gate/up as one matmul each: one kernel pair per group
for i in range(2):
    manager.load(f"a{i}", str(root / f"a{i}"))
ids, n = PROMPT[:10], 10
slots = [manager.slot_for(f"r{i}", manager.key(f"a{i}")) for i in range(2)]
caches = [SequenceCache(model.cache_specs()) for _ in range(3)]
chunks = [SeqChunk(cache, i * n, n) for i, cache in enumerate(caches)]
batch = ForwardBatch(torch.tensor(ids * 3), torch.arange(n).repeat(3), chunks, torch.arange(3 * n))
manager.set_step([slots[0]] * n + [slots[1]] * n + [0] * n)  # a0, a1 and the base, packed
with torch.no_grad():
    out = model(batch)
for i in range(2):
    torch.testing.assert_close(out[i * n : (i + 1) * n], oracle_logits(merged[i], ids), rtol=1e-4, atol=1e-4)
"""


def test_triton_kernels_in_the_interpreter_equal_peft_merged(tmp_path):
    # the CUDA kernels (Triton's interpreter on the CPU, where Triton is installed) over a batch
    # packing two adapters and the base, through the fused q/k/v and gate/up projections
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", INTERPRETED, str(tmp_path)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_quantized_bases_take_adapters(quant, tmp_path):
    # the base's projections stay in GGUF blocks (QuantLinear); the adapter adds to their output
    # as it does to the same file dequantized at load (whose plain Linears equal peft above)
    path = tiny_llama_gguf(tmp_path / f"{quant}.gguf", quant)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**GGUF_CONFIG)).save_pretrained(hf)
    write_adapter(hf, tmp_path / "adapter", "llama", seed=3)
    logits = []
    for packed in (True, False):
        model = load(path, packed=packed)
        assert any(isinstance(m, QuantLinear) for m in model.modules()) == packed
        manager = LoRAManager(model, 1, 8, 64, CPU, torch.float32)
        manager.load("a", str(tmp_path / "adapter"))
        logits.append(kestrel_logits(model, manager, "a", PROMPT))
        base = kestrel_logits(model, manager, None, PROMPT)
    assert_close(logits[0], logits[1])
    assert_differ(logits[1], base)


def test_an_engine_without_lora_refuses_adapters_by_name(tmp_path, smollm2_tokenizer):
    base = base_checkpoint("llama", tmp_path / "base", smollm2_tokenizer, len(smollm2_tokenizer))
    llm = LLM(str(base), progress=False, device="cpu", dtype="float32")
    with pytest.raises(InvalidRequestError, match="--enable-lora or --lora-modules"):
        llm.load_lora("a", str(tmp_path))
    with pytest.raises(InvalidRequestError, match="--enable-lora or --lora-modules"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=1), lora="a")
    assert not any(hasattr(m, "lora") for m in llm.model.modules())  # no hooks, no slots


def test_more_adapters_than_slots_in_flight_wait_for_a_slot(served, tmp_path):
    # four adapters, three slots: the fourth request waits until one adapter is idle, then
    # takes the least recently used slot; each ends with its tokens alone
    llm, _, base = served
    write_adapter(base, tmp_path / "a3", "llama", seed=13)
    llm.load_lora("a3", str(tmp_path / "a3"))
    try:
        names = ["a0", "a1", "a2", "a3"]
        prompts = {n: [(i * 5 + k) % 500 for i in range(8)] for k, n in enumerate(names)}
        alone = {}
        for n, p in prompts.items():
            alone[n] = generate_all(llm.engine, {f"solo-{n}": (p, n)})[0][f"solo-{n}"]
        together, _ = generate_all(llm.engine, {f"all-{n}": (p, n) for n, p in prompts.items()})
        assert {n: together[f"all-{n}"] for n in names} == alone
    finally:
        llm.unload_lora("a3")


def test_an_adapter_unloaded_mid_request_finishes_the_request(served, tmp_path):
    llm, _, base = served
    write_adapter(base, tmp_path / "gone", "llama", seed=14)
    llm.load_lora("gone", str(tmp_path / "gone"))
    prompt = PROMPT[:9]
    alone, _ = generate_all(llm.engine, {"before": (prompt, "gone")})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    request = llm.engine.add_request("during", prompt, params, lora="gone")
    llm.engine.step()  # prefilled with the adapter
    llm.unload_lora("gone")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.output_ids == alone["before"]
    with pytest.raises(InvalidRequestError, match="no adapter 'gone'"):
        llm.engine.add_request("after", prompt, params, lora="gone")
    assert "gone" not in llm.engine.lora_adapters()
