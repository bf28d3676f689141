"""`kestrel serve -dp 2`: two replicas of the embedded smollm2 as actors of a real local Ray
cluster, behind one endpoint, driven by the `openai` client. Both replicas serve; prompts that
share a prefix land on the replica holding it (its prefix-cache hits in /metrics); a killed
replica loses no request it had not started, and the endpoint keeps answering.

One server for the module (a replica loads in seconds, Ray starts in more); the kill test runs
last since it restarts a replica."""

import json
import os
import signal
import sys
import threading
import time

import openai
import pytest

from kestrel.cli import main
from server_fixtures import HANG_S, start_server

PREFIX = " ".join(["The quick brown fox jumps over the lazy dog."] * 14)  # ~150 tokens
TOKENS = 48


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("ray")
    # -np 1: one running request per replica, the others wait in its queue (not started)
    server = start_server(["-m", "smollm2", "-c", "1024", "-dp", "2", "-np", "1"])
    yield server
    server.stop()


def replica_samples(server, name: str) -> dict[int, float]:
    """replica index -> the value of a per-replica metric."""
    prefix = f'kestrel_replica_{name}{{replica="'
    return {
        int(key[len(prefix) : -2]): value
        for key, value in server.metrics().items()
        if key.startswith(prefix)
    }


def replicas(server) -> list[dict]:
    status, body = server.get("/health")
    assert status == 200, body
    return json.loads(body)["replicas"]


def test_both_replicas_serve_the_openai_client(server):
    client = server.client()
    before = replica_samples(server, "requests_routed_total")
    answer = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert answer.choices[0].message.content.startswith("The capital of France is Paris")
    other = client.completions.create(model="smollm2", prompt="Count to ten:", max_tokens=4)
    assert other.choices[0].text
    after = replica_samples(server, "requests_routed_total")
    assert {i: after[i] - before[i] for i in after} == {0: 1, 1: 1}  # an idle set alternates
    listed = replicas(server)
    assert [r["status"] for r in listed] == ["ok", "ok"]
    assert len({r["pid"] for r in listed}) == 2


def test_prompts_sharing_a_prefix_land_on_the_replica_that_holds_it(server):
    client = server.client()
    routed = replica_samples(server, "requests_routed_total")
    hits = replica_samples(server, "prefix_cache_hits_total")
    for tail in ("one", "two", "three"):
        client.completions.create(
            model="smollm2", prompt=f"{PREFIX} {tail}", max_tokens=2, temperature=0
        )
    routed_now = replica_samples(server, "requests_routed_total")
    hits_now = replica_samples(server, "prefix_cache_hits_total")
    moved = {i: routed_now[i] - routed[i] for i in routed}
    holder = max(moved, key=moved.get)
    assert sorted(moved.values()) == [0, 3]
    assert hits_now[holder] - hits[holder] >= 2 * 64  # the 2nd and 3rd reused the first block
    assert hits_now[1 - holder] == hits[1 - holder]


def stream(client, tail: str, record: dict, started: threading.Event) -> None:
    """A streamed completion; records whether it saw a token before the kill and how it ended."""
    text = ""
    try:
        chunks = client.completions.create(
            model="smollm2",
            prompt=f"{PREFIX} {tail}",
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                record.setdefault("first_token", time.monotonic())
                started.set()
                text += chunk.choices[0].text
            if chunk.choices and chunk.choices[0].finish_reason:
                record["finish"] = chunk.choices[0].finish_reason
    except openai.APIError as error:
        record["error"] = error
    record["text"] = text


def test_a_killed_replica_loses_no_request_it_had_not_started(server):
    client = server.client()
    records = [{} for _ in range(4)]
    started = threading.Event()
    threads = [
        threading.Thread(target=stream, args=(client, f"kill {i}", records[i], started))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    assert started.wait(HANG_S)
    busy = [r for r in replicas(server) if r["in_flight"]]
    assert len(busy) == 1 and busy[0]["in_flight"] == 4  # the shared prefix: one replica
    killed_at = time.monotonic()
    os.kill(busy[0]["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(HANG_S)

    # -np 1: only the first had begun (the others wait for its 48 tokens)
    begun = [r for r in records if r.get("first_token", killed_at) < killed_at]
    assert len(begun) == 1 and "error" in begun[0]  # a stream mid-way ends with an error
    for record in records:
        if record is not begun[0]:  # re-sent to the live replica: whole answers
            assert "error" not in record and record["finish"] == "length" and record["text"]

    # the endpoint kept answering, and the killed replica comes back with a new process
    reply = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        back = replicas(server)[busy[0]["replica"]]
        if back["status"] == "ok":
            break
        time.sleep(0.5)
    assert back["status"] == "ok" and back["pid"] != busy[0]["pid"] and back["restarts"] == 1


def test_data_parallel_without_ray_names_the_flag(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", "-dp", "2"]) == 1
    error = capsys.readouterr().err
    assert "-dp/--data-parallel-size" in error and "kestrel[dp]" in error


def test_ray_address_needs_data_parallel(capsys):
    assert main(["serve", "--ray-address", "auto"]) == 1
    assert "--ray-address: only used with --data-parallel-size" in capsys.readouterr().err
