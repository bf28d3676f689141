"""Tensor and pipeline parallel serving: one process per rank, every rank running the same Engine
in lockstep.

Rank 0 is the process that asked for the engine (the server's engine process, an `LLM`, a
benchmark). It starts ranks 1..N-1 as fresh interpreters, each with a pipe to it. Every rank
loads the model, keeps its shard (tensor_parallel.py) or its stage's layers (pipeline.py) and
builds the same Engine over a KV pool of the same size; rank 0's `LockstepEngine` sends each call
that changes what an engine holds (add, abort, step) down the pipes before it runs the call
itself. So every rank's scheduler, a replica fed the same inputs, plans the same steps, every
forward's collectives meet, and no block table crosses a pipe. The logits are whole on every rank
(gathered, or the head applied to the last stage's hidden states) and a sampled request gets one
seed for all of them, so every rank samples the same tokens; only rank 0's outputs go anywhere.

Several machines: when torchrun (or the standard RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
variables) started every rank, each machine runs the same command; rank 0's calls then reach the
others as broadcasts over a gloo group (`GroupWorkers`) instead of pipes, and the other ranks run
them (`follow_joined`, from the command line) until rank 0 is gone.

Startup: ranks load first and join the process group only once all have loaded, so a rank that
fails to load is reported by rank and cause rather than as a rendezvous timeout. Failure after
that: a worker that exits makes rank 0's next send fail, and in the server's engine process
(`exit_with_workers`) ends it within a fraction of a second (the server then answers 503 and
restarts the engine or exits); a collective that a hung rank never joins fails after
`COLLECTIVE_TIMEOUT_S`; a worker whose rank 0 is gone exits.
"""

import atexit
import contextlib
import gc
import logging
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from kestrel.config import Config
from kestrel.distributed.group import TPGroup, join, leave
from kestrel.distributed.pipeline import other_stages_parameters, split_stages, stage_of
from kestrel.distributed.tensor_parallel import load_sharded, use_stage_groups
from kestrel.engine.engine import Engine
from kestrel.engine.request import Request
from kestrel.loading import load_model, resolve_device

log = logging.getLogger("kestrel.distributed")

# a collective that some rank does not join within this long fails on the others (a hung rank)
COLLECTIVE_TIMEOUT_S = 60.0


class LockstepEngine(Engine):
    """Rank 0's Engine: every add, abort and step goes to the workers' engines first."""

    def __init__(self, model, tokenizer, config: Config, device, workers: "Workers"):
        super().__init__(model, tokenizer, config, device)
        self.workers = workers

    def add(self, request: Request) -> None:
        if request.params.seed is None and not request.params.greedy:
            # every rank must draw the same tokens: one seed, chosen here, for all of them
            request.params = replace(request.params, seed=random.getrandbits(63))
        self.workers.send("add", request)
        super().add(request)

    def abort(self, request_id: str) -> bool:
        self.workers.send("abort", request_id)
        return super().abort(request_id)

    def step(self):
        self.workers.send("step")
        return super().step()

    def shutdown(self) -> None:
        """Stop the workers, leaving the process group together with them (at exit, if not
        before)."""
        self.workers.stop(leave)


def start_ranks(config: Config, progress: bool, exit_with_workers: bool):
    """(rank 0's LockstepEngine, source): the workers started, every rank loaded and joined,
    and every rank's KV pool of the same size (the smallest any rank sized)."""
    size = config.parallel.ranks
    address = f"tcp://127.0.0.1:{_free_port()}"
    workers = Workers(config, size, address)
    try:
        model, tokenizer, source, device = load_shard(config, 0, size, progress)
        workers.wait("loaded")
        join(0, size, device, address, COLLECTIVE_TIMEOUT_S)
        use_stage_groups(model, 0, config.parallel)
        build = lambda c: LockstepEngine(model, tokenizer, c, device, workers)  # noqa: E731
        engine = build(config)
        workers.wait("ready")  # every engine built (a rank that died says so here)
        engine = _on_smallest_pool(engine, build, device)
        workers.wait("sized")
    except BaseException:
        workers.stop()
        leave()
        raise
    if exit_with_workers:
        workers.watch()
    atexit.register(engine.shutdown)
    kind = "pipeline" if config.parallel.pipeline_parallel_size > 1 else "tensor"
    log.info("%s parallel: %d ranks on %s", kind, size, device.type)
    return engine, source


def _on_smallest_pool(engine: Engine, build, device: torch.device) -> Engine:
    """`engine`, rebuilt by `build` over the smallest KV pool any rank sized (a collective: every
    rank calls it). The schedulers are replicas: they must plan with one pool."""
    blocks = engine.scheduler.blocks.num_blocks
    if blocks is None:  # one-token blocks without a bound, alike on every rank
        return engine
    smallest = torch.tensor([blocks], device=device)
    dist.all_reduce(smallest, dist.ReduceOp.MIN)
    return _on_fewest_host_slots(_resized(engine, int(smallest), build), device)


