"""Reliability against a real `kestrel serve` process on a tiny random-weight model (SmolLM2's
tokenizer): malformed bodies, sampling bounds, encoding, size and time limits, auth over the whole
route table, a disconnect storm, poison requests, and the secure defaults. What must be prompt is
timed in engine steps measured on this machine (`step_seconds`), so a busy machine fails none."""

import ast
import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from kestrel.config import ServerConfig
from kestrel.server.app import create_app, route_table
from kestrel.server.errors import ANTHROPIC_PATHS
from server_fixtures import API_KEY, shared_server, step_seconds, tiny_model

pytestmark = pytest.mark.slow

MAX_BYTES = 65536
MARKS = {
    "forward": "__POISON_FORWARD__",
    "sample": "__POISON_SAMPLE__",
    "detokenize": "__POISON_DETOK__",
}
ENV = (("KESTREL_TEST_FAULTS", ",".join(f"{k}:{v}" for k, v in MARKS.items())),)
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    args = (
        *("-m", tiny_model(), "-a", "tiny", "-c", "4096", "--api-key", API_KEY),
        *("-np", "4", "--max-queue-depth", "200", "-b", "32"),
        *("--max-request-bytes", str(MAX_BYTES), "--client-timeout", "2"),
    )
    return shared_server(args, ENV)


@pytest.fixture
def step(server) -> float:
    """Seconds per engine step on this machine now (the unit of the wall-clock bounds)."""
    return step_seconds(server, "tiny", batch=4)


def chat(server, **fields):
    return server.post(
        "/v1/chat/completions", {"model": "tiny", "messages": HELLO, "max_tokens": 3, **fields}
    )


def assert_400(reply, param):
    status, body = reply
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


# -- 2. malformed bodies --------------------------------------------------------------------------

MALFORMED = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b"null", None),
    (b"42", None),
    (b'"a string"', None),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": None}, "messages"),
    ({"model": 5, "messages": HELLO}, "model"),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        "messages[0].content",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
        "messages[0].content",
    ),
    ({"model": "tiny", "messages": HELLO, "stream": "yes"}, "stream"),
    ({"model": "tiny", "messages": HELLO, "stop": 5}, "stop"),
    ({"model": "tiny", "messages": HELLO, "n": 1.5}, "n"),
    ({"model": "tiny", "messages": HELLO, "logit_bias": [1]}, "logit_bias"),
    (
        {"model": "tiny", "messages": HELLO, "stream_options": {"include_usage": "x"}},
        "stream_options.include_usage",
    ),
]


@pytest.mark.parametrize(("body", "param"), MALFORMED)
def test_malformed_bodies_are_400_with_an_openai_error(server, body, param):
    assert_400(server.post("/v1/chat/completions", body), param)


def test_malformed_bodies_on_the_other_routes(server):
    for path in ("/v1/completions", "/completion", "/tokenize", "/detokenize"):
        for body in (b"[]", b"nul", {"prompt": {"a": 1}, "tokens": "x", "content": 1}):
            status, reply = server.post(path, body)
            assert status == 400 and reply["error"]["type"] == "invalid_request_error", (path, body)


# -- 3. sampling bounds ---------------------------------------------------------------------------

BAD_SAMPLING = [
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", -1),
    ("temperature", 1e9),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("n", 0),
    ("n", 10**6),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2**31),
    ("seed", 2**64),
    ("seed", -1),
    ("min_p", 2),
    ("presence_penalty", 3),
    ("stop", [""]),
    ("stop", [f"s{i}" for i in range(17)]),
    ("stop", ["x" * 2000]),
    ("logit_bias", {"not-a-token": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"10": 1000}),
    ("logit_bias", {"99999999": 1}),
]


@pytest.mark.parametrize(("param", "value"), BAD_SAMPLING)
def test_sampling_out_of_bounds_is_400_naming_the_param(server, param, value):
    body = json.dumps({"model": "tiny", "messages": HELLO, param: value}).encode()  # NaN, Infinity
    assert_400(server.post("/v1/chat/completions", body), param)


def test_top_logprobs_over_20_is_400(server):
    assert_400(chat(server, logprobs=True, top_logprobs=21), "top_logprobs")


