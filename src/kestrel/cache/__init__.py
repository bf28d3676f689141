"""Per-sequence caches. Positions (`offset`, for RoPE) are not storage (the live window of keys).

See docs/architecture.md §1: every layer cache returns, with its live keys and values, the absolute
position of each key, and every attention mask is computed from those positions. The package
imports nothing here, so the scheduler reads `blocks.py` (plain Python) without torch.
"""
