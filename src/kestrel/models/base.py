"""What every model family provides to the runner and the loaders."""

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec, KVShape, StateShape, kv_bytes
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.rope import LongRotaryEmbedding


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE dict of transformers >= 5 (`rope_parameters`, per layer type when nested)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    if "rope_theta" not in params:
        params = {**params, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    return params


def head_dim(config) -> int:
    """Attention head size: the config's `head_dim`, else hidden_size / heads (older configs)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Slot:
    """Part of a parameter that one checkpoint tensor fills: `param[index]` (of the parameter
    viewed as `view`, when given), the tensor's last two dims swapped first when `transpose` (e.g.
    expert 3's gate rows of a stacked (E, 2I, H) weight; MLA's per-head keys in its (H, dn + dv,
    r) `kv_b_proj`). An `index` led by `slice(None)` takes a stack of parts (every expert, every
    head). `checkpoint_name` may return a Slot instead of a name; a parameter counts as loaded
    once its slots cover it."""

    name: str
    index: tuple = ()
    transpose: bool = False
    view: tuple = ()

    def of(self, param: torch.Tensor) -> torch.Tensor:
        """The part of `param` this slot fills."""
        return (param.view(self.view) if self.view else param)[self.index]

    def parts(self, count: int) -> list["Slot"]:
        """A stack's slot (`index` led by `slice(None)`) as one slot per part."""
        return [dataclasses.replace(self, index=(i, *self.index[1:])) for i in range(count)]


class CausalLM(nn.Module):
    """A decoder-only model: `forward(batch)` returns logits (R, V) for `batch.logits_rows`, in
    two parts the runner also calls apart: `hidden(batch)`, the final-norm hidden states (R, H) of
    those rows (what embeddings pool), and `logits(hidden)`, the head over them.

    Families keep Hugging Face parameter names so checkpoints load without renaming; GGUF quirks
    live in `gguf_tensor` (e.g. undoing llama.cpp's Q/K row permutation).
    """

    # True for families that serve images too: they get the checkpoint's whole config (with its
    # vision_config), not just the nested text_config the text families read
    multimodal = False
    # the decoder stack (HF's `model.` prefix). When set, the head is built here (a vocabulary
    # projection, tied to the embeddings when the config says so) and forward = head(stack(batch))
    backbone: type[nn.Module] | None = None
    # submodules every tensor-parallel rank keeps whole (a vision tower: small next to the
    # decoder, and run once per image, not per token)
    replicated: tuple[str, ...] = ()
    # set on a pipeline stage (distributed/pipeline.py): its [first, end) decoder layers, whose
    # KV alone its pool holds, and what runs micro-batches through the stages (`StageOutputs`)
    stage_layers: tuple[int, int] | None = None
    pipeline = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        if self.backbone is not None:
            self.model = self.backbone(config)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            self.tie_weights()
        if getattr(config, "with_mtp", False):  # weights.loader.build_model(mtp=True)
            self.mtp = self.next_token_predictor()

    def cache_specs(self) -> list[CacheSpec]:
        """One spec per layer: what each layer keeps per sequence."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits(self.hidden(batch))

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """(R, H) final-norm hidden states of `batch.logits_rows`: the head's input. A pipeline
        stage's are the last stage's, which every rank receives."""
        if self.pipeline is not None:
            return self.pipeline([batch])[0]
        return self.decoder_hidden(batch)

    def decoder_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """`hidden` as this process's decoder computes it (a pipeline stage: its layers, with
        their sends and receives); families whose decoder sits elsewhere override this."""
        return self.model(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) hidden states -> (R, V) logits."""
        return self.lm_head(hidden)

    def next_token_predictor(self) -> nn.Module:
        """The checkpoint's multi-token-prediction layer (models/layers/mtp.py), to be loaded as
        `mtp.*`; families whose checkpoints carry one build it."""
        raise ValueError(
            f"--speculative mtp: {self.config.model_type} checkpoints carry no multi-token "
            "prediction layer (EXAONE-MoE and GLM-4.x-Flash do)"
        )

    def checkpoint_name(self, name: str) -> str | Slot | None:
        """Map a checkpoint tensor name to a parameter name or a `Slot` (None: not ours, skip it)."""
        return name

    def gguf_names(self, table) -> dict[str, str]:
        """GGUF tensor name -> the checkpoint name it loads as, through gguf's name table
        (`gguf.TensorNameMap`) over our parameter names; families add what the table lacks.
        llama.cpp names every tensor with a suffix: a parameter without one (stacked experts,
        scalars) is stored as `<name>.weight`."""
        names = {}
        for name, _ in self.named_parameters(remove_duplicate=False):
            gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is not None:
                suffixed = gguf_name.endswith((".weight", ".bias"))
                names[gguf_name if suffixed else gguf_name + ".weight"] = name
        return names

    @classmethod
    def config_from_gguf(cls, meta):
        """The config of a GGUF file (`weights.gguf.GGUFMetadata`), for families whose
        architecture transformers cannot read (listed in `weights.gguf.FAMILY_CONFIGS`)."""
        raise NotImplementedError

    @classmethod
    def complete_gguf_config(cls, config, meta):
        """Complete the config transformers read from a GGUF file with what llama.cpp's converter
        writes but transformers drops, or leaves out because llama.cpp derives it."""
        return config

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's conversion of one tensor (named with our parameter name). A weight kept
        packed on the CPU (GGUF blocks) takes only a reorder of its rows: the loader finds it by
        passing row ids (rows, 1) through this hook; a hook that changes values gets the weight
        dequantized at load instead."""
        return tensor

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Fix the layout of one Hugging Face checkpoint tensor (named with our parameter name)."""
        return tensor

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False) and hasattr(self, "lm_head"):
            self.lm_head.weight = self.model.embed_tokens.weight

    def kv_layout(self) -> list[KVShape | None]:
        """Per layer, what it stores per token, as its attention module says (`kv_shape`: its own
        head count and size, or the heads a tensor-parallel rank holds); None for a layer that
        stores none (recurrent state, linear or no-op attention, a layer that reads another's
        cache, a layer another pipeline stage holds). The paged pool allocates each layer by it."""
        layout: list[KVShape | None] = [None] * len(self.cache_specs())
        first, end = self.stage_layers or (0, len(layout))
        for module in self.model.modules():
            if hasattr(module, "kv_shape") and first <= module.layer_idx < end:
                layout[module.layer_idx] = module.kv_shape()
        return layout

    def state_layout(self) -> list[StateShape | None]:
        """Per layer, the recurrent state it keeps per sequence (None: none); the paged runner's
        state pool allocates each layer by it."""
        layout: list[StateShape | None] = [None] * len(self.cache_specs())
        for module in self.modules():
            if hasattr(module, "state_shape"):
                layout[module.layer_idx] = module.state_shape()
        return layout

    def chunk_invariant_tokens(self) -> int | None:
        """Sequences of at most this many tokens get the same keys however their prompt is cut
        into chunks, so a prefix hit changes nothing (None: any length). Past its original
        context LongRoPE picks its factors per chunk."""
        limits = [m.original_max for m in self.modules() if isinstance(m, LongRotaryEmbedding)]
        return min(limits, default=None)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV cache one token costs across all layers (for `inspect` and pool sizing)."""
        return kv_bytes(self.kv_layout(), torch.finfo(dtype).bits // 8)
