"""What a runner is: the reference runner and the paged runner are siblings under `Runner` (the
reference is the oracle the paged runner is tested against, so nothing that serves inherits its
code), a runner never holds or writes the block manager (it reads the tables the scheduler hands
it), and both give models the same batch."""

import ast
import inspect
from pathlib import Path

import torch

import kestrel.engine
from kestrel.cache.blocks import BlockManager
from kestrel.cache.sequence import CacheSpec, SequenceCache
from kestrel.config import CacheConfig
from kestrel.engine.draft import DraftRunner
from kestrel.engine.paged_runner import PagedRunner
from kestrel.engine.reference_runner import ModelRunner
from kestrel.engine.request import Request
from kestrel.engine.runner import Runner, run_step
from kestrel.models.batch import ForwardBatch, SeqChunk
from kestrel.sampling import SamplingParams
from test_paged_cache import prompts, scheduler_for, tiny_model

ENGINE = Path(inspect.getfile(kestrel.engine)).parent


def class_bases() -> dict[str, set[str]]:
    """Every class defined in src/kestrel/engine: its bases' names as written."""
    bases = {}
    for path in ENGINE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    return bases


def test_no_engine_class_inherits_from_the_reference_runner():
    inheriting = [name for name, bases in class_bases().items() if "ModelRunner" in bases]
    assert inheriting == []


def test_the_paged_and_reference_runners_share_only_the_runner_base():
    assert ModelRunner.__bases__ == (Runner,) and PagedRunner.__bases__ == (Runner,)
    assert ModelRunner not in DraftRunner.__mro__


def test_the_paged_runner_reads_the_tables_the_scheduler_hands_it():
    """Through steps with trims and finished requests: the runner holds no block manager, each
    of its caches reads the scheduler's table, and every block comes back."""
    model = tiny_model("llama")
    cache = CacheConfig(block_size=4, num_blocks=32)
    runner = PagedRunner(model, torch.device("cpu"), 4, 16, 256, cache, cuda_graphs=False)
    scheduler = scheduler_for(runner, max_num_seqs=4, prefill_chunk_size=4)
    for i, prompt in enumerate(prompts(10, 5)):
        scheduler.add(Request(f"t{i}", prompt, SamplingParams(temperature=0), 6, 9, 1))
    while scheduler.has_work():
        for result in run_step(scheduler, runner):
            if result.token is not None:
                result.request.output_ids.append(result.token)
                if len(result.request.output_ids) == 6:
                    result.request.finish("length")
        for request_id, held in runner.caches.items():
            assert held.blocks is scheduler.blocks.tables[request_id]
        for request in scheduler.remove_finished():
            runner.release(request.request_id)
    assert scheduler.blocks.tokens_trimmed > 0  # the case this test is about happened
    assert not any(isinstance(value, BlockManager) for value in vars(runner).values())
    assert scheduler.blocks.num_free == 31 and not runner.caches


def test_a_batch_of_dense_chunks_has_the_per_row_fields_the_paged_runner_packs():
    """Models read one batch type: chunks over dense caches give every row its RoPE id
    (position + rope_delta), its chunk's last position and its recurrent-state group."""
    first, second = SequenceCache([CacheSpec()]), SequenceCache([CacheSpec()])
    second.rope_delta = -2  # a multimodal sequence's text rows
    positions = torch.tensor([5, 6, 7, 9])
    chunks = [SeqChunk(first, 0, 3), SeqChunk(second, 3, 1)]
    batch = ForwardBatch(torch.zeros(4, dtype=torch.long), positions, chunks, torch.tensor([2, 3]))
    assert batch.rope_positions.tolist() == [5, 6, 7, 7]
    assert batch.chunk_ends.tolist() == [7, 7, 7, 9]
    assert batch.images is None and batch.attention is None
    groups = [(rows.tolist(), states.caches) for rows, states in batch.state_groups]
    assert groups == [([[0, 1, 2]], [first]), ([[3]], [second])]
