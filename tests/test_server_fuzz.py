"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI
schema, both fitting it (positive) and violating it (negative), and sends them to a real
`kestrel serve` process on a tiny random-weight model. No response may be a 5xx, every response
must match the schema (errors included), negative data must be rejected with a 4xx, and the
server must be healthy and idle afterwards. At least 300 cases per generating route."""

import time

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance

from server_fixtures import API_KEY, start_server, tiny_model

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# (method, path, positive cases, negative cases): >= 300 per route that takes a body
ROUTES = [
    ("POST", "/v1/chat/completions", 200, 120),
    ("POST", "/v1/completions", 200, 120),
    ("POST", "/completion", 200, 120),
    ("POST", "/v1/responses", 200, 120),
    ("POST", "/v1/messages", 200, 120),
    ("POST", "/v1/embeddings", 200, 120),
    ("POST", "/tokenize", 200, 120),
    ("POST", "/detokenize", 200, 120),
    ("GET", "/v1/models", 5, 0),
    ("GET", "/health", 5, 0),
    ("GET", "/metrics", 5, 0),
]


@pytest.fixture(scope="module")
def server():
    # a short context and default max_tokens keep each case to milliseconds; a deep queue so
    # that n up to 128 is a capacity the server has (503 would be a 5xx)
    args = ["-m", tiny_model(), "-a", "tiny", "-c", "64", "-n", "8", "--api-key", API_KEY]
    process = start_server([*args, "-np", "8", "--max-queue-depth", "256", "-b", "32"])
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)


def _fuzz(server, operation, mode: GenerationMode, examples: int) -> int:
    checks = [not_a_server_error, response_schema_conformance]
    if mode == GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    cases = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure reproduces
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        # 413: a body over --max-request-bytes is refused before it is read; a rejection too,
        # though not one of the statuses schemathesis's negative-data check lists
        refused = response.status_code == 413
        chosen = [c for c in checks if not (refused and c is negative_data_rejection)]
        case.validate_response(response, checks=chosen, headers=AUTH)
        cases.append(response.status_code)

    run()
    return len(cases)


@pytest.mark.parametrize(
    ("method", "path", "positive", "negative"), ROUTES, ids=[r[1] for r in ROUTES]
)
def test_fuzzed_requests_never_5xx_and_match_the_schema(
    server, schema, method, path, positive, negative
):
    operation = schema[path][method]
    count = _fuzz(server, operation, GenerationMode.POSITIVE, positive)
    if negative:
        count += _fuzz(server, operation, GenerationMode.NEGATIVE, negative)
    if method == "POST":
        assert count >= 300, count
    assert server.get("/health")[0] == 200
    metrics = server.metrics()
    assert metrics["kestrel_engine_alive"] == 1


def test_the_server_is_healthy_and_idle_after_fuzzing(server):
    deadline = time.monotonic() + 60  # a hang guard: idle is polled for
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m["kestrel_running_sequences"]
            == m["kestrel_queue_depth"]
            == m["kestrel_kv_tokens_in_use"]
            == 0
        ):
            break
        time.sleep(0.05)
    assert m["kestrel_running_sequences"] == m["kestrel_queue_depth"] == 0
    assert m["kestrel_kv_tokens_in_use"] == 0
    five_xx = [
        k
        for k, v in m.items()
        if k.startswith("kestrel_http_requests_total")
        and 'status="5' in k
        and v
        and 'route="/health"' not in k  # 503 while it loaded
    ]
    assert not five_xx, five_xx
    assert server.get("/health")[0] == 200
