"""Multi-token prediction (MTP) layers, the extra layer some checkpoints train next to the decoder
(DeepSeek-V3's design; EXAONE-MoE and GLM-4.x-Flash ship one), which `--speculative mtp`
proposes with (engine/mtp.py).

At position i the layer takes the decoder's final hidden state h_i and the embedding of the next
token t_(i+1), RMS-norms each, projects them side by side back to the hidden size and runs one
more decoder block of the family; the model's head over its normed output predicts t_(i+2). For
more than one proposal it is chained: its own hidden state at i stands in for the decoder's at
i + 1, next to the token it just proposed. Its block keeps its own KV cache (one layer, in a pool
of its own), so it attends over every earlier position as the decoder's layers do.

The layer loads as the model's `mtp` child (built only when asked for: `with_mtp`), then moves
into an `MtpDraft`, the draft model the engine runs, which shares the decoder's embeddings, head
and rotary table.
"""

import torch
from torch import nn

from kestrel.cache.sequence import CacheSpec, KVShape
from kestrel.models.base import CausalLM
from kestrel.models.batch import ForwardBatch
from kestrel.models.layers.linear import Linear
from kestrel.models.layers.norm import RMSNorm


class MultiTokenPredictor(nn.Module):
    """`block` (a decoder block of the family, built as layer 0 of its own cache) behind the
    normed-and-projected pair (embedding, hidden state). As each family's reference
    implementation (vLLM's) runs it: `chain_normed`, the hidden state it hands its next round is
    its normed output (EXAONE-MoE) rather than the block's (DeepSeek's layout: GLM);
    `blank_first`, position 0 takes a zero embedding (DeepSeek's)."""

    def __init__(
        self, config, block: nn.Module, spec: CacheSpec, chain_normed: bool, blank_first: bool
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_norm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.proj = Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.norm = RMSNorm(hidden, eps)
        self.spec, self.chain_normed, self.blank_first = spec, chain_normed, blank_first

    def forward(self, embeds, hidden, batch: ForwardBatch, cos_sin):
        """(T, H) embeddings of the next tokens and (T, H) hidden states -> (T, H) normed output
        (the head's input) and (T, H) the hidden state its next round takes."""
        if self.blank_first:
            embeds = torch.where(batch.positions[:, None] == 0, 0.0, embeds)
        x = self.proj(torch.cat([self.embed_norm(embeds), self.hidden_norm(hidden)], dim=-1))
        x = self.block(x, batch, cos_sin)
        out = self.norm(x)
        return out, out if self.chain_normed else x


def predictor_name(name: str, own: dict[str, str | None], block: str) -> str | None:
    """A checkpoint name inside the MTP layer (its prefix removed) -> our `mtp.*` name: `own`
    maps the layer's own tensors (None: a copy of the model's embeddings or head, shared
    instead), names under `block` belong to its decoder block; None for anything else."""
    for theirs, ours in own.items():
        if name == theirs or name.startswith(theirs + "."):
            return None if ours is None else "mtp." + ours + name[len(theirs) :]
    if name.startswith(block):
        return "mtp.block." + name[len(block) :]
    return None


def final_norm(norm: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A decoder's last step: the final norm of the rows whose logits are wanted. With
    `batch.keep_hidden` (an MTP draft follows) every row is normed and kept in `batch.hidden`."""
    if batch.keep_hidden:
        batch.hidden = norm(x)
        return batch.hidden[batch.logits_rows]
    return norm(x[batch.logits_rows])


class MtpDraft(CausalLM):
    """The draft model of `--speculative mtp`: the target's predictor with the target's
    embeddings, head and rotary table. Its batches carry `prev_hidden`, each row's hidden state
    (the target's, or its own from the previous round); with `keep_hidden` it leaves the hidden
    state each row hands on in `batch.hidden`."""

    takes_hidden = True  # the paged runner fills `prev_hidden` (engine/paged_runner.py)

    def __init__(self, target: CausalLM):
        nn.Module.__init__(self)  # not CausalLM's: it would build another predictor
        self.config = target.config
        if not hasattr(target, "mtp"):
            raise ValueError("--speculative mtp: the model was loaded without its MTP layer")
        self.predictor = target.mtp
        del target.mtp  # the target no longer holds (or runs) it
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.rotary_emb = target.model.rotary_emb
        self.kv_shape = next(shape for shape in target.kv_layout() if shape)  # every layer's

    def cache_specs(self) -> list[CacheSpec]:
        return [self.predictor.spec]

    def kv_layout(self) -> list[KVShape]:
        return [self.kv_shape]

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        embeds = self.embed_tokens(batch.input_ids)
        cos_sin = self.rotary_emb(batch.positions)
        out, chain = self.predictor(embeds, batch.prev_hidden, batch, cos_sin)
        if batch.keep_hidden:
            batch.hidden = chain
        return out[batch.logits_rows]
