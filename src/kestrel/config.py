"""Every setting of kestrel, in typed dataclasses, built once by `build_config` from the command
line (and llama-server's environment variables, through the flags' defaults) or from `LLM(...)`'s
keyword arguments. One name per concept: each field name is unique across the sections, so a flat
set of names (a flag's `dest`, a keyword argument) says where each value goes. Plain Python: the
scheduler reads its part without importing torch.
"""

import math
from dataclasses import MISSING, dataclass, field, fields

from kestrel.errors import InvalidRequestError
from kestrel.weights.embedded import DEFAULT_MODEL

SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
SCHEDULING_POLICIES = ("fcfs", "priority")  # engine/policy.py
# methods that run a draft beside the model: in the engine of one process, on one device
DRAFT_METHODS = ("draft", "mtp")


@dataclass
class ModelConfig:
    """What to load, and where to run it."""

    model: str = DEFAULT_MODEL  # an alias, a .gguf file, a Hugging Face folder or repo
    shape: str | None = None  # random weights of a named shape instead (benchmarks)
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on CUDA
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    ctx_size: int | None = None  # context length; None: the model's max_position_embeddings
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs
    pooling: str = "last"  # embeddings pool the final-norm states: "last" token's or "mean"
    quantized_weights: str = "auto"  # GGUF blocks: "keep" packed, "dequantize" at load, or auto


@dataclass
class CacheConfig:
    """Each sequence's KV bound, and the GPU's paged KV pool."""

    max_kv_size: int | None = None  # per-sequence KV bound in tokens; None: off
    keep: int = 4  # sink tokens kept at the front when trimming
    block_size: int = 64  # tokens per block of the paged pool
    gpu_memory_utilization: float = 0.9  # of the card, for weights, activations and the pool
    num_blocks: int | None = None  # a fixed pool size (tests); None: sized from free memory
    prefix_caching: bool = True  # full KV blocks are kept and reused by later prompts
    mamba_ssm_cache_dtype: str = "float32"  # the hybrids' SSM state (bfloat16: half the traffic)
    kv_cache_dtype: str = "auto"  # the KV pool's: auto (the model's), bfloat16, float16, fp8
    # GiB of host memory that keeps prefix-cache blocks the pool evicts (vLLM's name); 0: off
    kv_offloading_size: float = 0

    def __post_init__(self):
        size = self.kv_offloading_size
        number = isinstance(size, int | float) and not isinstance(size, bool)
        if not number or not (size >= 0 and math.isfinite(size)):
            raise InvalidRequestError(
                f"must be a number of GiB >= 0 (0: off), got {size!r}", param="kv_offloading_size"
            )


@dataclass
class SchedulerConfig:
    """Continuous batching (engine/scheduler.py)."""

    max_num_seqs: int = 8  # running sequences (-np/--parallel)
    prefill_chunk_size: int = 512
    max_queue_depth: int = 64  # requests the scheduler holds beyond the running ones
    max_batched_tokens: int | None = None  # default: one chunk plus one token per running sequence
    kv_capacity: int | None = None  # KV tokens all running sequences may hold; None: unlimited
    scheduling_policy: str = "fcfs"  # or "priority": requests' `priority`, lower first
    # priority: a request's effective priority improves by 1 per this many seconds since it
    # arrived, so none waits forever; None: never (strict priorities)
    priority_aging_interval: float | None = 10.0

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                f"unknown policy {self.scheduling_policy!r}; supported: "
                f"{', '.join(SCHEDULING_POLICIES)}",
                param="scheduling_policy",
            )
        interval = self.priority_aging_interval
        if interval is not None and not (isinstance(interval, int | float) and interval > 0):
            raise InvalidRequestError(
                f"must be a positive number of seconds, got {interval!r}",
                param="priority_aging_interval",
            )

    @property
    def token_budget(self) -> int:
        return self.max_batched_tokens or self.prefill_chunk_size + self.max_num_seqs


