"""The offline Python API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams())`."""

import itertools
from dataclasses import dataclass, field

from kestrel.config import DRAFT_METHODS, Config, build_config
from kestrel.engine.engine import Engine, RequestOutput
from kestrel.errors import InvalidRequestError
from kestrel.loading import load_draft, load_model, resolve_device
from kestrel.media import MediaLimits, image_part_params
from kestrel.models.qwen_vl_processor import MultimodalPrompt, chat_prompt, load_processor
from kestrel.sampling import SamplingParams
from kestrel.tokenizer import apply_chat_template, encode
from kestrel.weights.embedded import DEFAULT_MODEL


def load_engine(config: Config, progress: bool = True, exit_with_workers: bool = False):
    """(Engine, source) of `config`: in this process, or over tensor- or pipeline-parallel ranks
    as rank 0 of processes started here (distributed/workers.py; `exit_with_workers`: a worker's
    death ends this process, as the server's engine process wants)."""
    if config.parallel.ranks > 1 and config.lora.enabled:
        raise ValueError("LoRA adapters run on one device: not with -tp or -pp")
    if config.parallel.ranks > 1:
        from kestrel.distributed.workers import joined_rank, start_joined, start_ranks

        method = config.speculation.speculative
        if method in DRAFT_METHODS:
            raise ValueError(f"--speculative {method} runs on one device: not with -tp or -pp")
        if joined_rank() is not None:  # torchrun started every rank (other machines too)
            return start_joined(config, progress)
        return start_ranks(config, progress, exit_with_workers)
    device = resolve_device(config.model.device)
    model, tokenizer, source = load_model(config, device, progress)
    draft = load_draft(config, device, tokenizer, progress)
    return Engine(model, tokenizer, config, device, draft), source


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the prompt's `n` completions this is.
        text: the generated text.
        token_ids: the generated token ids.
        finish_reason: "stop" (end-of-sequence, a stop string or a stop id), "length"
            (max_tokens or the context) or "error".
        logprobs: with SamplingParams(logprobs=k), one {token id: log-prob} dict per generated
            token: the sampled token's and the k likeliest, from the model's raw distribution.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationResult:
    """The result of one prompt: its token ids and its `n` completions, in order."""

    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    """Load a model once; generate for many prompts with continuous batching."""

    def __init__(self, model: str = DEFAULT_MODEL, progress: bool = True, config=None, **settings):
        """`settings` are any of kestrel.config's names (max_kv_size, keep, prefill_chunk_size,
        max_num_seqs, ctx_size, dtype, device, max_batched_tokens, gpu_memory_utilization,
        cuda_graphs, block_size, shape, allowed_local_media_path, ...); or a whole `config`.
        `shape` loads random weights of a named shape instead of `model`."""
        config = config or build_config(model=model, **{"max_queue_depth": 1 << 30, **settings})
        self.config = config
        self.engine, self.source = load_engine(config, progress)
        self.model, self.tokenizer = self.engine.runner.model, self.engine.tokenizer
        self.device = self.engine.device
        if self.source is not None:  # images in chat messages, for models that take images
            limits = MediaLimits(allowed_local_media_path=config.server.allowed_local_media_path)
            self.engine.processor = load_processor(
                getattr(self.model, "multimodal", False), self.source.path, self.tokenizer, limits
            )
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (done at exit otherwise)."""
        if hasattr(self.engine, "workers"):
            self.engine.shutdown()

    def generate(
        self,
        prompts,
        params: SamplingParams | None = None,
        lora: str | None = None,
        priority: list[int] | None = None,
    ) -> list[GenerationResult]:
        """Each prompt is a string or a list of token ids; one result per prompt, in order.
        `lora`: the name of a loaded adapter (`LLM(lora_modules={name: path})` or
        `load_lora`) to generate with; None: the base model. `priority`: one per prompt
        (vLLM's), lower first, with `LLM(scheduling_policy="priority")`; None: all 0."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [encode(self.tokenizer, p) for p in prompts]
        return self._run(prompts, params or SamplingParams(), lora, priority)

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder `path` as `name` (needs enable_lora=True or
        lora_modules)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def chat(
        self, messages, params: SamplingParams | None = None, lora: str | None = None
    ) -> list[GenerationResult]:
        """One conversation (a list of {"role", "content"}) or a list of conversations. Content
        may be OpenAI parts, images among them (`image_url`) for models that take images.
        `lora`: as `generate`'s."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self._chat_prompt(c) for c in conversations]
        return self._run(prompts, params or SamplingParams(), lora)

    def _chat_prompt(self, conversation: list[dict]) -> list[int] | MultimodalPrompt:
        if image_part_params(conversation):
            return chat_prompt(self.engine.processor, conversation)
        return apply_chat_template(self.tokenizer, conversation)

    def _run(
        self,
        prompts: list[list[int] | MultimodalPrompt],
        params: SamplingParams,
        lora=None,
        priority: list[int] | None = None,
    ) -> list[GenerationResult]:
        priority = _priorities(priority, len(prompts))
        for rank in priority:  # all checked before any is queued
            self.engine.intake.check_priority(rank)
        results, outputs = [], {}
        for prompt, rank in zip(prompts, priority, strict=True):
            ids = prompt.token_ids if isinstance(prompt, MultimodalPrompt) else prompt
            result = GenerationResult(list(ids), [])
            for index in range(params.n):
                request_id = f"llm-{next(self._ids)}"
                choice = params.for_choice(index)
                self.engine.add_request(request_id, prompt, choice, lora=lora, priority=rank)
                wants_logprobs = params.logprobs is not None
                outputs[request_id] = CompletionOutput(
                    index, logprobs=[] if wants_logprobs else None
                )
                result.outputs.append(outputs[request_id])
            results.append(result)
        while self.engine.has_unfinished():
            for step in self.engine.step():
                _accumulate(outputs[step.request_id], step)
        return results


def _priorities(priority: list[int] | None, num_prompts: int) -> list[int]:
    if priority is None:
        return [0] * num_prompts
    if len(priority) != num_prompts:
        raise InvalidRequestError(
            f"priority has {len(priority)} values for {num_prompts} prompts", "priority"
        )
    return list(priority)


def _accumulate(output: CompletionOutput, step: RequestOutput) -> None:
    if step.error is not None:
        raise step.error
    output.text += step.new_text
    output.token_ids += step.new_token_ids
    if output.logprobs is not None:
        output.logprobs += step.new_logprobs
    output.finish_reason = step.finish_reason