def test_valid_edge_values_work(server):
    for fields in (
        {"temperature": 0},
        {"top_p": 1},
        {"top_k": -1},
        {"n": 4, "seed": 2**63 - 1},
        {"temperature": 100, "top_p": 1e-9},
        {"stop": [f"s{i}" for i in range(16)]},
        {"logprobs": True, "top_logprobs": 20},
        {"logit_bias": {"0": -100, "5": 100}},
    ):
        status, body = chat(server, **fields)
        assert status == 200 and body["choices"][0]["finish_reason"], (fields, body)


# -- 4. encoding ----------------------------------------------------------------------------------


def test_invalid_utf8_lone_surrogates_and_nul(server):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    status, body = server.post("/v1/chat/completions", raw)
    assert status == 400 and body["error"]["code"] == "invalid_unicode"
    for path, body in (
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "a\ud800"}]},
        ),
        ("/v1/completions", {"model": "tiny", "prompt": "\udfff"}),
        ("/v1/completions", {"model": "\ud800", "prompt": "x"}),
        ("/tokenize", {"content": "\ud800"}),
    ):
        status, reply = server.post(path, json.dumps(body).encode())  # ensure_ascii: "\ud800"
        assert status == 400 and reply["error"]["code"] == "invalid_unicode", (path, reply)
    # a surrogate pair (what json.dumps makes of an emoji) and NUL are fine
    status, reply = chat(server, messages=[{"role": "user", "content": "nul \u0000 and 🦅"}])
    assert status == 200 and reply["choices"][0]["message"]["content"]
    status, reply = server.post("/tokenize", {"content": "🦅"})
    assert status == 200 and reply["tokens"]


def _sse_lines(server, path, body) -> list[bytes]:
    with httpx.stream(
        "POST", server.url + path, json=body, headers=server.headers(), timeout=60
    ) as response:
        assert response.status_code == 200
        raw = b"".join(response.iter_raw())  # bytes as sent: decoded strictly below
    return [line for line in raw.split(b"\n") if line]


