"""Full KV cache: every position stored at its own index, preallocated once, no reallocation while decoding.

Offloaded (offload/kv.py), its storage lives in host memory and a stream object installed as ``stream`` serves
the forwards on the device; the cache keeps its bookkeeping, and calls the stream where storage is touched.
"""

from typing import Protocol

import torch

from cache.base import CacheCapacityError, KVCache, put_rows
from kernels.attention import PackedPrefix, pack_prefix


class StorageStream(Protocol):
    """What serves an offloaded FullCache's forwards on the device (offload.LayerStream)."""

    device_bytes: int

    def begin(self, full: "FullCache", start: int) -> None: ...

    def update(
        self, full: "FullCache", layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forget_beyond(self, length: int) -> None: ...

    def settle(self) -> None: ...


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
        self.stream: StorageStream | None = None  # set by offload.offload_kv
        self.capacity = capacity
        self.length = 0
        # Queries of the last forward, per layer (Hq, T, D), and the position of their first row: the retrieval
        # cache selects chunks with them, so re-selection costs no extra forward.
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.query_start = 0
        self._write = slice(0, 0)
        self._packed: list[PackedPrefix] | None = None  # see pack_prefix

    def pack_prefix(self, packed: list[PackedPrefix] | None = None) -> list[PackedPrefix]:
        """Keep a float16 copy of every position held now, packed for attention to read instead (CPU only).

        Attention then reads these positions at half the bytes; positions written later stay float32. The copy
        is dropped when a rollback or reset reaches into it. packed: a copy made earlier of these same positions
        and values, to use instead of packing again. Returns the copy in use.
        """
        if packed is None:
            held = slice(0, self.length)
            packed = [pack_prefix(keys[:, held], values[:, held]) for keys, values in zip(self.keys, self.values)]
        elif packed[0].length != self.length:
            raise ValueError(f"packed copy of {packed[0].length} positions for a cache holding {self.length}")
        self._packed = packed
        return packed

    def packed_prefix(self, layer: int) -> PackedPrefix | None:
        return None if self._packed is None else self._packed[layer]

    def _drop_packed_beyond(self, length: int) -> None:
        if self._packed is not None and self._packed[0].length > length:
            self._packed = None

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self._drop_packed_beyond(self.length)
        if self.stream is not None:
            self.stream.forget_beyond(self.length)

    def reset(self) -> None:
        super().reset()
        self._packed = None
        if self.stream is not None:
            self.stream.forget_beyond(0)

    def settle(self) -> None:
        """Return once reads of keys and values see every write (an offloaded cache writes back asynchronously)."""
        if self.stream is not None:
            self.stream.settle()

    def make_static(self, num_query_heads: int, max_step: int) -> None:
        """As KVCache.make_static, with room for the queries of steps of up to max_step tokens (padding included),
        which a fixed-shape step writes into a buffer instead of handing them over."""
        super().make_static()
        num_layers, _, _, head_dim = self.keys.shape
        shape = (num_layers, num_query_heads, max_step, head_dim)
        self.step_queries = torch.zeros(shape, dtype=self.keys.dtype, device=self.keys.device)
        torch._dynamo.mark_static_address(self.step_queries)

    def prepare(self, start: int, num_tokens: int, padding: int | None = None) -> None:
        self._check_start(start)
        end = start + num_tokens
        if end + (padding or 0) > self.capacity:
            raise CacheCapacityError(f"full cache holds {self.capacity} positions, {end + (padding or 0)} requested")
        self._drop_packed_beyond(start)
        self._write = self._begin_write(start, num_tokens, padding)
        self.query_start = start
        self.length = end
        if self.stream is not None:
            self.stream.begin(self, start)

    def step_update(self, layer, q, k, v):
        put_rows(self.step_queries, layer, torch.arange(q.shape[1], device=q.device), q)
        return super().step_update(layer, q, k, v)

    def update(self, layer, q, k, v):
        self.queries[layer] = q
        if self.stream is not None:
            return self.stream.update(self, layer, k, v)
        self.keys[layer, :, self._write] = k
        self.values[layer, :, self._write] = v
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]

    def query_at(self, layer: int, position: int) -> torch.Tensor:
        """The (Hq, D) query the last forward computed at ``position``."""
        queries = self.step_queries[layer] if self.static_step else self.queries[layer]
        row = position - self.query_start
        if queries is None or not 0 <= row < queries.shape[1]:
            raise ValueError(f"no query for position {position} in the last forward")
        return queries[:, row]
