"""The per-layer cache protocol every model forward speaks.

A forward over new tokens at positions [start, start + T) first calls ``prepare(start, T)`` once, then
``update(layer, q, k, v)`` in every layer, which stores the new keys/values and returns the view attention
reads: ``[context | the T new tokens]`` (see kernels/attention.py). ``length`` is the number of leading
sequence positions the cache holds; rolling back is setting it. ``packed_prefix(layer)`` may offer a packed
float16 copy of the view's first positions for attention to read instead.
"""

from abc import ABC, abstractmethod

import torch

from kernels.attention import PackedPrefix


class CacheCapacityError(RuntimeError):
    """A write would not fit the preallocated buffers."""


class KVCache(ABC):
    length: int = 0

    @abstractmethod
    def prepare(self, start: int, num_tokens: int) -> None:
        """Get ready to store positions [start, start + num_tokens); start may not exceed ``length``."""

    @abstractmethod
    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T, D) of the prepared positions; return the (Hkv, L, D) views attention reads."""

    @property
    def max_write(self) -> int | None:
        """Most positions one forward may write (None: as many as fit)."""
        return None

    def packed_prefix(self, layer: int) -> PackedPrefix | None:
        """A packed float16 copy of the first positions of layer's view, if this cache keeps one."""
        return None

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.length = 0

    def _check_start(self, start: int) -> None:
        if start > self.length:
            raise ValueError(f"cannot write position {start}: the cache holds only {self.length} positions")
