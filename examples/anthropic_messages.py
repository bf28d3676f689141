"""Anthropic's Messages API (POST /v1/messages) with the anthropic client: one answer, then a
streamed one. The client takes the server's root URL (no /v1) and sends the key as x-api-key.

    python examples/anthropic_messages.py
"""

import os

from anthropic import Anthropic

base_url = os.environ.get("OPENAI_BASE_URL", "http://localhost:8080/v1").removesuffix("/v1")
client = Anthropic(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "none"))
model = os.environ.get("KESTREL_MODEL", "smollm2")  # the name the server was started with (-m)

message = client.messages.create(
    model=model,
    max_tokens=64,
    extra_body={"temperature": 0},  # sampling parameters as extra fields (this SDK's way)
    system="Answer in one sentence.",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
)
print("answer:", message.content[0].text)
print("stop reason:", message.stop_reason)

print("streamed: ", end="", flush=True)
with client.messages.stream(
    model=model,
    max_tokens=64,
    extra_body={"temperature": 0},  # sampling parameters as extra fields (this SDK's way)
    messages=[{"role": "user", "content": "Name three colors."}],
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
