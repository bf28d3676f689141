"""GPU kernels (Triton), each beside the PyTorch fallback it equals; the fallbacks run on the CPU."""
