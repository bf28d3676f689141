"""Model families, one file per Hugging Face `model_type`, built from the shared `layers/`."""
