"""Speculative decoding with the checkpoint's own multi-token-prediction layer (--speculative mtp)
is lossless: greedy output equals the output without it, token for token, for the families that
ship one (EXAONE-MoE: a dense block with sliding attention here; GLM-4.x-Flash: an MLA block with
MoE), on tiny random checkpoints with an MTP layer written in each family's checkpoint names (fp32,
the paged runner on the CPU), in mixed batches with KV trims. The proposals themselves are what
the MTP layer computes from scratch on the target's hidden states (so catch-up and rollback
keep its cache right). Plus the refusals: a family without MTP, a checkpoint without the layer."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.reference import load_kestrel, save_tiny
from tests.test_speculative import (  # noqa: F401 (one_thread: an autouse fixture)
    FAMILIES,
    greedy,
    jobs_of,
    one_thread,
    repeating_prompt,
    serve,
)
from tests.test_speculative import engine as plain_or_ngram_engine

from kestrel import LLM
from kestrel.cache.sequence import SequenceCache
from kestrel.engine.engine import Engine
from kestrel.errors import ModelLoadError
from kestrel.models.batch import ForwardBatch
from kestrel.weights.loader import load_model, resolve

MTP_FAMILIES = ["exaone_moe", "glm4_moe_lite"]


def save_with_mtp(family: str, folder, tokenizer) -> None:
    """A tiny random checkpoint of `family` with an MTP layer in the family's checkpoint names:
    its block is layer n of the same model one layer deeper (as transformers saves it), its own
    norms and projection random."""
    model_cls, config_cls, config = FAMILIES[family]
    n, h = config["num_hidden_layers"], config["hidden_size"]
    config = dict(config)
    if family == "exaone_moe":
        config["mtp_layer_types"] = ["sliding_attention"]
    save_tiny(model_cls, config_cls(**config), folder, tokenizer=tokenizer)
    deeper = dict(config, num_hidden_layers=n + 1)
    deeper["mlp_layer_types"] = config["mlp_layer_types"] + ["sparse"]
    if family == "exaone_moe":
        deeper["mlp_layer_types"][-1] = "dense"
        deeper["layer_types"] = config["layer_types"] + ["sliding_attention"]
    save_tiny(model_cls, config_cls(**deeper), folder / "deeper", seed=1)
    block = {
        name.removeprefix(f"model.layers.{n}."): t
        for name, t in load_file(folder / "deeper" / "model.safetensors").items()
        if name.startswith(f"model.layers.{n}.")
    }
    g = torch.Generator().manual_seed(2)
    norm = lambda: 1 + 0.2 * torch.randn(h, generator=g)  # noqa: E731
    own = [norm(), norm(), torch.randn(h, 2 * h, generator=g) * 0.2, norm()]
    if family == "glm4_moe_lite":
        prefix, names = f"model.layers.{n}.", ["enorm", "hnorm", "eh_proj", "shared_head.norm"]
        block = {prefix + name: t for name, t in block.items()}
    else:
        prefix = "mtp."
        names = ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"]
        block = {"mtp.layers.0." + name: t for name, t in block.items()}
    tensors = load_file(folder / "model.safetensors")
    tensors |= block | {f"{prefix}{name}.weight": t for name, t in zip(names, own, strict=True)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def load_with_mtp(folder):
    return load_model(resolve(str(folder)), torch.float32, torch.device("cpu"), False, mtp=True)


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    folder = tmp_path_factory.mktemp(request.param)
    save_with_mtp(request.param, folder, smollm2_tokenizer)
    return folder, FAMILIES[request.param][2]["vocab_size"]


def engine(model, tokenizer, mtp: bool, **settings) -> Engine:
    """test_speculative's engine, speculating with the MTP layer (`mtp`) or not at all."""
    spec = {"speculative": "mtp", "num_speculative_tokens": 3} if mtp else {}
    return plain_or_ngram_engine(model, tokenizer, False, **spec, **settings)


class Proposals:
    """Each proposal the engine's MTP proposer made, with the sequence it followed."""

    def __init__(self, proposer):
        self.made: list[tuple[str, list[int], list[int]]] = []  # (request id, ids, proposal)
        propose_all = proposer.propose_all

        def recorded(requests, most):
            drafts = propose_all(requests, most)
            for request, draft in zip(requests, drafts, strict=True):
                if draft:
                    self.made.append((request.request_id, list(request.all_ids), draft))
            return drafts

        proposer.propose_all = recorded


