"""StreamingLLM cache (Xiao et al., 2023, arXiv 2309.17453) for the drafter: attention sinks + a recent window.

Positions [0, sink_tokens) stay in slots [0, sink_tokens). Positions [window_start, length) sit right after
them, at slot ``sink_tokens + position - window_start``. When a write would not fit, the oldest positions are
evicted so that the last ``window`` positions before the write remain. ``max_step`` slots on top of the window
hold one step's new (speculative) tokens, so rollback within a step never needs an evicted position.

A drafter with sliding-window layers (``windows``) reads there only from the first position the step's first
query sees: sinks before it are left out of the view, and so are window positions before it where the drafter's
window is shorter than ``window``. The step's later queries read as the first does: a draft, not the model.
"""

import torch
from triforce_cli.cache.base import CacheCapacityError, SlotCache
from triforce_cli.cache.full import FullCache
from triforce_cli.kernels.memory import huge_page_zeros


class StreamingCache(SlotCache):
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        sink_tokens: int,
        window: int,
        max_step: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        windows: tuple[int | None, ...] = (),
    ):
        """windows: the drafter's sliding window per layer (ModelConfig.sliding_windows), () where none has one."""
        self.sink_tokens = sink_tokens
        self.window = window
        self.max_step = max_step
        self.capacity = sink_tokens + window + max_step
        shape = (num_layers, num_kv_heads, self.capacity, head_dim)
        self.keys = huge_page_zeros(shape, dtype, device)
        self.values = huge_page_zeros(shape, dtype, device)
        self.length = 0
        self.window_start = sink_tokens
        self._write = slice(0, 0)
        self._hold_first_slots(windows)

    @property
    def max_write(self) -> int:
        return self.max_step

    def reset(self) -> None:
        self.length = 0
        self.window_start = self.sink_tokens

    def rollback(self, length: int) -> None:
        """Forget positions from length on; a window emptied by the rollback restarts right at length."""
        self.length = min(self.length, length)
        if self.length < self.window_start:
            self.window_start = max(self.sink_tokens, self.length)

    def start_window_at(self, position: int) -> None:
        """Leave the sinks and start an empty window at position: the positions between them are never written.
        The cache must hold exactly its sinks (a prefill that reads only its last positions, Engine's drafter)."""
        if self.length != min(self.sink_tokens, position) or position < self.length:
            raise ValueError(f"cannot start the window at {position} with {self.length} positions held")
        self.length = position
        self.window_start = max(self.sink_tokens, position)

    def slot(self, position: int) -> int:
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + position - self.window_start

    def cached_positions(self) -> list[int]:
        """Sequence positions held, in slot order."""
        sinks = range(min(self.length, self.sink_tokens))
        return [*sinks, *range(max(self.window_start, self.sink_tokens), self.length)]

    def prepare(self, start: int, num_tokens: int, padding: int | None = None) -> None:
        self._check_start(start)
        written = num_tokens + (padding or 0)
        if written > self.max_step:
            raise CacheCapacityError(f"StreamingLLM cache takes at most {self.max_step} tokens per step")
        if start >= self.sink_tokens and start < self.window_start:
            raise ValueError(f"position {start} was already evicted from the StreamingLLM window")
        self.length = start
        if self.slot(start) + written > self.capacity:
            self._evict(keep_from=max(self.sink_tokens, start - self.window))
        self._write = self._begin_write(self.slot(start), num_tokens, padding)
        self.length = start + num_tokens
        if self.windows:
            self._start_views_at([self.first_visible_slot(start, window) for window in self.windows])

    def first_visible_slot(self, position: int, window: int | None) -> int:
        """The first slot a query at position reads through a sliding window (None: slot 0); position is held or
        being written."""
        first = 0 if window is None else max(0, position - window + 1)
        if first < self.sink_tokens:
            return first
        return self.slot(min(max(first, self.window_start), position))

    def _evict(self, keep_from: int) -> None:
        """Move positions [keep_from, length) to the front of the window region."""
        src = slice(self.slot(keep_from), self.slot(self.length))
        kept = src.stop - src.start
        dst = slice(self.sink_tokens, self.sink_tokens + kept)
        self.keys[:, :, dst] = self.keys[:, :, src].clone()
        self.values[:, :, dst] = self.values[:, :, src].clone()
        self.window_start = keep_from

    def fill_from(self, full: FullCache) -> None:
        """Take the sinks and the recent window from a full cache of the same model, instead of a prefill.

        Positions a full cache keeping only its window (FullCache.window) dropped lie before the window of every
        later query, in every layer: their slots here are left as they are, out of every layer's view.
        """
        self.reset()
        full.settle()
        first, keys, values = full.held()
        length = full.length
        self.window_start = max(self.sink_tokens, length - self.window)
        sinks = min(length, self.sink_tokens)
        for begin, end in ((min(first, sinks), sinks), (max(self.window_start, first), length)):  # sinks, window
            if end > begin:
                slots = slice(self.slot(begin), self.slot(begin) + end - begin)
                self.keys[:, :, slots] = keys[:, :, begin - first : end - first]
                self.values[:, :, slots] = values[:, :, begin - first : end - first]
        self.length = length