def _on_fewest_host_slots(engine: Engine, device: torch.device) -> Engine:
    """`engine` with its prefix cache's host tier (--kv-offloading-size) limited to the fewest
    slots any rank's GiB holds (a collective): pipeline stages size theirs from their own layers,
    and the replica schedulers must offload alike."""
    host = engine.scheduler.blocks.host
    if host is not None:  # the same flags on every rank: all have one, or none
        fewest = torch.tensor([host.num_slots], device=device)
        dist.all_reduce(fewest, dist.ReduceOp.MIN)
        host.limit(int(fewest))
    return engine


def _resized(engine: Engine, blocks: int, build) -> Engine:
    """`engine`, or when its pool holds more than `blocks` blocks, one `build` makes anew over a
    pool of `blocks` (the old one freed first)."""
    if engine.scheduler.blocks.num_blocks == blocks:
        return engine
    config = engine.config
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return build(replace(config, cache=replace(config.cache, num_blocks=blocks + 1)))  # + scratch


def load_shard(config: Config, rank: int, size: int, progress: bool, local_rank: int | None = None):
    """(model, tokenizer, source, device): the model loaded on this rank's device (GPU
    `local_rank` of its machine; by default its rank), cut to this rank's shard (one layer at a
    time: tensor_parallel.load_sharded) or stage (only its layers' weights are read)."""

    device = resolve_device(config.model.device)
    if device.type == "cuda":
        device = torch.device(
            "cuda", (device.index or 0) + (rank if local_rank is None else local_rank)
        )
        torch.cuda.set_device(device)
    elif not config.parallel.threads:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    par = config.parallel
    tp_size, pp_size = par.tensor_parallel_size, par.pipeline_parallel_size
    stage = rank // tp_size
    if tp_size == 1:  # a stage reads only its layers' weights
        select = other_stages_parameters(stage, pp_size, par.pp_layers)
        model, tokenizer, source = load_model(config, device, progress, select)
    else:  # one layer at a time (of its stage's), each cut to this rank's shard once it is in
        tp, ep = TPGroup(rank % tp_size, tp_size), par.enable_expert_parallel
        layers = None
        if pp_size > 1:
            layers = lambda model: stage_of(model, stage, pp_size, par.pp_layers).layers  # noqa: E731
        model, tokenizer, source = load_sharded(config, device, tp, ep, progress, layers)
    if pp_size > 1:
        split_stages(model, rank, pp_size, par.pp_layers, tp_size)
    gc.collect()  # the whole weights the shard was cut from
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, tokenizer, source, device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Ranks 1..N-1 as child processes, a pipe to each."""

    def __init__(self, config: Config, size: int, address: str):
        self.processes: list[subprocess.Popen] = []
        self.pipes: list[Connection] = []
        self._watching = False
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            ours, theirs = socket.socketpair()
            entry = f"from kestrel.distributed.workers import worker_main; worker_main({theirs.fileno()})"
            process = subprocess.Popen([sys.executable, "-c", entry], pass_fds=[theirs.fileno()])
            theirs.close()
            self.processes.append(process)
            self.pipes.append(Connection(ours.detach()))
            _send(self.pipes[-1], (config, rank, size, address, level))

    def send(self, *message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, pipe in enumerate(self.pipes, 1):
            try:
                pipe.send_bytes(data)
            except OSError as error:
                self._lost(rank)
                raise RuntimeError(f"tensor-parallel rank {rank} {self._status(rank)}") from error

    def wait(self, kind: str) -> list:
        """Each worker's next message, which must be `kind`; raises naming the rank that failed
        or exited instead."""
        payloads = []
        for rank, pipe in enumerate(self.pipes, 1):
            while not pipe.poll(0.2):
                if self.processes[rank - 1].poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} {self._status(rank)} while starting"
                    )
            try:
                got, *payload = _receive(pipe)
            except EOFError:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} {self._status(rank)} while starting"
                ) from None
            if got != kind:  # "failed", with the rank's error
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {payload[0]}")
            payloads.extend(payload)
        return payloads

    def _status(self, rank: int) -> str:
        process = self.processes[rank - 1]
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(1.0)
        code = process.poll()
        return "is running" if code is None else f"exited (code {code})"

    def watch(self) -> None:
        """End this process as soon as a worker exits (the server's engine process: the server
        then sees its engine die and answers 503 rather than failing requests one by one)."""
        self._watching = True

        def run() -> None:
            while self._watching:
                for rank, process in enumerate(self.processes, 1):
                    if process.poll() is not None:
                        self._lost(rank)
                time.sleep(0.1)

        threading.Thread(target=run, name="kestrel-tp-watch", daemon=True).start()

    def _lost(self, rank: int) -> None:
        """A worker is gone: when watching, this process ends with it."""
        if self._watching:
            log.critical(
                "tensor-parallel rank %d %s: the engine exits with it", rank, self._status(rank)
            )
            sys.stderr.flush()
            os._exit(1)

    def stop(self, leaving=lambda: None, timeout: float = 10.0) -> None:
        """Send "stop", run `leaving()` while the workers leave too, then wait for them (and
        kill the ones that do not exit within `timeout`)."""
        self._watching = False
        with contextlib.suppress(RuntimeError):
            self.send("stop")
        leaving()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in self.pipes:
            pipe.close()
        self.processes, self.pipes = [], []


# -- a worker ---------------------------------------------------------------------------------


def worker_main(fd: int) -> None:
    """Rank r: load and shard, join, build the Engine, then run what rank 0 sends until "stop"
    or until rank 0 is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    _exit_with_parent()
    pipe = Connection(fd)
    config, rank, size, address, level = _receive(pipe)
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s"
    )
    try:
        model, tokenizer, _, device = load_shard(config, rank, size, progress=False)
        _send(pipe, ("loaded",))
        join(rank, size, device, address, COLLECTIVE_TIMEOUT_S)
        use_stage_groups(model, rank, config.parallel)
        build = lambda c: Engine(model, tokenizer, c, device)  # noqa: E731
        engine = build(config)
        _send(pipe, ("ready",))
        engine = _on_smallest_pool(engine, build, device)
        _send(pipe, ("sized",))
    except BaseException as error:
        log.exception("rank %d failed to start", rank)
        with contextlib.suppress(OSError):
            _send(pipe, ("failed", f"{type(error).__name__}: {error}"))
        _exit(1)
    try:
        _follow(lambda: _receive(pipe), engine)
    except BaseException:
        log.exception("rank %d failed", rank)
        _exit(1)
    leave()  # with rank 0, which leaves as it stops the workers
    _exit(0)