def proposed_from_scratch(target, draft, ids: list[int], k: int) -> list[int]:
    """The MTP layer's k proposals to follow `ids`, computed in one pass: the target's hidden
    states of every position, the layer over all of them at once, then k - 1 chained steps."""
    with torch.no_grad():
        batch = ForwardBatch.single(SequenceCache(target.cache_specs()), torch.tensor(ids[:-1]))
        batch.keep_hidden = True
        target(batch)
        cache = SequenceCache(draft.cache_specs())
        tokens, hidden, out = ids[1:], batch.hidden, []
        for _ in range(k):
            step = ForwardBatch.single(cache, torch.tensor(tokens), all_logits=False)
            step.keep_hidden, step.prev_hidden = True, hidden
            out.append(int(draft(step)[-1].argmax()))
            cache.advance(len(tokens))
            tokens, hidden = [out[-1]], step.hidden[-1:]
    return out


def test_greedy_with_mtp_equals_without(checkpoint, smollm2_tokenizer):
    """Mixed batches (prefill chunks next to verify steps), a trimmed request: the tokens of a
    run without speculation; and the untrimmed requests' proposals are the MTP layer's own,
    recomputed from scratch (a trim changes the target's hidden states, not the layer's keys)."""
    folder, vocab = checkpoint
    early, late = jobs_of(vocab)
    bounded = [("t", repeating_prompt(vocab, 2, 12), greedy(40), 24)]
    plain_engine = engine(load_kestrel(folder), smollm2_tokenizer, False, keep=2)
    plain = serve(plain_engine, early + bounded, late)
    target = load_with_mtp(folder)
    spec_engine = engine(target, smollm2_tokenizer, True, keep=2)
    proposals = Proposals(spec_engine.scheduler.proposer)
    spec = serve(spec_engine, early + bounded, late)
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key
    assert all(spec[key][3] > 0 for key in spec)  # every request speculated
    draft = spec_engine.scheduler.proposer.runner.model
    untrimmed = [(ids, proposed) for rid, ids, proposed in proposals.made if rid != "t"]
    for ids, proposed in untrimmed[:: max(1, len(untrimmed) // 12)]:
        assert proposed == proposed_from_scratch(target, draft, ids, len(proposed)), ids


def test_mtp_is_refused_where_there_is_none(tmp_path, smollm2_tokenizer):
    """A family without an MTP layer, and a checkpoint of an MTP family saved without it: both
    refused at load, naming what is missing."""
    model_cls, config_cls, config = FAMILIES["llama"]
    save_tiny(model_cls, config_cls(**config), tmp_path / "llama")
    with pytest.raises(ValueError, match="speculative mtp.*llama"):
        load_with_mtp(tmp_path / "llama")
    model_cls, config_cls, config = FAMILIES["glm4_moe_lite"]
    save_tiny(model_cls, config_cls(**config), tmp_path / "glm")
    with pytest.raises(ModelLoadError, match="speculative mtp: the checkpoint has no multi-token"):
        load_with_mtp(tmp_path / "glm")


def test_llm_with_mtp_gives_the_plain_tokens(checkpoint):
    """LLM(..., speculative="mtp") loads the checkpoint's MTP layer and proposes with it; the
    greedy tokens are those of LLM(...) without it."""
    folder, vocab = checkpoint
    prompts = [repeating_prompt(vocab, 1, 20), repeating_prompt(vocab, 6, 13)]
    params = greedy(24)
    plain = LLM(str(folder), progress=False).generate(prompts, params)
    llm = LLM(str(folder), progress=False, speculative="mtp", num_speculative_tokens=2)
    spec = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.scheduler.num_draft_tokens > 0


def test_mtp_follows_a_request_whose_prompt_hit_the_prefix_cache(checkpoint, smollm2_tokenizer):
    """A second prompt that shares 24 tokens with a first one starts from the prefix cache: the
    target never computes those positions, so its MTP shadow starts after them (earlier keys
    masked). It still proposes, and the tokens are those without speculation."""
    folder, vocab = checkpoint
    first = repeating_prompt(vocab, 3, 30)
    jobs = [("first", first, greedy(20), None)]
    late = [("second", first[:24] + repeating_prompt(vocab, 7, 6), greedy(30), None)]
    plain = serve(engine(load_kestrel(folder), smollm2_tokenizer, False), jobs, late)
    spec_engine = engine(load_with_mtp(folder), smollm2_tokenizer, True)
    spec = serve(spec_engine, jobs, late)
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key
    assert spec_engine.requests == {} and spec["second"][3] > 0
    assert spec_engine.scheduler.blocks.prefix.hit_tokens >= 24
