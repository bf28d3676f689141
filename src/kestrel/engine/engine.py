"""Engine: add_request / step / abort. Turns runner results into text, stops and finish reasons."""

import logging
from dataclasses import dataclass, field, replace

import torch

from kestrel.config import Config
from kestrel.engine.draft import DraftProposer, draft_proposer
from kestrel.engine.grammar import GrammarMasks
from kestrel.engine.mtp import MtpProposer, mtp_proposer
from kestrel.engine.paged_runner import make_runner
from kestrel.engine.request import Request
from kestrel.engine.runner import run_step
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.speculative import make_proposer
from kestrel.engine.step_sampler import StepResult
from kestrel.errors import InvalidRequestError
from kestrel.lora.manager import LoRAManager
from kestrel.models.qwen_vl_processor import MultimodalPrompt
from kestrel.sampling import SamplingParams, check_token_ids
from kestrel.tokenizer import IncrementalDetokenizer, StopStringMatcher, encode, stop_token_ids

log = logging.getLogger("kestrel.engine")


@dataclass
class RequestOutput:
    """One step's progress of one request. Text and ids are deltas since the previous output."""

    request_id: str
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: BaseException | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    embedding: list[float] | None = None  # an embedding request's vector (its only output)
    num_draft_tokens: int = 0  # speculative decoding: tokens proposed so far...
    num_accepted_tokens: int = 0  # ...and accepted


@dataclass
class EngineLoad:
    """What the engine holds now; the server's gauges and counters read it after each step."""

    waiting: int = 0
    running: int = 0
    kv_tokens_in_use: int = 0
    kv_tokens_trimmed: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which were found
    prefix_cached_blocks: int = 0
    prefix_evictions: int = 0
    prefix_host_hit_tokens: int = 0  # of the hit tokens, those the host tier brought back
    prefix_host_blocks: int = 0  # blocks the host tier holds...
    prefix_host_capacity: int = 0  # ...of this many (0: no host tier)
    draft_tokens: int = 0  # speculative decoding: tokens proposed...
    accepted_tokens: int = 0  # ...and accepted


class _TextState:
    """Per-request detokenizer and stop-string matcher; `emitted` counts characters streamed."""

    def __init__(self, tokenizer, request: Request):
        params = request.params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_ids, params.skip_special_tokens
        )
        self.matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.emitted = 0


