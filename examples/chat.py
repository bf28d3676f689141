"""Chat completions with the openai client: one answer, then the same question streamed.

kestrel serve                      # the embedded default model on http://localhost:8080
python examples/chat.py
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8080/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),  # the server's --api-key, if it has one
)
model = client.models.list().data[0].id  # the one model the server serves
messages = [{"role": "user", "content": "What is the capital of France?"}]

# temperature 0: greedy, the same answer every run
reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
print("answer:", reply.choices[0].message.content)
print("usage:", reply.usage.prompt_tokens, "prompt +", reply.usage.completion_tokens, "completion")

print("streamed: ", end="", flush=True)
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=64, temperature=0, stream=True
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
