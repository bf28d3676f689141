"""Embeddings (POST /v1/embeddings): vectors of a few sentences, ranked by cosine similarity to
a query. The vectors are L2-normalized, so a dot product is the cosine.

    python examples/embeddings.py
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8080/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)
model = client.models.list().data[0].id

documents = [
    "The cat sat on the mat.",
    "Paris is the capital of France.",
    "Stocks fell sharply on Monday.",
]
query = "Which city is France's capital?"
response = client.embeddings.create(model=model, input=[query, *documents])
vectors = [item.embedding for item in response.data]
print(f"{len(vectors)} vectors of {len(vectors[0])} dimensions")

scores = [sum(q * d for q, d in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
for score, document in sorted(zip(scores, documents, strict=True), reverse=True):
    print(f"{score:.3f}  {document}")
