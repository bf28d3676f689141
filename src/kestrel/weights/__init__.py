"""Weight loaders: GGUF files, Hugging Face safetensors folders, and the embedded default models."""
