"""The OpenAI-compatible HTTP server (FastAPI on uvicorn)."""
