"""KV caches: full (position-indexed), StreamingLLM (sinks + recent window) and retrieval (top chunks)."""

from cache.base import CacheCapacityError, KVCache
from cache.full import FullCache, LayerwiseWrite
from cache.retrieval import RetrievalCache
from cache.streaming import StreamingCache

__all__ = ["CacheCapacityError", "FullCache", "KVCache", "LayerwiseWrite", "RetrievalCache", "StreamingCache"]
