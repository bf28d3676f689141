"""Per-sequence caches. Positions (`offset`, for RoPE) are not storage (the live window of keys).

See DESIGN.md section 1: every layer cache returns, with its live keys and values, the absolute
position of each key, and every attention mask is computed from those positions.
"""

from kestrel.cache.kv import LayerKVCache
from kestrel.cache.mask import visible_mask
from kestrel.cache.sequence import CacheSpec, SequenceCache

__all__ = ["CacheSpec", "LayerKVCache", "SequenceCache", "visible_mask"]
