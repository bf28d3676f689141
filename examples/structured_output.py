"""Structured output: `response_format` with a JSON schema. The server constrains decoding to the
schema (a grammar), so the answer parses and validates even from a small model.

    python examples/structured_output.py
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8080/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)
model = client.models.list().data[0].id

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "continent": {
            "enum": ["Africa", "Asia", "Europe", "North America", "Oceania", "South America"]
        },
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "continent", "is_capital"],
    "additionalProperties": False,
}
reply = client.chat.completions.create(
    model=model,
    messages=[
        {
            "role": "user",
            "content": "Describe Paris as JSON: city, country, continent, capital or not.",
        }
    ],
    response_format={
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": schema, "strict": True},
    },
    max_tokens=256,
    temperature=0,
)
if reply.choices[0].finish_reason == "length":
    raise SystemExit(f"cut off at max_tokens: {reply.choices[0].message.content}")
city = json.loads(reply.choices[0].message.content)
print(json.dumps(city))