def _follow(receive, engine: Engine) -> None:
    """Run the calls rank 0 sends (`receive()`: the next one) until "stop" or rank 0 is gone."""
    while True:
        try:
            kind, *args = receive()
        except EOFError:
            return  # rank 0 is gone
        if kind == "stop":
            return
        if kind == "add":
            # an add that raises raises on rank 0 too, which answers it: nothing to do here
            with contextlib.suppress(Exception):
                engine.add(*args)
        else:
            getattr(engine, kind)(*args)


# -- ranks joined by the standard rendezvous (torchrun, one process per machine) -----------------


def joined_rank() -> int | None:
    """This process's rank when torchrun (or the standard RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT variables) started it as one of several; None otherwise."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


class GroupWorkers:
    """The other joined ranks, which rank 0's calls reach as broadcasts over a gloo group (the
    pipes of `Workers` do not cross machines). A rank that is gone fails the next broadcast
    within COLLECTIVE_TIMEOUT_S."""

    def __init__(self, group):
        self.group = group

    def send(self, *message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        """Rank 0's next call; EOFError when rank 0 is gone (its connections closed)."""
        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=self.group)
        except RuntimeError as error:
            raise EOFError(str(error)) from error
        return message[0]

    def watch(self) -> None:
        """Nothing to poll: a lost rank fails the next step's collectives."""

    def stop(self, leaving=lambda: None) -> None:
        with contextlib.suppress(Exception):
            self.send("stop")
        leaving()


def start_joined(config: Config, progress: bool):
    """(rank 0's LockstepEngine, source) when the ranks were started by the standard
    rendezvous; the other ranks run `follow_joined`."""
    engine, source, _ = _join(config, progress)
    atexit.register(engine.shutdown)
    log.info("joined ranks: %d on %s", config.parallel.ranks, engine.device.type)
    return engine, source


def follow_joined(config: Config) -> int:
    """A rank other than 0 of a torchrun launch: load, join, then run rank 0's calls until it
    stops; the exit code."""
    engine, _, group = _join(config, progress=False)
    try:
        _follow(group.receive, engine)
    except BaseException:
        log.exception("rank %d failed", joined_rank())
        return 1
    finally:
        leave()
    return 0


def _join(config: Config, progress: bool):
    """(this rank's engine, source, the control group): loaded, joined, the pools agreed."""
    rank, size = joined_rank(), int(os.environ["WORLD_SIZE"])
    if size != config.parallel.ranks:
        raise ValueError(
            f"{size} processes joined, but -tp x -pp makes {config.parallel.ranks} ranks"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    model, tokenizer, source, device = load_shard(config, rank, size, progress, local_rank)
    join(rank, size, device, "env://", COLLECTIVE_TIMEOUT_S)
    use_stage_groups(model, rank, config.parallel)
    group = GroupWorkers(dist.new_group(backend="gloo"))
    if rank == 0:
        build = lambda c: LockstepEngine(model, tokenizer, c, device, group)  # noqa: E731
    else:
        build = lambda c: Engine(model, tokenizer, c, device)  # noqa: E731
    engine = _on_smallest_pool(build(config), build, device)
    return engine, source, group


def _exit_with_parent() -> None:
    """Exit within a second of rank 0's death, even in the middle of a collective."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kestrel-rank0-watch", daemon=True).start()


def _exit(code: int) -> None:
    # nothing is left to clean up: skip the interpreter's teardown (seconds with torch loaded)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# plain pickle both ways: multiprocessing's pickler would pass tensors (images) as shared memory
def _send(pipe: Connection, message) -> None:
    pipe.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _receive(pipe: Connection):
    return pickle.loads(pipe.recv_bytes())  # only ever what our other side sent
