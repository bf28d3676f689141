"""Speculative decoding (n-gram prompt lookup) is lossless: greedy output equals the output without
it, token for token, on tiny random checkpoints of several families (fp32, the paged runner on the
CPU), in batches mixing speculating decodes, plain decodes and prefill chunks, under KV trims and
with a stop string inside an accepted run; temperature-1 verification samples the target's
distribution (chi-square). Plus the proposer and the scheduler's planning and rollback alone."""

import random

import pytest
import torch
import transformers
from tests import (
    test_models_exaone_moe,
    test_models_gemma3,
    test_models_glm4_moe_lite,
    test_models_jamba,
    test_models_llama,
    test_models_mistral,
)
from tests.reference import load_kestrel, save_tiny

from kestrel.cache.blocks import KVMemory
from kestrel.config import SchedulerConfig, SpeculativeConfig, build_config
from kestrel.engine.engine import Engine
from kestrel.engine.request import Request
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.speculative import NgramProposer
from kestrel.errors import InvalidRequestError
from kestrel.sampling import Row, SamplingParams, verify_rows

# (transformers class, config) of each family: llama-shaped, every layer sliding (blocks evicted
# behind the window), mixed sliding/global, MoE with sliding layers, MLA with MoE
FAMILIES = {
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, test_models_llama.CONFIG),
    "mistral": (
        transformers.MistralForCausalLM,
        transformers.MistralConfig,
        test_models_mistral.CONFIG,
    ),
    "gemma3_text": (
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig,
        test_models_gemma3.TEXT,
    ),
    "exaone_moe": (
        transformers.ExaoneMoeForCausalLM,
        transformers.ExaoneMoeConfig,
        test_models_exaone_moe.CONFIG,
    ),
    "glm4_moe_lite": (
        transformers.Glm4MoeLiteForCausalLM,
        transformers.Glm4MoeLiteConfig,
        test_models_glm4_moe_lite.CONFIG,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory, smollm2_tokenizer):
    """(kestrel's model, vocabulary size) of a tiny random checkpoint saved with a tokenizer."""
    model_cls, config_cls, config = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(model_cls, config_cls(**config), folder, tokenizer=smollm2_tokenizer)
    return load_kestrel(folder), config["vocab_size"]


def repeating_prompt(vocab: int, shift: int, length: int = 30) -> list[int]:
    """A prompt that repeats a 9-token phrase: n-grams of it match, as in an edit of the input."""
    phrase = [(i * 37 + 11 + shift) % vocab for i in range(9)]
    return (phrase * 4)[:length]


def engine(model, tokenizer, speculate: bool, **settings) -> Engine:
    spec = {"speculative": "ngram", "num_speculative_tokens": 4} if speculate else {}
    config = build_config(
        block_size=4, num_blocks=96, max_num_seqs=4, prefill_chunk_size=8, **spec, **settings
    )
    return Engine(model, tokenizer, config)


class Steps:
    """What each step fed (observed, not changed): per chunk (draft length, prefilling)."""

    def __init__(self, eng: Engine):
        self.kinds: list[list[tuple[int, bool]]] = []
        execute = eng.runner.execute

        def observed(chunks):
            self.kinds.append([(len(c.draft), c.request.is_prefilling) for c in chunks])
            return execute(chunks)

        eng.runner.execute = observed

    def mixed(self) -> bool:
        """Whether a step verified a draft beside a plain decode or a prefill chunk."""
        return any(any(d for d, _ in step) and any(not d for d, _ in step) for step in self.kinds)


def serve(eng: Engine, jobs, late=()) -> dict:
    """Run (id, prompt, params, max_kv_size) jobs, `late` ones added after 3 steps; per id
    (token ids, text, finish reason, drafted, accepted, tokens per step)."""
    for job_id, prompt, params, bound in jobs:
        eng.add_request(job_id, prompt, params, max_kv_size=bound)
    out: dict = {}
    steps = 0
    while eng.has_unfinished():
        if steps == 3:
            for job_id, prompt, params, bound in late:
                eng.add_request(job_id, prompt, params, max_kv_size=bound)
        steps += 1
        for o in eng.step():
            assert o.error is None, o.error
            ids, text, _, _, _, sizes = out.get(o.request_id, ([], "", None, 0, 0, []))
            sizes = sizes + [len(o.new_token_ids)]
            out[o.request_id] = (
                ids + o.new_token_ids,
                text + o.new_text,
                o.finish_reason,
                o.num_draft_tokens,
                o.num_accepted_tokens,
                sizes,
            )
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def jobs_of(vocab: int, bound: int | None = None):
    early = [
        ("a", repeating_prompt(vocab, 0), greedy(40), bound),
        ("b", repeating_prompt(vocab, 5, 21), greedy(33, logprobs=2), None),
    ]
    late = [("c", repeating_prompt(vocab, 9, 27), greedy(30), bound)]
    return early, late