class Engine:
    def __init__(self, model, tokenizer, config: Config | None = None, device=None, draft=None):
        """`draft`: --speculative draft's model, loaded (kestrel.loading.load_draft)."""
        self.config = config or Config()
        self.tokenizer = tokenizer
        self.device = torch.device(device or "cpu")
        # models that take images keep the whole config; vocabulary and context are the decoder's
        text = model.config.text_config if getattr(model, "multimodal", False) else model.config
        self.vocab_size = text.vocab_size
        self.eos_ids = stop_token_ids(tokenizer, text)
        self.ctx_size = self.config.model.ctx_size or getattr(text, "max_position_embeddings", 4096)
        # before the target's runner: on CUDA its pool takes its share of memory first
        proposer = self._draft_proposer(model, draft)
        # LoRA slots join the projections before the runner fuses them and captures graphs
        self.lora = self._lora_manager(model)
        # CUDA: the paged runner (pool, kernels, graphs); the reference runner otherwise
        self.runner = make_runner(model, self.device, self.config, self.ctx_size)
        self.runner.lora = self.lora
        if isinstance(proposer, MtpProposer):  # it catches up on the model's hidden states
            self.runner.hidden_out = proposer.observe
        self.runner.grammar = GrammarMasks(tokenizer, self.vocab_size, self.eos_ids)
        memory = self.runner.kv_memory(self.config.scheduler.kv_capacity)
        # the KV capacity in effect (the GPU pool's, when it has one) bounds what requests ask
        self.config = replace(
            self.config,
            scheduler=replace(self.config.scheduler, kv_capacity=memory.token_capacity),
        )
        self.scheduler = Scheduler(self.config.scheduler, memory)  # it builds the block manager
        if self.lora is not None:
            self.scheduler.max_adapters = self.config.lora.max_loras
            for name, path in self.config.lora.lora_modules.items():
                self.lora.load(name, path)
        if self.runner.speculates:  # the reference runner decodes token by token
            self.scheduler.proposer = proposer or make_proposer(self.config.speculation)
        multimodal = getattr(model, "multimodal", False)
        self.intake = RequestFactory(
            tokenizer, self.config, self.vocab_size, self.ctx_size, multimodal, text.hidden_size
        )
        self.requests: dict[str, Request] = {}
        self.text: dict[str, _TextState] = {}
        # chat messages with images -> MultimodalPrompt, for models that take images (set by
        # whoever loads the checkpoint: kestrel.models.qwen_vl_processor.load_processor); None: text only
        self.processor = None
        # disaggregated prefill/decode: this engine's role (distributed/disaggregated.py), with
        # `admit(engine, request)` for each request handed to it and `hand_off(engine,
        # request)` for each it finished with "handoff"; None: a whole engine
        self.role = None
        # test-only: called as hook("loop", request) for each running request before a step
        # (outside the runner's isolation, so it kills whatever loop drives the engine) and as
        # hook("detokenize", request) before each detokenization
        self.fault_hook = None

    def _lora_manager(self, model) -> LoRAManager | None:
        lora, sched = self.config.lora, self.config.scheduler
        if not lora.enabled:
            return None
        k = self.config.speculation.num_speculative_tokens
        rows = max(sched.token_budget, sched.max_num_seqs * (1 + k))  # a step's most rows
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        return LoRAManager(model, lora.max_loras, lora.max_lora_rank, rows, self.device, dtype)

    # -- LoRA adapters (kestrel.lora) ---------------------------------------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` (InvalidRequestError names what is wrong)."""
        self._lora().load(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; requests running with it finish with it."""
        self._lora().unload(name)

    def lora_adapters(self) -> dict[str, str]:
        """name -> path of every loaded adapter."""
        return {} if self.lora is None else self.lora.loaded()

    def _lora(self, param: str = "lora_name") -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA adapters are off: start with --enable-lora or --lora-modules", param
            )
        return self.lora

    def _draft_proposer(self, model, draft) -> DraftProposer | None:
        if self.config.speculation.speculative == "mtp":
            return mtp_proposer(model, self.device, self.config, self.ctx_size)
        if self.config.speculation.speculative != "draft":
            return None
        if draft is None:
            raise ValueError("--speculative draft: no draft model was loaded (--draft-model)")
        return draft_proposer(draft, self.device, self.config, self.ctx_size, self.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        max_kv_size: int | None = None,
        lora: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and queue a request (`lora`: an adapter's name, None: the base model;
        `priority`: lower runs sooner, under the priority policy); raises InvalidRequestError
        or QueueFullError."""
        request = self.intake.build(
            request_id, prompt, params, max_kv_size, lora=lora, priority=priority
        )
        self.add(request)
        return request

    def add(self, request: Request) -> None:
        """Queue a request `intake` built (here, or in the server's process); QueueFullError."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}")
        if request.lora is not None:  # adapters are loaded here: the server checked the name
            request.lora_key = self._lora("model").key(request.lora)
        self.text[request.request_id] = _TextState(self.tokenizer, request)
        try:
            if self.role is not None and request.handoff:
                self.role.admit(self, request)
            self.scheduler.add(request)
        except BaseException:
            self.text.pop(request.request_id)
            self.runner.release(request.request_id)  # blocks a role took for it
            raise
        self.requests[request.request_id] = request

    def add_all(self, requests: list[Request]) -> list[RequestOutput]:
        """Queue each request; one that raises fails only itself, as a finished error output."""
        failed = []
        for request in requests:
            try:
                self.add(request)
            except Exception as error:
                failed.append(
                    RequestOutput(
                        request.request_id, finished=True, finish_reason="error", error=error
                    )
                )
        return failed

    def step(self) -> list[RequestOutput]:
        if self.fault_hook:
            for request in self.scheduler.running:
                self.fault_hook("loop", request)
        results = run_step(self.scheduler, self.runner)
        outputs = [out for result in results if (out := self._process(result)) is not None]
        for request in self.scheduler.running:
            if request.finish_reason == "handoff":
                self.role.hand_off(self, request)  # while its blocks are still its own
        for request in self.scheduler.remove_finished():
            self._release(request.request_id)
        return outputs

    def _process(self, result: StepResult) -> RequestOutput | None:
        request = result.request
        if result.error is not None:
            request.finish("error")
            return self._output(request, error=result.error)
        if result.embedding is not None:
            request.finish("stop")
            return self._output(request, embedding=result.embedding)
        if result.token is None:
            return None  # a prefill chunk that did not reach the end of the prompt
        tokens = result.tokens or [result.token]
        one = [result.logprobs] if result.logprobs is not None else []
        logprobs = result.token_logprobs or one
        texts = []
        for token in tokens:  # a stop or max_tokens inside an accepted run ends it there
            request.output_ids.append(token)
            try:
                texts.append(self._append_text(request, token))
            except Exception as error:
                log.exception("request %s failed in detokenization", request.request_id)
                request.finish("error")
                return self._output(request, error=error)
            if request.finished:
                break
        n = len(texts)
        return self._output(request, "".join(texts), tokens[:n], logprobs[:n])

    def _append_text(self, request: Request, token: int) -> str:
        if self.fault_hook:
            self.fault_hook("detokenize", request)
        state = self.text[request.request_id]
        is_stop_token = token in request.params.stop_token_ids or (
            token in self.eos_ids and not request.params.ignore_eos
        )
        if not is_stop_token:
            state.matcher.feed(state.detokenizer.push(token))
        if is_stop_token or state.matcher.stopped:
            request.finish("stop")
        elif len(request.output_ids) >= request.max_tokens:
            request.finish("length")
        visible = state.matcher.streamable(request.finished)
        new_text = visible[state.emitted :]
        state.emitted = len(visible)
        if request.handoff and not request.finished:
            # the decode engine goes on from here, the held-back text with it
            request.finish("handoff")
        return new_text

    def _output(
        self, request: Request, text="", ids=(), logprobs=(), error=None, embedding=None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_text=text,
            new_token_ids=list(ids),
            new_logprobs=list(logprobs),
            finished=request.finished,
            finish_reason=request.finish_reason,
            error=error,
            num_prompt_tokens=len(request.prompt_ids),
            num_generated_tokens=len(request.output_ids),
            num_cached_tokens=request.num_cached_tokens or 0,
            embedding=embedding,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its cache at once."""
        request = self.scheduler.abort(request_id)
        self._release(request_id)
        return request is not None

    def _release(self, request_id: str) -> None:
        self.runner.release(request_id)
        if self.scheduler.proposer is not None:
            self.scheduler.proposer.release(request_id)
        self.requests.pop(request_id, None)
        self.text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def snapshot(self) -> EngineLoad:
        scheduler, prefix = self.scheduler, self.scheduler.blocks.prefix
        load = EngineLoad(
            len(scheduler.waiting),
            len(scheduler.running),
            self.runner.kv_tokens_in_use(),
            scheduler.blocks.tokens_trimmed,
            scheduler.num_preempted,
            draft_tokens=scheduler.num_draft_tokens,
            accepted_tokens=scheduler.num_accepted_tokens,
        )
        if prefix is not None:
            load.prefix_queried_tokens, load.prefix_hit_tokens = (
                prefix.queried_tokens,
                prefix.hit_tokens,
            )
            load.prefix_cached_blocks, load.prefix_evictions = (
                len(prefix.block_of),
                prefix.evictions,
            )
        host = scheduler.blocks.host
        if host is not None:
            load.prefix_host_hit_tokens = host.hit_tokens
            load.prefix_host_blocks, load.prefix_host_capacity = len(host), host.num_slots
        return load


class RequestFactory:
    """Validates a prompt and its parameters and builds the Request. It needs no model, so the
    server's process validates with it and only valid requests reach the engine's process."""

    def __init__(
        self,
        tokenizer,
        config: Config,
        vocab_size: int,
        ctx_size: int,
        multimodal: bool,
        hidden_size: int | None = None,
    ):
        """`hidden_size`: the size of the final-norm hidden states (the embeddings' size)."""
        self.tokenizer, self.config = tokenizer, config
        self.vocab_size, self.ctx_size, self.multimodal = vocab_size, ctx_size, multimodal
        self.hidden_size = hidden_size

    def build(
        self,
        request_id: str,
        prompt: str | list[int] | MultimodalPrompt,
        params: SamplingParams,
        max_kv_size: int | None = None,
        embed: bool = False,
        lora: str | None = None,
        priority: int = 0,
    ) -> Request:
        """The request (`embed`: an embedding request, pooled as --pooling says; `lora`: the
        adapter it runs with; `priority`: its place under the priority policy); raises
        InvalidRequestError."""
        self.check_priority(priority)
        multimodal = prompt if isinstance(prompt, MultimodalPrompt) else None
        if multimodal is not None and (embed or not self.multimodal):
            what = "embeddings take text only" if embed else "this model does not take images"
            raise InvalidRequestError(what, param="input" if embed else "messages")
        if multimodal is not None:
            prompt_ids = list(multimodal.token_ids)
        else:
            prompt_ids = encode(self.tokenizer, prompt)
        self._validate(prompt_ids, params, "input" if embed else "prompt")
        if embed:
            return self._embedding(request_id, prompt_ids, params, lora, priority)
        kv_bound = self._kv_bound(max_kv_size)
        return Request(
            request_id,
            prompt_ids,
            params,
            self._max_tokens(prompt_ids, params, kv_bound),
            max_kv_size=kv_bound,
            keep=self.config.cache.keep,
            multimodal=multimodal,
            image_keys=multimodal.image_keys() if multimodal is not None else (),
            lora=lora,
            priority=priority,
        )

    def check_priority(self, priority: int) -> None:
        """As vLLM: an integer, and under fcfs only 0 (a priority that would be ignored is a
        400, not a silent no-op)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {priority} needs --scheduling-policy priority (LLM: "
                'scheduling_policy="priority"); under fcfs only priority 0 is accepted',
                param="priority",
            )

    def _validate(self, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=param)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size})", param=param
            )
        check_token_ids(params, self.vocab_size)

    def _embedding(
        self, request_id: str, prompt_ids: list[int], params, lora=None, priority: int = 0
    ) -> Request:
        """An embedding request: no KV bound (a trim would hide tokens from the pooled states),
        so its whole prompt must fit the context; it generates nothing."""
        if len(prompt_ids) > self._context():
            raise InvalidRequestError(
                f"input has {len(prompt_ids)} tokens; the context holds {self._context()}",
                param="input",
                code="context_length_exceeded",
            )
        pooling = self.config.model.pooling
        return Request(
            request_id, prompt_ids, params, 0, pooling=pooling, lora=lora, priority=priority
        )

    def _kv_bound(self, requested: int | None) -> int | None:
        """The request's KV bound: its own if smaller than the server's, else the server's."""
        cache = self.config.cache
        bounds = [b for b in (requested, cache.max_kv_size) if b]
        bound = min(bounds) if bounds else None
        if bound is not None and bound <= cache.keep:
            raise InvalidRequestError(
                f"max_kv_size must exceed keep ({cache.keep})", param="max_kv_size"
            )
        capacity = self.config.scheduler.kv_capacity
        if bound is not None and capacity and bound > capacity:
            raise InvalidRequestError(
                f"max_kv_size must be at most the KV capacity ({capacity})", param="max_kv_size"
            )
        return bound

    def _max_tokens(self, prompt_ids, params: SamplingParams, kv_bound: int | None) -> int:
        """Without a KV bound the prompt must fit the context; max_tokens is clamped to what fits."""
        room = self._context() - len(prompt_ids)
        if kv_bound is None:
            if room < 1:
                raise InvalidRequestError(
                    f"prompt has {len(prompt_ids)} tokens; the context holds {self.ctx_size} "
                    "(start the server with a larger --ctx-size or a --max-kv-size)",
                    param="messages",
                    code="context_length_exceeded",
                )
            return min(params.max_tokens or room, room)
        return params.max_tokens or self.ctx_size

    def _context(self) -> int:
        """Tokens one unbounded sequence may hold: the context, or less under a KV capacity."""
        capacity = self.config.scheduler.kv_capacity
        return min(self.ctx_size, capacity) if capacity else self.ctx_size
