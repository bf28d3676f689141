"""Speculative decoding with a draft model is lossless: greedy output equals the output without
it, token for token, on tiny random checkpoints of several families (fp32, the paged runner on
the CPU), in batches mixing speculating decodes, plain decodes and prefill chunks, under KV trims
and with penalties; with a draft that sometimes disagrees (rejections rolled back in both models'
caches) and with a draft identical to the target (every proposal accepted). Plus the settings and
drafts that cannot propose, refused by name, and the real SmolLM2 drafting for itself."""

import pytest
import torch
import transformers
from tests import test_models_jamba
from tests.reference import load_kestrel, save_tiny
from tests.test_speculative import (  # noqa: F401 (one_thread: an autouse fixture)
    FAMILIES,
    greedy,
    jobs_of,
    one_thread,
    repeating_prompt,
    serve,
)
from tests.vl_reference import tiny_tokenizer

from kestrel import LLM
from kestrel.config import build_config
from kestrel.engine.engine import Engine
from kestrel.errors import InvalidRequestError
from kestrel.sampling import SamplingParams

DRAFTED = ["llama", "gemma3_text", "glm4_moe_lite"]  # dense, sliding + global, MLA with MoE


@pytest.fixture(scope="module", params=DRAFTED)
def checkpoint(request, tmp_path_factory, smollm2_tokenizer):
    """(folder, vocabulary size) of a tiny random checkpoint saved with a tokenizer."""
    model_cls, config_cls, config = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**config), folder, tokenizer=smollm2_tokenizer)
    return folder, config["vocab_size"]


def perturb(model, scale: float):
    """`model` with every weight scaled by 1 + scale * noise: a draft that mostly agrees."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=generator).to(p.device))
    return model


def perturbed(folder, scale: float):
    return perturb(load_kestrel(folder), scale)


def engine(model, tokenizer, draft=None, **settings) -> Engine:
    spec = {"speculative": "draft", "draft_model": "tiny", "num_speculative_tokens": 4}
    config = build_config(
        block_size=4,
        num_blocks=96,
        max_num_seqs=4,
        prefill_chunk_size=8,
        **(spec if draft is not None else {}),
        **settings,
    )
    return Engine(model, tokenizer, config, draft=draft)


def drafted_and_accepted(out: dict) -> tuple[int, int]:
    return sum(v[3] for v in out.values()), sum(v[4] for v in out.values())


def test_greedy_with_a_draft_model_equals_without(checkpoint, smollm2_tokenizer):
    folder, vocab = checkpoint
    model = load_kestrel(folder)
    early, late = jobs_of(vocab)
    plain = serve(engine(model, smollm2_tokenizer), early, late)
    # a draft that disagrees at times (rollbacks), and the target itself (all accepted)
    for draft, low, high in [(perturbed(folder, 0.05), 0.1, 0.9), (load_kestrel(folder), 1, 1)]:
        spec = serve(engine(model, smollm2_tokenizer, draft), early, late)
        for key in plain:
            assert spec[key][:3] == plain[key][:3], key
        drafted, accepted = drafted_and_accepted(spec)
        assert drafted and low <= accepted / drafted <= high, (accepted, drafted)


def test_greedy_with_a_draft_under_kv_trims_and_penalties_equals_without(
    smollm2_tokenizer, tmp_path
):
    """--max-kv-size 40 on two requests (the target trims, the draft keeps every key) and
    penalties on a third: the tokens are those of a run without speculation."""
    model_cls, config_cls, config = FAMILIES["llama"]
    save_tiny(model_cls, config_cls(**config), tmp_path, tokenizer=smollm2_tokenizer)
    model, vocab = load_kestrel(tmp_path), config["vocab_size"]
    penalised = greedy(50, repetition_penalty=1.1, frequency_penalty=0.1, logprobs=2)
    jobs = [(f"t{i}", repeating_prompt(vocab, i, 12), greedy(60), 40) for i in (0, 2)]
    jobs.append(("p", repeating_prompt(vocab, 4), penalised, None))
    plain = serve(engine(model, smollm2_tokenizer, keep=2), jobs)
    spec = serve(engine(model, smollm2_tokenizer, perturbed(tmp_path, 0.05), keep=2), jobs)
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key
    assert all(spec[key][3] > 0 for key in spec)  # every request speculated


def test_bad_draft_settings_name_their_flag():
    for kwargs, param in [
        ({"speculative": "draft"}, "draft_model"),
        ({"draft_model": "smollm2"}, "draft_model"),
        ({"speculative": "ngram", "draft_model": "smollm2"}, "draft_model"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            build_config(**kwargs)
        assert error.value.param == param


def test_drafts_that_cannot_propose_are_refused_by_name(smollm2_tokenizer, tmp_path):
    """A draft with a larger vocabulary (its tokens are not the model's) or recurrent state (it
    cannot be rolled back) is refused when the engine is built, naming --draft-model."""
    model_cls, config_cls, config = FAMILIES["llama"]
    save_tiny(model_cls, config_cls(**config), tmp_path / "target", tokenizer=smollm2_tokenizer)
    save_tiny(
        model_cls,
        config_cls(**{**config, "vocab_size": config["vocab_size"] + 8}),
        tmp_path / "wide",
        tokenizer=smollm2_tokenizer,
    )
    save_tiny(
        transformers.JambaForCausalLM,
        transformers.JambaConfig(**test_models_jamba.CONFIG),
        tmp_path / "hybrid",
        tokenizer=smollm2_tokenizer,
    )
    model = load_kestrel(tmp_path / "target")
    for name, says in [("wide", "vocabulary"), ("hybrid", "recurrent state")]:
        with pytest.raises(ValueError, match=f"--draft-model.*{says}"):
            engine(model, smollm2_tokenizer, load_kestrel(tmp_path / name))


def test_a_draft_with_another_tokenizer_is_refused_at_load(smollm2_tokenizer, tmp_path):
    model_cls, config_cls, config = FAMILIES["llama"]
    save_tiny(model_cls, config_cls(**config), tmp_path / "target", tokenizer=smollm2_tokenizer)
    save_tiny(model_cls, config_cls(**config), tmp_path / "other", tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="--draft-model .*tokenizer"):
        LLM(
            str(tmp_path / "target"),
            progress=False,
            speculative="draft",
            draft_model=str(tmp_path / "other"),
        )


def test_smollm2_drafting_for_itself_gives_its_own_greedy_tokens():
    """The real embedded SmolLM2 (Q4_1 GGUF) through LLM(...), drafting for itself: the same
    greedy text as without speculation, every proposal accepted."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = "Rewrite this list in reverse order: apples, pears, plums, figs, dates."
    plain = LLM("smollm2", progress=False).generate([prompt], params)[0].outputs[0]
    llm = LLM("smollm2", progress=False, speculative="draft", draft_model="smollm2")
    spec = llm.generate([prompt], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids
    scheduler = llm.engine.scheduler
    assert scheduler.num_draft_tokens > 0
    assert scheduler.num_accepted_tokens == scheduler.num_draft_tokens
