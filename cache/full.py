"""Full KV cache: every position stored at its own index, preallocated once, no reallocation while decoding."""

import torch

from cache.base import CacheCapacityError, KVCache


class FullCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0
        # Queries of the last forward, per layer (Hq, T, D), and the position of their first row: the retrieval
        # cache selects chunks with them, so re-selection costs no extra forward.
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.query_start = 0
        self._write = slice(0, 0)

    def prepare(self, start: int, num_tokens: int) -> None:
        self._check_start(start)
        end = start + num_tokens
        if end > self.capacity:
            raise CacheCapacityError(f"full cache holds {self.capacity} positions, {end} requested")
        self._write = slice(start, end)
        self.query_start = start
        self.length = end

    def update(self, layer, q, k, v):
        self.keys[layer, :, self._write] = k
        self.values[layer, :, self._write] = v
        self.queries[layer] = q
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]

    def query_at(self, layer: int, position: int) -> torch.Tensor:
        """The (Hq, D) query the last forward computed at ``position``."""
        queries = self.queries[layer]
        row = position - self.query_start
        if queries is None or not 0 <= row < queries.shape[1]:
            raise ValueError(f"no query for position {position} in the last forward")
        return queries[:, row]