def test_streamed_multibyte_characters_are_never_split():
    # the real smollm2 (the shared server of the other server tests): emoji and CJK come as
    # byte-level tokens, and no delta may carry half a character
    server = shared_server()
    question = [{"role": "user", "content": "How do you say hello in Chinese?"}]
    body = {"model": "smollm2", "messages": question, "max_tokens": 40, "temperature": 0}
    whole = server.post("/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    lines = _sse_lines(server, "/v1/chat/completions", {**body, "stream": True})
    deltas = []
    for line in lines:
        text = line.decode("utf-8")  # strict: every line is valid UTF-8
        assert text.startswith("data: ")
        if text != "data: [DONE]":
            deltas += [c["delta"].get("content") or "" for c in json.loads(text[6:])["choices"]]
    assert "".join(deltas) == whole
    assert any(ord(c) > 0x2E80 for c in whole), whole  # the test saw multi-byte characters
    assert "\ufffd" not in whole
    for delta in deltas:
        delta.encode("utf-8")  # no lone surrogate halves


# -- 5. size and time limits ------------------------------------------------------------------------


def _raw(server, data: bytes, wait: float) -> bytes | None:
    """The reply's first bytes to `data` sent on a raw socket: b"" if the server closed the
    connection, None if it neither answered nor closed it within `wait` seconds."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        try:
            return s.recv(4096)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return b""


def test_body_over_the_limit_is_413_before_it_is_read(server, step):
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {10**9}\r\n\r\n"
    ).encode()
    started = time.monotonic()
    reply = _raw(server, head, wait=30)  # a gigabyte announced, not one byte of it sent
    assert reply and reply.startswith(b"HTTP/1.1 413"), reply  # not 408 at --client-timeout
    assert time.monotonic() - started < max(1.5, 10 * step)
    chunked = httpx.post(
        server.url + "/v1/completions",
        content=(b"x" * 8192 for _ in range(64)),  # no Content-Length: counted as it arrives
        headers=server.headers(),
        timeout=30,
    )
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    just_under = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u" * (MAX_BYTES - 100)}
    assert server.post("/v1/completions", just_under)[0] == 200


def test_too_many_messages_or_stop_strings_is_400(server):
    assert_400(chat(server, messages=[{"role": "user"}] * 2100), "messages")
    assert_400(chat(server, stop=["a"] * 100), "stop")


def test_slow_clients_time_out(server, step):
    closed_by = 2 + max(2.5, 10 * step)  # --client-timeout 2, and the server's delay to act on it
    started = time.monotonic()
    reply = _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", wait=closed_by + 30)
    assert reply == b"" and 1.5 < time.monotonic() - started < closed_by  # the head never ended
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: 100\r\n\r\n"
    )
    reply = _raw(server, head.encode() + b'{"model": "ti', wait=closed_by + 30)  # nor the body
    assert reply and reply.startswith(b"HTTP/1.1 408"), reply
    assert server.get("/health")[0] == 200


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_memory_stays_flat_under_big_and_oversized_bodies(server):
    big = {"model": "tiny", "prompt": "hi", "max_tokens": 1, "user": "u" * (MAX_BYTES - 100)}
    oversized = b'{"model": "tiny", "prompt": "' + b"y" * (4 * MAX_BYTES) + b'"}'

    async def burst():
        async with httpx.AsyncClient(headers=server.headers(), timeout=60) as client:
            for _ in range(4):
                replies = await asyncio.gather(
                    *(client.post(server.url + "/v1/completions", json=big) for _ in range(25)),
                    *(
                        client.post(server.url + "/v1/completions", content=oversized)
                        for _ in range(25)
                    ),
                )
                assert sorted({r.status_code for r in replies}) == [200, 413]

    asyncio.run(burst())  # warm: allocator pools, caches
    before = _rss_kib(server.process.pid)
    asyncio.run(burst())
    asyncio.run(burst())
    grown = _rss_kib(server.process.pid) - before
    assert grown < max(8 * 1024, before // 20), (before, grown)  # < 5% (or 8 MiB)


# -- 6. auth and the model field ------------------------------------------------------------------


def test_every_route_of_the_real_server_but_health_and_the_page_needs_the_key(server):
    table = route_table(create_app(ServerConfig(model_name="m", api_key="k")))
    assert len(table) >= 10
    for path, methods in table:
        for method in methods:
            response = httpx.request(method, server.url + path, timeout=30)
            expected = 200 if path in ("/health", "/") else 401
            assert response.status_code == expected, (method, path)
            if expected == 401 and method != "HEAD" and path in ANTHROPIC_PATHS:
                assert response.json()["error"]["type"] == "authentication_error"
            elif expected == 401 and method != "HEAD":
                assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "name",
    [
        "/etc/passwd",
        "../tiny",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "smollm2",
        "file:///tmp/x",
        "https://example.com/model.gguf",
        "tiny ",
    ],
)
def test_the_model_field_is_a_name_never_a_path_or_download(server, step, name):
    started = time.monotonic()
    status, body = chat(server, model=name)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert time.monotonic() - started < max(1.0, 10 * step)  # nothing was loaded or fetched


# -- 7. disconnect storm --------------------------------------------------------------------------


def _state(server) -> tuple[float, float, float]:
    m = server.metrics()
    return m["kestrel_running_sequences"], m["kestrel_queue_depth"], m["kestrel_kv_tokens_in_use"]


async def _drop(client, server, prompt: str, after: str) -> None:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 3000,
        "stream": True,
        "ignore_eos": True,
    }
    async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        if after == "headers":
            return  # accepted, not one token read: queued or prefilling
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return  # the first token is out: it is running


def test_disconnect_storm_aborts_every_request_and_frees_everything(server, step):
    before = server.metrics()
    assert _state(server) == (0, 0, 0)
    long_prompt = " ".join(f"word{i}" for i in range(600))  # many prefill chunks of 32
    hang = max(60.0, 500 * step)  # a read this long means the storm hung

    async def storm():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            headers=server.headers(), timeout=hang, limits=limits
        ) as client:
            await asyncio.gather(
                *(_drop(client, server, f"story {i}", "first chunk") for i in range(34)),
                *(_drop(client, server, f"{i} {long_prompt}", "headers") for i in range(33)),
                *(_drop(client, server, f"queued {i}", "headers") for i in range(33)),
            )

    asyncio.run(storm())
    dropped, prompt = time.monotonic(), max(1.0, 20 * step)
    while _state(server) != (0, 0, 0) and time.monotonic() - dropped < prompt:
        time.sleep(0.02)
    assert _state(server) == (0, 0, 0), f"not idle {prompt:.1f} s after the last disconnect"
    after = server.metrics()
    finished = {
        k: after[k] - before.get(k, 0) for k in after if k.startswith("kestrel_requests_finished")
    }
    assert finished.get('kestrel_requests_finished_total{reason="abort"}') == 100, finished
    assert sum(finished.values()) == 100  # none ran to its end
    assert chat(server)[0] == 200


# -- 8. poison isolation --------------------------------------------------------------------------

PROMPTS = [f"Count the birds number {i}." for i in range(5)]


def _complete_all(server, prompts):
    async def run():
        async with httpx.AsyncClient(headers=server.headers(), timeout=60) as client:
            body = {"model": "tiny", "max_tokens": 12, "temperature": 0}
            return await asyncio.gather(
                *(
                    client.post(server.url + "/v1/completions", json={**body, "prompt": p})
                    for p in prompts
                )
            )

    return asyncio.run(run())


@pytest.mark.parametrize("stage", sorted(MARKS))
def test_a_poisoned_request_fails_alone(server, stage):
    solo = [
        r.json()["choices"][0]["text"]
        for r in _complete_all(server, PROMPTS[:1]) + _complete_all(server, PROMPTS[1:2])
    ]
    solo += [_complete_all(server, [p])[0].json()["choices"][0]["text"] for p in PROMPTS[2:]]
    poisoned = f"{MARKS[stage]} Count the birds."
    replies = _complete_all(server, PROMPTS[:2] + [poisoned] + PROMPTS[2:])
    bad = replies.pop(2)
    assert bad.status_code == 500 and "InjectedFault" in bad.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in replies] == solo
    assert server.get("/health")[0] == 200 and _state(server) == (0, 0, 0)


# -- 13. secure defaults --------------------------------------------------------------------------


def test_binds_loopback_by_default(server):
    listening = []
    for line in (
        Path("/proc/net/tcp").read_text().splitlines()[1:]
        + Path("/proc/net/tcp6").read_text().splitlines()[1:]
    ):
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(":")
        if int(port, 16) == server.port and state == "0A":  # LISTEN
            listening.append(address)
    assert listening == ["0100007F"]  # 127.0.0.1 only, no IPv6 any-address either


def test_no_cors_headers_for_unlisted_origins(server):
    for origin in ("http://evil.example", "null", "http://127.0.0.1"):
        preflight = httpx.options(
            server.url + "/v1/chat/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        assert not any(h.startswith("access-control-") for h in preflight.headers), origin
        plain = httpx.get(server.url + "/health", headers={"Origin": origin})
        assert not any(h.startswith("access-control-") for h in plain.headers), origin


SRC = Path(__file__).resolve().parent.parent / "src" / "kestrel"
REQUEST_PATH = [
    *sorted((SRC / "server").rglob("*.py")),
    *sorted((SRC / "engine").glob("*.py")),
    *(SRC / name for name in ("sampling.py", "tokenizer.py", "errors.py", "media.py")),
]
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}  # the builtins, not re.compile
# the one allowed pickle: the server and its engine process exchange their own objects over a
# socket the server created (engine/process.py), and only these functions touch pickle
PIPE_CODEC = ("engine/process.py", {"_frame", "_receive", "_read_message"})


def _pipe_codec_lines(path: Path, tree: ast.AST) -> set[int]:
    """Lines of the pipe codec's functions and its `import pickle` (empty for other files)."""
    module, functions = PIPE_CODEC
    if str(path.relative_to(SRC)) != module:
        return set()
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in functions:
            lines |= set(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.Import) and [a.name for a in node.names] == ["pickle"]:
            lines.add(node.lineno)
    assert len(lines) > 3, "the pipe codec moved: update PIPE_CODEC"
    return lines


def test_no_pickle_eval_or_exec_on_request_paths():
    problems = []
    for path in REQUEST_PATH:
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = _pipe_codec_lines(path, tree)
        for node in ast.walk(tree):
            if getattr(node, "lineno", 0) in allowed:
                continue
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                problems += [where for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
            elif (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] in UNSAFE_MODULES
            ):
                problems.append(where)
            elif isinstance(node, ast.Call):
                called = ast.unparse(node.func)  # eval, builtins.exec, pickle.loads, torch.load
                if called.removeprefix("builtins.") in UNSAFE_CALLS:
                    problems.append(where)
                if called.split(".")[0] in UNSAFE_MODULES:
                    problems.append(where)
                if called == "torch.load" and not any(
                    k.arg == "weights_only" and getattr(k.value, "value", None) is True
                    for k in node.keywords
                ):
                    problems.append(where)
    assert len(REQUEST_PATH) > 15 and not problems, problems
