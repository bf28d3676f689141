"""Speculative decoding with the checkpoint's own multi-token-prediction layer (`--speculative
mtp`; models/layers/mtp.py): the draft is one decoder block that reads the target's final hidden
states, so it runs as a draft model (engine/draft.py's runner and shadow requests) fed by the
target's steps.

A request's shadow holds its tokens shifted by one: at position j the MTP layer takes the
target's hidden state h_j and token j + 1, and predicts token j + 2. Right after each target step
(the target runner's `hidden_out`) every shadow catches up, in one forward for the batch, on the
positions that step computed and kept (a verify step's accepted rows): the target's hidden states
go in as they are, and the next token of each row is known by then (the prompt, or what the step
sampled). The catch-up's last row already proposes the first token; `propose_all` chains k - 1
more rounds, each on the hidden state the layer handed on, batched across sequences. Positions
computed in those rounds took the layer's own hidden state, not the target's, so the next
catch-up steps back over them first.

A request whose earliest positions the target never computed (a prefix-cache hit) has no hidden
states for them: its shadow starts where the target's computing did, its keys before that
position masked as a trim masks them (the layer reads the context through the target's hidden
states; it only attends less far back).
"""

import torch

from kestrel.config import Config
from kestrel.engine.draft import GREEDY, DraftProposer, draft_runner
from kestrel.engine.request import Request
from kestrel.engine.scheduler import ScheduledChunk
from kestrel.models.layers.mtp import MtpDraft


class MtpProposer(DraftProposer):
    def __init__(self, runner, k: int, max_len: int):
        super().__init__(runner, k, max_len)
        self.true_end: dict[str, int] = {}  # per request: positions caught up on the target's
        self.first: dict[str, int] = {}  # per request: the catch-up's proposal
        self.inputs: dict[str, torch.Tensor] = {}  # per shadow: the hidden states it feeds next
        self.chain: dict[str, torch.Tensor] = {}  # per shadow: the (1, H) state it hands on
        runner.hidden_in = self._hidden_in
        runner.hidden_out = self._hand_on

    # -- the target's side: after each of its steps ---------------------------------------------

    def observe(self, chunks: list[ScheduledChunk], hidden: list[torch.Tensor], results) -> None:
        """Catch every shadow up on the step's chunks (`hidden`: each chunk's rows' final hidden
        states; `results`: the step's, for the tokens it sampled)."""
        by_id = {result.request.request_id: result for result in results}
        catch_up = []
        for chunk, rows in zip(chunks, hidden, strict=True):
            result = by_id.get(chunk.request.request_id)
            if result is None or result.error is not None:
                self.release(chunk.request.request_id)
                continue
            new = result.tokens or ([result.token] if result.token is not None else [])
            catch_up.append(self._follow(chunk, rows, new))
        for shadow, token in self._round(catch_up) if catch_up else []:
            if token is None:
                self.release(shadow.request_id)
            else:
                self.true_end[shadow.request_id] = shadow.num_computed
                self.first[shadow.request_id] = token

    def _follow(self, chunk: ScheduledChunk, rows: torch.Tensor, new: list[int]) -> Request:
        """The request's shadow with the chunk's kept positions pending (their hidden states in
        `inputs`)."""
        request = chunk.request
        rid, start = request.request_id, request.num_computed
        shadow = self.shadows.get(rid)
        if shadow is not None and start > self.true_end[rid]:  # recomputed from a prefix hit
            self.release(rid)
            shadow = None
        if shadow is None:
            shadow = self._start(rid, start)
        if start < shadow.num_computed:  # its drafted positions, or a recompute
            self.rollback(shadow, start)
        kept = len(new) if chunk.draft else chunk.num_tokens  # a verify step's accepted rows
        del shadow.prompt_ids[start:]
        shadow.prompt_ids += _next_tokens(request, new, start, kept)
        shadow.output_ids = []
        self.first.pop(rid, None)
        self.inputs[rid] = rows[:kept]
        return shadow

    def _start(self, request_id: str, start: int) -> Request:
        """A shadow whose keys begin at `start` (0, or where a prefix hit left the target)."""
        shadow = self.shadows[request_id] = Request(request_id, [0] * start, GREEDY, 1 << 30)
        shadow.num_computed = self.true_end[request_id] = start
        if start:  # no keys before it: masked as a trim masks them
            self.blocks.table(request_id).live_start = start
        return shadow

    # -- the scheduler's side -------------------------------------------------------------------

    def _ready(self, request: Request, m: int) -> bool:
        """Proposals only once its shadow has caught up on every position the target computed;
        the rounds then start from there."""
        rid, n = request.request_id, len(request.prompt_ids) + len(request.output_ids)
        end = self.true_end.get(rid)
        if m <= 0 or rid not in self.first or end != n - 1 or n + m > self.max_len:
            return False
        shadow = self.shadows[rid]
        if shadow.num_computed > end:  # the last rounds' positions, never verified
            self.rollback(shadow, end)
        shadow.output_ids = [self.first[rid]]
        return True

    def _head(self, request_id: str) -> list[int]:
        return [self.first[request_id]]  # the catch-up proposed the first

    def _before_round(self, active: list[Request]) -> None:
        for shadow in active:  # a round takes the hidden state the last one handed on
            self.inputs[shadow.request_id] = self.chain[shadow.request_id]

    def release(self, request_id: str) -> None:
        super().release(request_id)
        for held in (self.true_end, self.first, self.inputs, self.chain):
            held.pop(request_id, None)

    # -- the MTP runner's hooks -----------------------------------------------------------------

    def _hidden_in(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """(T, H): each chunk's rows' hidden states, in the batch's order."""
        return torch.cat([self.inputs[c.request.request_id][: c.num_tokens] for c in chunks])

    def _hand_on(self, chunks, hidden: list[torch.Tensor], results) -> None:
        """Keep each shadow's last row's hidden state for its next round."""
        for chunk, rows in zip(chunks, hidden, strict=True):
            self.chain[chunk.request.request_id] = rows[-1:].clone()


def _next_tokens(request: Request, new: list[int], start: int, n: int) -> list[int]:
    """The tokens at positions start + 1 .. start + n of the request's sequence, whose known
    tokens (prompt, then output) the step's sampled tokens `new` extend."""
    prompt, output = request.prompt_ids, request.output_ids
    tokens = []
    for j in range(start + 1, start + n + 1):
        if j < len(prompt):
            tokens.append(prompt[j])
        elif j - len(prompt) < len(output):
            tokens.append(output[j - len(prompt)])
        else:
            tokens.append(new[j - len(prompt) - len(output)])
    return tokens


def mtp_proposer(model, device: torch.device, config: Config, max_len: int) -> MtpProposer:
    """The proposer over the target's MTP layer (loaded with it: loading.load_model)."""
    runner = draft_runner(MtpDraft(model), device, config, max_len, keep_hidden=True)
    return MtpProposer(runner, config.speculation.num_speculative_tokens, max_len)