def assert_same_tokens(plain: dict, spec: dict) -> None:
    assert plain.keys() == spec.keys()
    for key in plain:
        assert spec[key][:3] == plain[key][:3], key


def test_greedy_with_speculation_equals_without_in_a_mixed_batch(tiny, smollm2_tokenizer):
    model, vocab = tiny
    early, late = jobs_of(vocab)
    plain = serve(engine(model, smollm2_tokenizer, False), early, late)
    spec_engine = engine(model, smollm2_tokenizer, True)
    steps = Steps(spec_engine)
    spec = serve(spec_engine, early, late)
    assert_same_tokens(plain, spec)
    drafted = sum(v[3] for v in spec.values())
    accepted = sum(v[4] for v in spec.values())
    # drafts were both accepted and rejected (rolled back), beside plain decodes and prefills
    assert 0 < accepted < drafted, (accepted, drafted)
    assert steps.mixed()
    assert max(max(v[5]) for v in spec.values()) > 1  # a step gave several tokens


def test_logprobs_of_accepted_tokens_equal_the_plain_ones(smollm2_tokenizer, tmp_path):
    model, vocab = tiny_llama(smollm2_tokenizer, tmp_path)
    prompt = repeating_prompt(vocab, 0)
    runs = []
    for speculate in (False, True):
        eng = engine(model, smollm2_tokenizer, speculate)
        eng.add_request("a", prompt, greedy(40, logprobs=3))
        logprobs = []
        while eng.has_unfinished():
            for o in eng.step():
                logprobs += o.new_logprobs
        runs.append(logprobs)
    plain, spec = runs
    assert len(plain) == len(spec) == 40
    for p, s in zip(plain, spec, strict=True):
        assert p.keys() == s.keys()
        assert all(abs(p[t] - s[t]) < 1e-4 for t in p)


def test_greedy_under_kv_trims_equals_without_speculation(tiny, smollm2_tokenizer):
    """--max-kv-size 40: a step that would trim decodes plainly, so the keys every query sees
    are those of a run without speculation; untrimmed sequences share the batch."""
    model, vocab = tiny
    early, late = jobs_of(vocab, bound=None)
    bounded = [(f"t{i}", repeating_prompt(vocab, i, 12), greedy(60), 40) for i in (0, 2)]
    plain = serve(engine(model, smollm2_tokenizer, False, keep=2), early + bounded, late)
    spec_engine = engine(model, smollm2_tokenizer, True, keep=2)
    spec = serve(spec_engine, early + bounded, late)
    assert_same_tokens(plain, spec)
    assert spec["t0"][3] + spec["t2"][3] > 0  # they speculated before their first trim...
    # ...and were trimmed of every fed token past 40 (the last sampled one is never fed)
    assert spec_engine.scheduler.blocks.tokens_trimmed == 2 * (12 + 59 - 40)


def tiny_llama(tokenizer, folder):
    model_cls, config_cls, config = FAMILIES["llama"]
    save_tiny(model_cls, config_cls(**config), folder, tokenizer=tokenizer)
    return load_kestrel(folder), config["vocab_size"]


def stop_run(eng: Engine, prompt, params) -> tuple[list, str, str, list]:
    """(ids, text, finish reason, per step (tokens given, tokens the step produced))."""
    eng.add_request("a", prompt, params)
    ids, text, reason, steps, accepted = [], "", None, [], 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids or o.finished:
                produced = o.num_accepted_tokens - accepted + 1
                steps.append((len(o.new_token_ids), produced))
                accepted = o.num_accepted_tokens
            ids, text, reason = ids + o.new_token_ids, text + o.new_text, o.finish_reason
    return ids, text, reason, steps


def _printable(text: str) -> bool:
    return len(text) == 1 and text.isascii() and text.isprintable() and not text.isspace()


