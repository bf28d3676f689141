"""examples/*.py run as a user runs them (`python examples/NAME.py`) against a real `kestrel
serve` on the embedded SmolLM2, through the environment variables they read; each must exit 0
and print what it promises. The GPU serve script is only syntax-checked (no GPU here)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from server_fixtures import API_KEY, HANG_S, shared_server

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def server():
    return shared_server()


def run(name: str, server=None) -> str:
    env = {**os.environ}
    if server is not None:
        env |= {"OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": API_KEY}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_chat(server):
    out = run("chat.py", server)
    answer = re.search(r"^answer: (.+)$", out, re.MULTILINE)
    assert answer and answer.group(1).strip(), out
    assert re.search(r"^usage: \d+ prompt \+ [1-9]\d* completion$", out, re.MULTILINE), out
    streamed = re.search(r"^streamed: (.+)$", out, re.MULTILINE)
    assert streamed and streamed.group(1).strip(), out


def test_structured_output_validates(server):
    """The printed answer validates against the example's own schema."""
    source = ast.parse((EXAMPLES / "structured_output.py").read_text())
    (schema,) = [
        ast.literal_eval(node.value)
        for node in source.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["schema"]
    ]
    jsonschema.validate(json.loads(run("structured_output.py", server)), schema)


def test_tool_calls(server):
    out = run("tool_calls.py", server)
    call = re.search(r"^tool call: get_weather\((.+)\)$", out, re.MULTILINE)
    assert call, out
    assert isinstance(json.loads(call.group(1))["city"], str)
    assert re.search(r"^answer: ", out, re.MULTILINE), out


def test_embeddings(server):
    out = run("embeddings.py", server)
    assert re.search(r"^4 vectors of \d+ dimensions$", out, re.MULTILINE), out
    scores = re.findall(r"^(-?\d\.\d{3})  \S", out, re.MULTILINE)
    assert len(scores) == 3 and scores == sorted(scores, key=float, reverse=True), out


def test_anthropic_messages(server):
    out = run("anthropic_messages.py", server)
    answer = re.search(r"^answer: (.+)$", out, re.MULTILINE)
    assert answer and answer.group(1).strip(), out
    assert re.search(r"^stop reason: (end_turn|max_tokens|stop_sequence)$", out, re.MULTILINE)
    streamed = re.search(r"^streamed: (.+)$", out, re.MULTILINE)
    assert streamed and streamed.group(1).strip(), out


def test_batch_offline():
    out = run("batch.py")
    lines = [line for line in out.splitlines() if " -> " in line]
    assert len(lines) == 5, out
    assert all(line.partition(" -> ")[2] not in ("''", '""') for line in lines), out


def test_gpu_serve_script_parses():
    script = EXAMPLES / "serve_gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert "kestrel serve" in script.read_text()


def test_every_example_is_tested():
    tested = {"chat.py", "structured_output.py", "tool_calls.py", "embeddings.py"}
    tested |= {"anthropic_messages.py", "batch.py", "serve_gpu.sh"}
    shipped = {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")}
    assert shipped == tested
