"""Speculative decoding on CUDA (the paged runner with its Triton kernels and decode graphs):
greedy output with n-gram speculation, with a draft model (its own paged runner and graphs) and
with the checkpoint's MTP layer equals the output without it, token for token, for tiny random checkpoints in fp32 (mixed
batches, KV trims), with a byte-level tokenizer (the GPU machine has no embedded models). Skipped
without a GPU."""

import pytest
import torch
from tests.reference import save_tiny
from tests.test_speculative import FAMILIES, greedy, jobs_of, repeating_prompt, serve
from tests.test_speculative_draft import perturb
from tests.test_speculative_mtp import MTP_FAMILIES, save_with_mtp
from tests.vl_reference import tiny_tokenizer

from kestrel.config import build_config
from kestrel.engine.engine import Engine
from kestrel.weights.loader import load_model, resolve

pytestmark = pytest.mark.gpu


def cuda_engine(model, tokenizer, speculate: bool, draft=None, **settings) -> Engine:
    spec = {"speculative": "ngram", "num_speculative_tokens": 4} if speculate else {}
    if draft is not None:
        spec = {"speculative": "draft", "draft_model": "tiny", "num_speculative_tokens": 4}
    config = build_config(
        block_size=16, num_blocks=64, max_num_seqs=4, prefill_chunk_size=8, **spec, **settings
    )
    return Engine(model, tokenizer, config, torch.device("cuda"), draft)


def load_cuda(folder):
    return load_model(resolve(str(folder)), torch.float32, torch.device("cuda"), progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()  # 262 ids: covers every family's tiny vocabulary (<= 256)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def cuda_tiny(request, tmp_path_factory, tokenizer):
    model_cls, config_cls, config = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**config), folder, tokenizer=tokenizer)
    return load_cuda(folder), config["vocab_size"], folder


class GraphWidths:
    """The token width of each CUDA graph a runner replays (observed, not changed)."""

    def __init__(self, runner):
        self.widths: list[int] = []
        replay = runner._replay

        def observed(packed, width, size, chunks):
            self.widths.append(width)
            return replay(packed, width, size, chunks)

        runner._replay = observed


def test_cuda_greedy_with_speculation_equals_without(cuda_tiny, tokenizer):
    """Verify steps run in their own CUDA graphs (chunks padded to 1 + k rows) and give the
    tokens of plain decode steps."""
    model, vocab, _ = cuda_tiny
    early, late = jobs_of(vocab)
    bounded = [("t", repeating_prompt(vocab, 2, 12), greedy(60), 40)]
    plain = serve(cuda_engine(model, tokenizer, False, keep=2), early + bounded, late)
    spec_engine = cuda_engine(model, tokenizer, True, keep=2)
    graphs = GraphWidths(spec_engine.runner)
    spec = serve(spec_engine, early + bounded, late)
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key
    assert sum(v[4] for v in spec.values()) > 0  # drafts were accepted
    assert 5 in graphs.widths and 1 in graphs.widths  # verify graphs (1 + k) and decode ones


def test_cuda_greedy_with_a_draft_model_equals_without(cuda_tiny, tokenizer):
    """A draft that disagrees at times: its rollbacks and the target's leave the tokens as they
    are without speculation."""
    model, vocab, folder = cuda_tiny
    early, late = jobs_of(vocab)
    bounded = [("t", repeating_prompt(vocab, 2, 12), greedy(60), 40)]
    plain = serve(cuda_engine(model, tokenizer, False, keep=2), early + bounded, late)
    draft = perturb(load_cuda(folder), 0.05)
    spec_engine = cuda_engine(model, tokenizer, True, draft, keep=2)
    graphs = GraphWidths(spec_engine.scheduler.proposer.runner)
    spec = serve(spec_engine, early + bounded, late)
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key
    drafted, accepted = sum(v[3] for v in spec.values()), sum(v[4] for v in spec.values())
    assert 0 < accepted < drafted
    assert 5 in graphs.widths  # the draft's catch-up chunks (up to 1 + k tokens) in graphs


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_cuda_greedy_with_mtp_equals_without(family, tmp_path, tokenizer):
    """The checkpoint's MTP layer proposes (its catch-up and its rounds in the MTP runner's CUDA
    graphs, the hidden states copied into them): fp32 tokens equal those without speculation;
    in bfloat16 (the GPU's default) it proposes and every request runs to its end."""
    save_with_mtp(family, tmp_path, tokenizer)
    vocab = FAMILIES[family][2]["vocab_size"]
    early, late = jobs_of(vocab)
    bounded = [("t", repeating_prompt(vocab, 2, 12), greedy(60), 40)]
    plain = serve(cuda_engine(load_cuda(tmp_path), tokenizer, False, keep=2), early + bounded, late)
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(resolve(str(tmp_path)), dtype, torch.device("cuda"), False, mtp=True)
        spec_engine = cuda_engine(
            model, tokenizer, False, keep=2, speculative="mtp", num_speculative_tokens=4
        )
        graphs = GraphWidths(spec_engine.scheduler.proposer.runner)
        spec = serve(spec_engine, early + bounded, late)
        assert all(spec[key][3] > 0 for key in spec)  # every request speculated
        assert 1 in graphs.widths  # the chained rounds replay the MTP runner's graphs
        for key in plain:
            if dtype == torch.float32:
                assert spec[key][:3] == plain[key][:3], key
            assert len(spec[key][0]) == len(plain[key][0]), key