def test_a_stop_string_inside_an_accepted_run_ends_the_request_there(smollm2_tokenizer, tmp_path):
    """A stop string completed by an accepted draft token ends the request there: the tokens
    after it in the same step are dropped, and the output is that of a run without speculation."""
    model, vocab = tiny_llama(smollm2_tokenizer, tmp_path)
    prompt = repeating_prompt(vocab, 0)
    # only tokens of one printable character (byte-level tokens decode to partial UTF-8)
    printable = [t for t in range(vocab) if _printable(smollm2_tokenizer.decode([t]))]
    bias = {t: -100.0 for t in range(vocab) if t not in printable}
    prompt = [printable[t % len(printable)] for t in prompt]
    params = greedy(60, logit_bias=bias)
    ids, text, _, steps = stop_run(engine(model, smollm2_tokenizer, True), prompt, params)
    stops, at = [], 0
    for given, _ in steps:  # text that ends inside a run of 2+ tokens, there the first time
        inner = smollm2_tokenizer.decode(ids[: at + given - 1])
        grew = len(inner) > len(smollm2_tokenizer.decode(ids[:at]))
        # an accepted run copies earlier text: the stop reaches back to where the copy began
        fresh = [inner[-n:] for n in range(1, len(inner) + 1) if inner[-n:] not in inner[:-1]]
        if given >= 2 and grew and fresh:
            stops.append(fresh[0])
        at += given
    cut = []
    for stop in stops:
        params = greedy(60, stop=[stop], logit_bias=bias)
        plain = stop_run(engine(model, smollm2_tokenizer, False), prompt, params)
        spec = stop_run(engine(model, smollm2_tokenizer, True), prompt, params)
        assert spec[:3] == plain[:3] and spec[2] == "stop" and stop not in spec[1]
        given, produced = spec[3][-1]
        cut.append(given < produced)
    assert any(cut), f"no stop fell inside an accepted run ({stops})"


def test_max_tokens_bounds_the_accepted_run(smollm2_tokenizer, tmp_path):
    model, vocab = tiny_llama(smollm2_tokenizer, tmp_path)
    prompt = repeating_prompt(vocab, 0)
    for n in (1, 2, 5, 11):
        plain = serve(engine(model, smollm2_tokenizer, False), [("a", prompt, greedy(n), None)])
        spec = serve(engine(model, smollm2_tokenizer, True), [("a", prompt, greedy(n), None)])
        assert spec["a"][:3] == plain["a"][:3]
        assert len(spec["a"][0]) == n


def test_seeded_sampling_with_speculation_is_reproducible(smollm2_tokenizer, tmp_path):
    model, vocab = tiny_llama(smollm2_tokenizer, tmp_path)
    params = SamplingParams(temperature=0.2, seed=11, max_tokens=50, ignore_eos=True)
    jobs = [("a", repeating_prompt(vocab, 0), params, None)]
    first = serve(engine(model, smollm2_tokenizer, True), jobs)
    again = serve(engine(model, smollm2_tokenizer, True), jobs)
    assert first["a"][:5] == again["a"][:5]
    assert first["a"][3] > 0


def test_penalised_greedy_with_speculation_equals_without(smollm2_tokenizer, tmp_path):
    """Penalties and biases on: the rows are verified one by one, each penalised as its plain
    step would be (the unit test below pins that the accepted tokens count as output)."""
    model, vocab = tiny_llama(smollm2_tokenizer, tmp_path)
    params = greedy(
        60,
        repetition_penalty=1.05,
        presence_penalty=0.05,
        frequency_penalty=0.05,
        logit_bias={7: 2.0},
    )
    jobs = [("a", repeating_prompt(vocab, 0), params, None)]
    plain = serve(engine(model, smollm2_tokenizer, False), jobs)
    spec = serve(engine(model, smollm2_tokenizer, True), jobs)
    assert spec["a"][:3] == plain["a"][:3]
    assert spec["a"][4] > 0  # accepted drafts: later rows saw them as output


def test_a_hybrid_model_decodes_plainly_and_exactly(smollm2_tokenizer, tmp_path):
    """Recurrent state cannot be rolled back: a hybrid (Jamba) never speculates, and its output
    is that of a run without --speculative."""
    config = test_models_jamba.CONFIG
    save_tiny(
        transformers.JambaForCausalLM,
        transformers.JambaConfig(**config),
        tmp_path,
        tokenizer=smollm2_tokenizer,
    )
    model, vocab = load_kestrel(tmp_path), config["vocab_size"]
    early, late = jobs_of(vocab)
    plain = serve(engine(model, smollm2_tokenizer, False), early, late)
    spec = serve(engine(model, smollm2_tokenizer, True), early, late)
    assert_same_tokens(plain, spec)
    assert all(v[3] == 0 for v in spec.values())


