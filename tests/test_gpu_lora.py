"""LoRA on CUDA: the Triton shrink/expand kernels equal the CPU path (tokens grouped by slot) for
mixed slots, fused parts and decode/prefill sizes, and a peft adapter's logits on CUDA (through
the paged runner, fused projections and CUDA graphs) equal peft's merged model."""

import pytest
import torch
from tests.lora_checks import PROMPT, base_checkpoint, generate_all, oracle_logits, write_adapter

from kestrel import LLM, SamplingParams
from kestrel.kernels.lora import add_lora, grouped_lora, part_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("parts", [[4096], [256, 64, 64], [512, 512]])
def test_triton_kernels_equal_the_grouped_path(tokens, parts):
    torch.manual_seed(tokens)
    slots_n, rank, k = 5, 16, 512
    a = torch.randn(slots_n, len(parts) * rank, k, device="cuda") * 0.05
    b = torch.randn(slots_n, sum(parts), rank, device="cuda") * 0.05
    a[0], b[0] = 0, 0
    x = torch.randn(tokens, k, device="cuda")
    slots = torch.randint(0, slots_n, (tokens,), device="cuda", dtype=torch.int32)
    ours = torch.randn(tokens, sum(parts), device="cuda")
    expected = ours.clone()
    for dtype in (torch.float32, torch.bfloat16):
        y, want = ours.to(dtype), expected.to(dtype)
        add_lora(
            y, x.to(dtype), a.to(dtype), b.to(dtype), slots, parts, None, part_blocks(parts).cuda()
        )
        host = slots.tolist()
        groups = [
            (s, torch.tensor([i for i, t in enumerate(host) if t == s], device="cuda"))
            for s in set(host) - {0}
        ]
        grouped_lora(want, x.to(dtype), a.to(dtype), b.to(dtype), groups, parts)
        tol = 1e-3 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.float(), want.float(), rtol=tol, atol=tol)


def test_adapter_logits_on_cuda_equal_peft_merged(tmp_path, smollm2_tokenizer):
    base = base_checkpoint("llama", tmp_path / "base", smollm2_tokenizer, len(smollm2_tokenizer))
    merged = write_adapter(base, tmp_path / "a0", "llama", seed=0)
    llm = LLM(
        str(base),
        progress=False,
        device="cuda",
        dtype="float32",
        lora_modules={"a0": str(tmp_path / "a0")},
        max_lora_rank=8,
        num_blocks=64,  # a fixed pool: the GPU tests share the card
    )
    prompt = PROMPT[:12]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True)
    out = llm.generate(prompt, params, lora="a0")[0].outputs[0]
    ids = list(prompt)
    for token, logprobs in zip(out.token_ids, out.logprobs, strict=True):  # decode steps: graphs
        expected = torch.log_softmax(oracle_logits(merged, ids)[-1], -1)
        assert token == int(expected.argmax())
        for t, lp in logprobs.items():
            assert abs(lp - expected[t].item()) < 1e-3
        ids.append(token)


def test_a_mixed_batch_on_cuda_gives_each_request_its_tokens_alone(tmp_path, smollm2_tokenizer):
    # three adapters and the base, decode steps through CUDA graphs, bfloat16
    base = base_checkpoint("llama", tmp_path / "base", smollm2_tokenizer, len(smollm2_tokenizer))
    adapters = {}
    for i in range(3):
        write_adapter(base, tmp_path / f"a{i}", "llama", seed=i)
        adapters[f"a{i}"] = str(tmp_path / f"a{i}")
    llm = LLM(
        str(base),
        progress=False,
        device="cuda",
        lora_modules=adapters,
        max_lora_rank=8,
        num_blocks=64,  # a fixed pool: the GPU tests share the card
    )
    prompts = {
        n: [(i * 7 + k) % 500 for i in range(9 + k)] for k, n in enumerate([*adapters, None])
    }
    alone = {
        n: generate_all(llm.engine, {f"alone-{n}": (p, n)})[0][f"alone-{n}"]
        for n, p in prompts.items()
    }
    mixed, _ = generate_all(llm.engine, {f"mixed-{n}": (p, n) for n, p in prompts.items()})
    assert {n: mixed[f"mixed-{n}"] for n in prompts} == alone
    assert len({tuple(t) for t in alone.values()}) == 4
