"""KV caches: full (position-indexed), StreamingLLM (sinks + recent window) and retrieval (top chunks)."""

from triforce_cli.cache.base import CacheCapacityError, EagerWrite, KVCache, StaticStep, kv_dtype
from triforce_cli.cache.full import FullCache, LayerwiseWrite
from triforce_cli.cache.retrieval import RetrievalCache
from triforce_cli.cache.streaming import StreamingCache

__all__ = [
    "CacheCapacityError",
    "EagerWrite",
    "FullCache",
    "KVCache",
    "LayerwiseWrite",
    "RetrievalCache",
    "StaticStep",
    "StreamingCache",
    "kv_dtype",
]
