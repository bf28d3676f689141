"""Building blocks the model families share: norms, RoPE, MLPs, attention over the cache, and
the larger pieces several families use (MLA, MoE, Mamba, multimodal RoPE, the Qwen vision encoder,
the fused CUDA forwards). Family files (`models/<model_type>.py`) compose them."""
