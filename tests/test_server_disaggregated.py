"""`kestrel serve --disaggregate` as users run it: a real server process whose prefill and decode
engines (two processes, the KV handed over gloo) answer the `openai` client's chat and
completions, streamed and not, with the tokens a plain server gives; flags it cannot combine
with are refused before anything loads, naming them."""

import subprocess
import sys

import pytest

from server_fixtures import HANG_S, start_server, wait_healthy

PLAIN = ("-m", "smollm2", "-c", "1024", "-np", "4", "-t", "1")
PAIR = (*PLAIN, "--disaggregate", "--prefill-device", "cpu", "--decode-device", "cpu")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers():
    """(a plain server, a disaggregated one), started side by side."""
    plain, pair = start_server(PLAIN, wait=False), start_server(PAIR, wait=False)
    wait_healthy(plain)
    wait_healthy(pair)
    yield plain.client(), pair.client()
    plain.stop()
    pair.stop()


def chat(client, stream: bool) -> tuple[str, str, int | None]:
    """(text, finish reason, completion tokens when not streamed) of a greedy chat."""
    kwargs = dict(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        choice = reply.choices[0]
        return choice.message.content, choice.finish_reason, reply.usage.completion_tokens
    text, reason = [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
    return "".join(text), reason, None


def complete(client, stream: bool, **extra) -> tuple[str, str]:
    kwargs = dict(model="smollm2", prompt="The history of Rome", max_tokens=20, temperature=0)
    if not stream:
        choice = client.completions.create(**kwargs, **extra).choices[0]
        return choice.text, choice.finish_reason
    text, reason = [], None
    for chunk in client.completions.create(**kwargs, **extra, stream=True):
        for choice in chunk.choices:
            text.append(choice.text)
            reason = choice.finish_reason or reason
    return "".join(text), reason


@pytest.mark.parametrize("stream", [False, True])
def test_chat_answers_as_a_plain_server(servers, stream):
    plain, pair = servers
    want = chat(plain, stream)
    assert chat(pair, stream) == want
    assert "Paris" in want[0]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_answer_as_a_plain_server(servers, stream):
    plain, pair = servers
    assert complete(pair, stream) == complete(plain, stream)
    stop = {"stop": [complete(plain, False)[0].split()[2]]}  # a stop string mid-way
    assert complete(pair, stream, **stop) == complete(plain, stream, **stop)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--disaggregate", "-tp", "2"], "-tp/--tensor-parallel-size"),
        (["--disaggregate", "-pp", "2"], "-pp/--pipeline-parallel-size"),
        (["--disaggregate", "-dp", "2"], "-dp/--data-parallel-size"),
        (["--prefill-device", "cpu"], "--prefill-device"),
        (["--decode-device", "cpu"], "--decode-device"),
    ],
)
def test_flags_it_cannot_combine_with_are_refused_by_name(flags, named):
    command = [sys.executable, "-m", "kestrel", "serve", "-m", "smollm2", *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 1
    assert named in done.stderr
    assert "--disaggregate" in done.stderr
