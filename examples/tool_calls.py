"""Tool calls: the model asks for a function, we run it and send back its result, and the model
answers with it. `tool_choice` names the function here, so even a small model calls it (the
arguments are constrained to the tool's JSON schema); "auto" lets the model decide.

    python examples/tool_calls.py
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8080/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)
model = client.models.list().data[0].id


def get_weather(city: str) -> dict:
    return {"city": city, "temperature_c": 21, "sky": "sunny"}  # a stand-in for a real lookup


tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

reply = client.chat.completions.create(
    model=model,
    messages=messages,
    tools=tools,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    parallel_tool_calls=False,
    max_tokens=64,
    temperature=0,
)
message = reply.choices[0].message
messages.append(message.model_dump(exclude_none=True))
for call in message.tool_calls:
    arguments = json.loads(call.function.arguments)
    print(f"tool call: {call.function.name}({json.dumps(arguments)})")
    result = get_weather(**arguments)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

# tool_choice "none": answer in words now, from the tool's result
final = client.chat.completions.create(
    model=model, messages=messages, tools=tools, tool_choice="none", max_tokens=64, temperature=0
)
print("answer:", final.choices[0].message.content)