# -- rejection sampling keeps the target distribution -------------------------------------------

LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.2], [0.1, 1.3, -0.4, 0.0, 0.6]])
CHI2_99_9 = {4: 18.467}  # chi-square's 0.999 quantile, 4 degrees of freedom
N_SAMPLES = 20_000


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    total = sum(counts)
    return sum(
        (c - total * float(p)) ** 2 / (total * float(p)) for c, p in zip(counts, probs, strict=True)
    )


def verify(logits, draft: list[int], params: SamplingParams) -> list[int]:
    """One chunk's verification through the batched verifier."""
    return verify_rows(logits, [draft], [Row(params)])[0]


def draw(draft: list[int], params: SamplingParams) -> list[list[int]]:
    """N_SAMPLES verifications of one draft over LOGITS, as one batch of as many chunks."""
    torch.manual_seed(0)
    logits = torch.cat([LOGITS, LOGITS[:1]]).repeat(N_SAMPLES, 1)  # + the bonus row
    return verify_rows(logits, [draft] * N_SAMPLES, [Row(params)] * N_SAMPLES)


@pytest.mark.parametrize("draft_token", [0, 2])  # the likeliest token, and an unlikely one
def test_temperature_one_verification_samples_the_target_distribution(draft_token):
    """The first token follows softmax(row 0), whatever the draft; after an accepted draft the
    next one follows softmax(row 1)."""
    params = SamplingParams(temperature=1.0)
    runs = draw([draft_token, 1], params)
    first = [0] * 5
    for tokens in runs:
        first[tokens[0]] += 1
    assert chi_square(first, LOGITS[0].softmax(-1)) < CHI2_99_9[4], first
    second = [0] * 5
    for tokens in runs:
        if tokens[0] == draft_token:
            second[tokens[1]] += 1
    assert chi_square(second, LOGITS[1].softmax(-1)) < CHI2_99_9[4], second


def test_greedy_verification_accepts_up_to_the_first_mismatch():
    params = SamplingParams(temperature=0)
    logits = torch.zeros(4, 6)
    for row, token in enumerate([3, 1, 4, 5]):
        logits[row, token] = 1.0
    assert verify(logits, [3, 1, 4], params) == [3, 1, 4, 5]
    assert verify(logits, [3, 2, 4], params) == [3, 1]
    assert verify(logits, [0, 1, 4], params) == [3]
    drafts = [[3, 1, 4], [3, 2, 4], [0, 1, 4]]  # the same three chunks in one batch
    assert verify_rows(logits.repeat(3, 1), drafts, [Row(params)] * 3) == [
        [3, 1, 4, 5],
        [3, 1],
        [3],
    ]


def test_a_verified_row_is_penalised_for_the_draft_tokens_accepted_before_it():
    """Row 1 follows an accepted 3: with a frequency penalty that 3 counts as output there, so
    row 1's argmax moves from 3 to 4 exactly as a plain step after 3 would."""
    logits = torch.zeros(3, 6)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 4] = 2.0, 1.5  # 3 wins unless penalised by the accepted 3
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert verify(logits, [3, 3], params) == [3, 4]
    assert verify(logits, [3, 3], SamplingParams(temperature=0))[:2] == [3, 3]


def test_a_batch_verifies_greedy_and_sampled_chunks_each_by_its_rule():
    """A greedy chunk beside a sampled one: the greedy one accepts its argmaxes exactly; the
    sampled one never accepts a token its top-k masks (row 0 keeps only 0 and 3)."""
    torch.manual_seed(0)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(top_k=2)
    for _ in range(50):
        tokens = verify_rows(torch.cat([LOGITS, LOGITS]), [[0], [1]], [Row(greedy), Row(sampled)])
        assert tokens[0] == [0, 1] and tokens[1][0] in (0, 3)


# -- the proposer and the scheduler alone ---------------------------------------------------------


def proposer(k=3, n_min=1, n_max=3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, n_min, n_max))


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert proposer().propose(ids, 10) == [7, 8, 5]  # "2 3" last followed by 7 8 5
    assert proposer(k=5).propose(ids, 2) == [7, 8]  # at most `most`
    assert proposer(n_min=3).propose([4, 5, 6, 1, 5, 6], 3) == []  # no 3-gram match
    assert proposer(k=2, n_max=1).propose([5, 1, 5, 2, 5], 4) == [2, 5]  # latest "5"


