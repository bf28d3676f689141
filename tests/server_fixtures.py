"""Real `kestrel serve` processes on free ports, shared by every server test in a session.

A model load takes seconds, so servers are started once per distinct (args, env) and reused:
`shared_server(args, env)` returns the running one or starts it; all are killed at exit (and by
the kernel if pytest dies: PR_SET_PDEATHSIG). `start_server` gives a private one to tests that
kill or break it (the engine-death and shutdown tests). `step_seconds` measures how fast the
machine is now, the unit of the tests' wall-clock budgets.
"""

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

API_KEY = "test-key"
FAULT_MARKER = "__KESTREL_FAULT_FORWARD__"
ALLOWED_ORIGIN = "http://allowed.example"

# the servers' logs (read by tests after a server stops) and the tiny checkpoints: registered
# first, so removed last at exit, after the servers stop
SESSION_DIR = tempfile.mkdtemp(prefix="kestrel-tests-")
atexit.register(shutil.rmtree, SESSION_DIR, ignore_errors=True)

# the shared smollm2 server most tests use: key, CORS origin, fault hook, a 1024-token context
SMOLLM2_ARGS = (
    "-m",
    "smollm2",
    "-c",
    "1024",
    "--api-key",
    API_KEY,
    "--allowed-origins",
    ALLOWED_ORIGIN,
    "-np",
    "8",
)
SMOLLM2_ENV = (("KESTREL_TEST_FAULTS", f"forward:{FAULT_MARKER}"),)
# how long a wait for an event (a reply, health, an exit) may last before it counts as a hang: far
# longer than any of them takes on a busy machine, and only a hang ever waits it out
HANG_S = 600.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=kwargs.pop("timeout", HANG_S),
            **kwargs,
        )

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            timeout=kwargs.pop("timeout", HANG_S),
            **kwargs,
        )

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, headers: dict | None = None) -> tuple[int, str]:
        request = urllib.request.Request(
            self.url + path, headers=self.headers() if headers is None else headers
        )
        try:
            with urllib.request.urlopen(request, timeout=HANG_S) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {
            "Content-Type": "application/json",
            **(headers if headers is not None else self.headers()),
        }
        request = urllib.request.Request(self.url + path, data=data, headers=all_headers)
        try:
            with urllib.request.urlopen(request, timeout=HANG_S) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples (and `name{labels}` keys) of /metrics."""
        status, text = self.get("/metrics")
        assert status == 200, text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def start_server(args, env=(), wait: bool = True, timeout: float = HANG_S) -> ServerProcess:
    """`python -m kestrel serve ARGS --port <free>`; waits until /health is 200."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", dir=SESSION_DIR, suffix=".log", delete=False)
    command = [sys.executable, "-m", "kestrel", "serve", *args, "--port", str(port)]
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **dict(env)},
        preexec_fn=_die_with_parent,
    )
    args = list(args)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    server = ServerProcess(process, port, log.name, key)
    atexit.register(server.stop)
    if wait:
        wait_healthy(server, timeout)
    return server


def wait_healthy(server: ServerProcess, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited ({server.process.returncode}):\n{server.log()[-3000:]}"
            )
        try:
            if server.get("/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"server not healthy in {timeout} s:\n{server.log()[-3000:]}")


def step_seconds(server: ServerProcess, model: str, batch: int = 1, tokens: int = 16) -> float:
    """Seconds per engine step on this machine now: `batch` concurrent greedy requests of `tokens`
    tokens each, their wall time over `tokens` (prefill and HTTP included: it errs long). Tests
    size wall-clock budgets in steps, `max(idle-machine seconds, k * step)`, so that they hold on
    a busy machine as on a quiet one."""
    body = {"model": model, "prompt": "Count to ten:", "max_tokens": tokens, "temperature": 0}
    body["ignore_eos"] = True
    started = time.monotonic()
    with ThreadPoolExecutor(batch) as pool:
        replies = list(pool.map(lambda _: server.post("/v1/completions", body), range(batch)))
    elapsed = time.monotonic() - started
    assert all(status == 200 for status, _ in replies), replies
    return elapsed / tokens


_SHARED: dict[tuple, ServerProcess] = {}


def shared_server(args=SMOLLM2_ARGS, env=SMOLLM2_ENV) -> ServerProcess:
    """The session's server for these args and env (started on first use, restarted if dead)."""
    key = (tuple(args), tuple(env))
    server = _SHARED.get(key)
    if server is None or server.process.poll() is not None:
        server = _SHARED[key] = start_server(args, env)
    return server


_TINY: list[str] = []


def tiny_model() -> str:
    """A random-weight 2-layer Llama saved with SmolLM2's tokenizer (and chat template): loads
    and generates in milliseconds, for fuzzing and load tests. Built once per session."""
    if not _TINY:
        import torch
        import transformers

        from kestrel.weights.loader import load_tokenizer, resolve

        tokenizer = load_tokenizer(resolve("smollm2"))
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        folder = tempfile.mkdtemp(prefix="tiny-", dir=SESSION_DIR)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        _TINY.append(folder)
    return _TINY[0]


def child_pids(pid: int) -> set[int]:
    """The processes `pid` started (a server's engine process, for the tests that kill it)."""
    found = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found |= {int(c) for c in f.read().split()}
    return found