@dataclass
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py): propose up to `num_speculative_tokens`
    tokens per decode and verify them in one forward; the output is unchanged."""

    # "ngram" (prompt lookup), "draft" (a model), "mtp" (the checkpoint's MTP layer); None: off
    speculative: str | None = None
    num_speculative_tokens: int = 5  # most tokens proposed per step
    ngram_min: int = 2  # shortest n-gram matched...
    ngram_max: int = 4  # ...and longest (tried first)
    draft_model: str | None = None  # "draft": the proposing model (a shape name with --shape)

    def __post_init__(self):
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise InvalidRequestError(
                f"unknown method {self.speculative!r}; supported: {', '.join(SPECULATIVE_METHODS)}",
                param="speculative",
            )
        for name in ("num_speculative_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 64:
                raise InvalidRequestError(f"must be an integer in [1, 64], got {value!r}", name)
        if self.speculative == "draft" and not self.draft_model:
            raise InvalidRequestError("--speculative draft needs a --draft-model", "draft_model")
        if self.draft_model and self.speculative != "draft":
            raise InvalidRequestError("only used with --speculative draft", "draft_model")
        if self.ngram_min > self.ngram_max:
            raise InvalidRequestError(
                f"must be at most --ngram-max ({self.ngram_max}), got {self.ngram_min}",
                "ngram_min",
            )


@dataclass
class ParallelConfig:
    """How the work is spread over the machine."""

    threads: int = 0  # CPU threads; 0: torch's default
    tensor_parallel_size: int = 1  # ranks (processes, one device each) sharing every layer
    pipeline_parallel_size: int = 1  # ranks each holding a range of the layers (stages)
    pp_layers: str | None = None  # the stages' layer ranges, "0-15,16-31"; None: even
    # the fewest tokens of a pipeline micro-batch (a step of more is cut into up to 2 per stage,
    # so the stages overlap); None: 128 on CUDA, 16 on the CPU
    pp_microbatch_tokens: int | None = None
    enable_expert_parallel: bool = False  # with -tp: whole experts per rank, not slices of each
    data_parallel_size: int = 1  # serve: engine replicas (Ray actors) behind the one endpoint
    ray_address: str | None = None  # the Ray cluster of the replicas; None: a local one
    # serve: a prefill engine and a decode engine, the KV handed from one to the other
    # (distributed/disaggregated.py); their devices, None: --device's, and for decode the next
    # GPU when there is one
    disaggregate: bool = False
    prefill_device: str | None = None
    decode_device: str | None = None

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"must be >= 1, not {value!r}", name)
        for name in ("pp_layers", "pp_microbatch_tokens"):
            if getattr(self, name) and self.pipeline_parallel_size == 1:
                raise InvalidRequestError("only used with --pipeline-parallel-size", name)
        if self.ray_address and self.data_parallel_size == 1:
            raise InvalidRequestError("only used with --data-parallel-size", "ray_address")
        if self.pp_microbatch_tokens is not None and self.pp_microbatch_tokens < 1:
            raise InvalidRequestError(
                f"must be >= 1, not {self.pp_microbatch_tokens!r}", "pp_microbatch_tokens"
            )
        self._check_disaggregate()
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise InvalidRequestError(
                "experts spread over the --tensor-parallel-size ranks: set it above 1",
                "enable_expert_parallel",
            )

    def _check_disaggregate(self) -> None:
        for name in ("prefill_device", "decode_device"):
            if getattr(self, name) and not self.disaggregate:
                raise InvalidRequestError("only used with --disaggregate", name)
        sizes = {
            "-tp/--tensor-parallel-size": self.tensor_parallel_size,
            "-pp/--pipeline-parallel-size": self.pipeline_parallel_size,
            "-dp/--data-parallel-size": self.data_parallel_size,
        }
        taken = [flag for flag, size in sizes.items() if size > 1]
        if self.disaggregate and taken:
            raise InvalidRequestError(
                f"--disaggregate runs one prefill and one decode engine on one device each: "
                f"not with {', '.join(taken)}",
                "disaggregate",
            )

    @property
    def ranks(self) -> int:
        """Processes the model is split over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class LoRAConfig:
    """LoRA adapters beside the base model (kestrel.lora): adapters named at start, and slots
    on the device for up to `max_loras` of them in one batch."""

    enable_lora: bool = False  # adapters may be loaded (on with any lora_modules)
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter folder
    max_loras: int = 4  # adapters in one batch (device slots)
    max_lora_rank: int = 16  # the largest rank an adapter may have

    def __post_init__(self):
        if isinstance(self.lora_modules, list | tuple):  # ["name=path", ...] from the CLI
            self.lora_modules = dict(_name_path(item) for item in self.lora_modules)
        self.lora_modules = dict(self.lora_modules or {})
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1024:
                raise InvalidRequestError(f"must be an integer in [1, 1024], got {value!r}", name)

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


def _name_path(item: str) -> tuple[str, str]:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise InvalidRequestError(f"expected name=path, got {item!r}", "lora_modules")
    return name, path


@dataclass
class ServerConfig:
    """`kestrel serve` only."""

    model_name: str = DEFAULT_MODEL  # the id /v1/models lists
    aliases: set[str] = field(default_factory=set)  # other names `model` may use
    api_key: str | None = None
    slots: bool = False  # GET /slots answers (llama-server's --slots); off: 501
    allowed_origins: list[str] = field(default_factory=list)
    allowed_local_media_path: str | None = None  # file:// images only under this folder
    default_max_tokens: int | None = None
    exit_on_engine_failure: bool = True
    max_request_bytes: int = 8 * 2**20  # larger bodies: 413 before they are read whole
    client_timeout: float = 30.0  # seconds a client has to send its request head, and its body
    restart_engine: bool = True  # a dead engine is restarted (up to the limit below)
    max_engine_restarts: int = 3  # restarts allowed within engine_restart_window...
    engine_restart_window: float = 600.0  # ...seconds; one more and the server gives up
    tool_call_parser: str = "auto"  # the tool-call syntax (server/tools/parsers.py); auto: detected
    reasoning_parser: str = "auto"  # the thinking's markers (server/reasoning.py); auto: detected


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(Config)}


def default_of(name: str):
    """The default of setting `name`, written once in its section above; the flags take theirs
    from here. Raises KeyError for a name no section has."""
    for section in SECTIONS.values():
        for f in fields(section):
            if f.name == name:
                return f.default if f.default is not MISSING else f.default_factory()
    raise KeyError(name)


# 0 means "off" on the command line (llama-server's habit) for these
ZERO_IS_NONE = {"ctx_size", "max_kv_size", "kv_capacity", "priority_aging_interval"}


def build_config(**values) -> Config:
    """The Config these named values describe (field names of any section); the rest default.
    Raises TypeError naming an unknown name."""
    owner = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}
    unknown = sorted(set(values) - set(owner))
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(unknown)}")
    parts: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        parts[owner[key]][key] = None if key in ZERO_IS_NONE and value == 0 else value
    return Config(**{name: cls(**parts[name]) for name, cls in SECTIONS.items()})


def config_from_args(args, **overrides) -> Config:
    """The Config of parsed flags: every flag whose dest names a setting, then `overrides`."""
    names = {f.name for cls in SECTIONS.values() for f in fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names and v is not None}
    return build_config(**{**values, **overrides})