def test_ngram_search_ignores_matches_across_token_boundaries():
    """The search runs over the tokens' bytes: a byte match that straddles tokens is no match
    (here [1] against the bytes of 256, 0), and random sequences agree with a plain search."""
    assert proposer(n_max=1).propose([256, 0, 7, 1], 3) == []
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(rng.choice([3, 300, 70_000])) for _ in range(rng.randrange(2, 40))]
        for n in range(1, 4):
            tail = ids[-n:]
            starts = [s for s in range(len(ids) - n) if ids[s : s + n] == tail]
            want = ids[starts[-1] + n : starts[-1] + n + 3] if starts and n < len(ids) else []
            assert proposer(n_min=n, n_max=n).propose(ids, 3) == want, (ids, n)


def test_bad_speculative_settings_name_their_flag():
    for kwargs, param in [
        ({"speculative": "eagle"}, "speculative"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"ngram_min": 4, "ngram_max": 2}, "ngram_min"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            build_config(**kwargs)
        assert error.value.param == param


def decoding(prompt: list[int], max_tokens: int = 20, **kw) -> Request:
    request = Request("r", prompt, SamplingParams(temperature=0), max_tokens, **kw)
    return request


def planned(scheduler: Scheduler, request: Request):
    scheduler.add(request)
    plan = scheduler.schedule()  # the prompt in one chunk
    scheduler.computed(plan.chunks, set())
    request.output_ids.append(request.prompt_ids[1])  # the sampled token: a match follows
    return scheduler.schedule().chunks[0]


def test_a_rejected_draft_gives_its_blocks_back():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=8), KVMemory(16, 4))
    blocks = scheduler.blocks
    scheduler.proposer = proposer(k=5)
    request = decoding([5, 6, 7, 8, 9, 1, 2, 3])
    chunk = planned(scheduler, request)
    assert chunk.draft == [7, 8, 9, 1, 2] and chunk.num_tokens == 6
    assert len(blocks.table("r").held) == 4  # positions 0..13
    scheduler.computed([chunk], set(), {"r": 1})  # 7 accepted, 8 9 1 2 rejected
    assert request.num_computed == 10
    assert len(blocks.table("r").held) == 3  # positions 0..9: block 3 went back
    assert blocks.num_free == 13
    assert (request.num_draft_tokens, request.num_accepted_tokens) == (5, 1)


def test_speculation_never_takes_the_blocks_another_decode_needs():
    """Two decodes and one free block: the older one's draft would take it and preempt the
    newer one (whose next token starts a block), so it decodes plainly."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=16), KVMemory(5, 4))
    scheduler.proposer = proposer(k=2)
    older = Request("a", [5, 6, 7, 8, 9, 1], SamplingParams(temperature=0), 8)
    newer = Request("b", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(temperature=0), 8)
    for request in (older, newer):
        scheduler.add(request)
    plan = scheduler.schedule()  # both prompts
    scheduler.computed(plan.chunks, set())
    older.output_ids.append(6)  # 5 6 7 ... 1 6: "6" is followed by 7 8
    newer.output_ids.append(0)
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.draft) for c in plan.chunks] == [("a", []), ("b", [])]
    assert plan.preempted == []


def test_no_speculation_in_a_step_that_would_trim():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=8))
    scheduler.proposer = proposer(k=3)
    chunk = planned(scheduler, decoding([5, 6, 7, 8, 9, 1], max_kv_size=8))
    assert chunk.draft == [] and chunk.num_tokens == 1  # 6 live + 4 > 8: it would trim
    roomy = Scheduler(SchedulerConfig(max_num_seqs=2, prefill_chunk_size=8))
    roomy.proposer = proposer(k=3)
    assert planned(roomy, decoding([5, 6, 7, 8, 9, 1], max_kv_size=12)).draft == [7, 8, 9]


def test_no_speculation_with_recurrent_state_or_past_max_tokens():
    stateful = Scheduler(SchedulerConfig(), KVMemory(None, 4, state_slots=2))
    stateful.proposer = proposer()
    assert planned(stateful, decoding([5, 6, 7, 8, 9])).draft == []
    plain = Scheduler(SchedulerConfig())
    plain.proposer = proposer(k=3)
    assert planned(plain, decoding([5, 6, 7, 8, 9], max_tokens=3)).draft == [7]  # 2 left: 1 + 1
