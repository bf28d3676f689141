"""The prefix cache's host tier on CUDA: pinned host blocks, copies on a side stream that the
compute stream waits for, an FP8 pool's bytes kept as stored, and conversations (a tiny random
llama on SmolLM2's tokenizer) evicted from a small pool coming back from host memory with the
tokens of a run without the tier. GPU only; skipped elsewhere."""

import pytest
import torch
import transformers
from tests.reference import save_tiny

from kestrel.cache.host_pool import HostPool
from kestrel.cache.host_tier import BlockCopy
from kestrel.cache.paged import BlockPool
from kestrel.cache.sequence import KVShape
from kestrel.llm import LLM
from test_host_tier import POOL, hits, smollm2_conversations

pytestmark = pytest.mark.gpu

LAYOUT = [KVShape(heads=2, dim=64), None, KVShape(heads=2, dim=64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_go_to_pinned_host_memory_and_back_in_order(dtype):
    pool = BlockPool(LAYOUT, num_blocks=6, block_size=16, dtype=dtype, device="cuda")
    for t in pool.k + pool.v:
        if t is not None:
            t.copy_(torch.randn(t.shape, device="cuda").to(dtype))
    before = [t.clone() if t is not None else None for t in pool.k + pool.v]
    host = HostPool.sized(pool, gib=4 * BlockPool.bytes_per_block(LAYOUT, 16, dtype) / 2**30)
    assert host.num_slots == 4 and host.k[0].is_pinned() and host.k[1] is None
    # block 1 out to slot 0, then block 1 overwritten by the next forward's keys (here: zeros
    # queued on the compute stream after the copies), then slot 0 back into block 4
    host.apply([BlockCopy(True, 1, 0)])
    for t in pool.k + pool.v:
        if t is not None:
            t[1].zero_()
    host.apply([BlockCopy(False, 4, 0)])
    torch.cuda.synchronize()
    for old, new in zip(before, pool.k + pool.v, strict=True):
        if old is not None:
            assert torch.equal(new[4].view(torch.uint8), old[1].view(torch.uint8))


def test_conversations_come_back_from_host_memory_on_cuda(tmp_path, smollm2_tokenizer):
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    folder = save_tiny(transformers.LlamaForCausalLM, config, tmp_path, smollm2_tokenizer)
    settings = dict(POOL, model=str(folder), device="cuda", dtype="float32")
    answers = smollm2_conversations(LLM(**settings))
    llm = LLM(**settings, kv_offloading_size=0.05)
    assert smollm2_conversations(llm) == answers
    assert hits(llm)["host"] > 0
    assert llm.engine.runner.host_pool.k[0].is_pinned()
