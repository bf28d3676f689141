"""The server without a model (fast): flags and LLAMA_ARG_* variables, the route table behind the
API key, errors while loading, and the test-only fault spec."""

import argparse

import pytest
from fastapi.testclient import TestClient

from kestrel.config import ServerConfig
from kestrel.server import faults
from kestrel.server.app import create_app, route_table
from kestrel.server.args import add_serve_args, apply_llama_env


def _parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    apply_llama_env(parser, environ)
    return parser.parse_args(argv)


def test_llama_server_flags_and_defaults():
    args = _parse(["-m", "x.gguf", "-c", "2048", "-n", "64", "-np", "4", "-b", "128"], {})
    assert (
        args.model,
        args.ctx_size,
        args.max_tokens,
        args.max_num_seqs,
        args.prefill_chunk_size,
    ) == (
        "x.gguf",
        2048,
        64,
        4,
        128,
    )
    defaults = _parse([], {})
    assert defaults.host == "127.0.0.1" and defaults.port == 8080 and defaults.allowed_origins == ""
    assert defaults.api_key is None and defaults.max_kv_size == 0 and defaults.keep == 4


def test_llama_env_sets_defaults_and_the_command_line_wins():
    env = {
        "LLAMA_ARG_PORT": "9001",
        "LLAMA_ARG_CTX_SIZE": "512",
        "LLAMA_ARG_MODEL": "a.gguf",
        "LLAMA_API_KEY": "k",
        "LLAMA_ARG_BATCH": "32",
        "LLAMA_ARG_N_PARALLEL": "2",
    }
    args = _parse([], env)
    assert (
        args.port,
        args.ctx_size,
        args.model,
        args.api_key,
        args.prefill_chunk_size,
        args.max_num_seqs,
    ) == (9001, 512, "a.gguf", "k", 32, 2)
    args = _parse(["--port", "9002", "-c", "256", "-m", "b.gguf"], env)
    assert (args.port, args.ctx_size, args.model) == (9002, 256, "b.gguf")


def test_bad_llama_env_value_is_an_error():
    with pytest.raises(SystemExit):
        _parse([], {"LLAMA_ARG_PORT": "eighty"})


def _client(**config) -> TestClient:
    return TestClient(create_app(ServerConfig(model_name="m", **config)))


def test_every_route_but_health_and_the_page_needs_the_key():
    app = create_app(ServerConfig(model_name="m", api_key="secret"))
    with TestClient(app) as client:
        table = route_table(app)
        assert {"/v1/chat/completions", "/v1/completions", "/completion", "/metrics"} <= {
            p for p, _ in table
        }
        open_routes = {"/health": 503, "/": 200}  # /health: open, and still loading
        for path, methods in table:
            for method in methods:
                response = client.request(method, path)
                expected = open_routes.get(path, 401)
                assert response.status_code == expected, (method, path)
        assert client.post("/").status_code == 401  # the page is open to GET only
        assert (
            client.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
        )


def test_not_ready_is_503_with_retry_after():
    with _client() as client:
        assert client.get("/health").status_code == 503
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["type"] == "service_unavailable"


def test_no_cors_headers_unless_origins_are_listed():
    with _client() as client:
        response = client.get("/health", headers={"Origin": "http://a.example"})
        assert "access-control-allow-origin" not in response.headers
    with _client(allowed_origins=["http://a.example"]) as client:
        response = client.get("/health", headers={"Origin": "http://a.example"})
        assert response.headers["access-control-allow-origin"] == "http://a.example"


def test_fault_spec_parses_and_rejects_bad_items():
    assert faults.parse("forward:X, sample:Y") == {"forward": "X", "sample": "Y"}
    assert faults.parse("") == {}
    for bad in ("forward", "explode:X", "forward:"):
        with pytest.raises(ValueError):
            faults.parse(bad)


def test_fault_hook_fires_only_on_its_marker_and_stage():
    class Tokenizer:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    class Request:
        def __init__(self, request_id, text):
            self.request_id, self.prompt_ids = request_id, [ord(c) for c in text]

    hook = faults.FaultHook({"forward": "BOOM"}, Tokenizer())
    hook("forward", Request("a", "all fine"))
    hook("sample", Request("b", "BOOM here"))
    with pytest.raises(faults.InjectedFault):
        hook("forward", Request("c", "BOOM here"))
