"""The per-layer cache protocol every model forward speaks.

A forward over new tokens at positions [start, start + T) first calls ``prepare(start, T)`` once, then
``update(layer, q, k, v)`` in every layer, which stores the new keys/values and returns the view attention
reads: ``[context | the T new tokens]`` (see kernels/attention.py), whose first key is at position ``origin``
where the view holds consecutive positions. ``length`` is the number of leading sequence positions the cache
holds; rolling back is setting it.

Every cache keeps its keys and values in kv_dtype(device, dtype) of the model computing on it: float16 for a
float32 model on the CPU (written rounded once, and read as such by every later forward, as llama.cpp keeps its
cache), the model's dtype on a GPU and for the CPU's bfloat16 runs, which stand in for a GPU.

A decode step with fixed shapes (what torch.compile captures as one CUDA graph for every position) prepares with
``padding``: the step computes T + padding tokens, the padding after the real ones. ``make_static`` has the cache
keep the prepared write's first slot on the device (``write_start``); the step begins with ``begin_step``, whose
StaticStep builds on the device, once for every layer, the slots the step writes and the attention bias that
masks what lies past them (kernels.step_attention_bias), then takes each layer's whole buffers
(StaticStep.step_update), so nothing in it depends on a host-side length. Padding rows land past ``length``:
never read, overwritten later.

An eager forward over a cache whose storage is where the model computes reads the prepared write once, at its top
(``eager_write``: an EagerWrite holding the storage, the slots and each layer's first slot), and its layers write
through that: update() as the cache's own, or, on the CPU, the storage and slots handed to one op that writes the
layer's keys and values itself (kernels.step.cached_layer), with no indexing per layer.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from triforce_cli.kernels.attention import step_attention_bias


def kv_dtype(device: torch.device | str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV caches of a model computing on device in dtype: float16 for a float32 model anywhere but
    on a CUDA GPU (the CPU; the meta device sizes for it), else the model's dtype."""
    return torch.float16 if torch.device(device).type != "cuda" and dtype == torch.float32 else dtype


class CacheCapacityError(RuntimeError):
    """A write would not fit the preallocated buffers."""


class KVCache(ABC):
    length: int = 0
    keys: torch.Tensor  # (layers, Hkv, slots, D)
    values: torch.Tensor
    write_start: torch.Tensor | None = None  # (1,) int32 on the device once make_static(): the next write's slot
    # once make_static(): every layer's index (layers,) and every KV head's (Hkv, 1), int64 on the device, with
    # which a fixed-shape step's writes index the whole buffers
    layer_ids: torch.Tensor | None = None
    head_ids: torch.Tensor | None = None
    static_step: bool = False  # whether the prepared forward is a fixed-shape step (prepared with padding)
    # whether a view holds consecutive positions, its last ones the new tokens' (the full cache's), so that a sliding
    # window applies by slot
    slots_are_positions: bool = False

    @abstractmethod
    def prepare(self, start: int, num_tokens: int, padding: int | None = None) -> None:
        """Get ready to store positions [start, start + num_tokens); start may not exceed ``length``.

        padding: for a fixed-shape step, the slots past the last token that the step also writes (None: an
        eager forward of exactly num_tokens).
        """

    @property
    def compute_device(self) -> torch.device:
        """Where forwards over this cache compute: its buffers' device (an offloaded full cache's: its stream's)."""
        return self.keys.device

    def step_slots(self, stop: int) -> int:
        """The slots a fixed-shape step writing up to position stop (padding included) reads, where that follows
        the cache's length (an offloaded full cache's length bucket): each count is recorded apart. 0: every step
        reads the whole buffers."""
        return 0

    def make_static(self) -> None:
        """Keep the next write's first slot on the device and the buffers at fixed addresses, for fixed-shape
        steps (CUDA graphs replay reads and writes at the addresses they were captured with)."""
        num_layers, num_kv_heads = self.keys.shape[:2]
        device = self.compute_device
        self.write_start = torch.zeros(1, dtype=torch.int32, device=device)
        self.layer_ids = torch.arange(num_layers, device=device)
        self.head_ids = torch.arange(num_kv_heads, device=device).unsqueeze(1)  # (Hkv, 1)
        for buffer in (self.keys, self.values, self.write_start, self.layer_ids, self.head_ids):
            torch._dynamo.mark_static_address(buffer)

    def _begin_write(self, first_slot: int, num_tokens: int, padding: int | None) -> slice:
        """The slots of a prepared write of num_tokens from first_slot; a fixed-shape step's also on the device."""
        self.static_step = padding is not None
        if self.static_step:
            if self.write_start is None:
                raise ValueError("a fixed-shape step needs make_static() first")
            self.write_start.fill_(first_slot)  # a device write, no read
        return slice(first_slot, first_slot + num_tokens)

    @abstractmethod
    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T, D) of the prepared positions; return the (Hkv, L, D) views attention reads."""

    def eager_write(self) -> "EagerWrite | None":
        """The prepared eager forward's write as its layers make it (EagerWrite), read once for every layer; None
        where the writes go through update() alone (an offloaded cache)."""
        return None

    def begin_step(self, num_tokens: int, group: int) -> "StaticStep":
        """The prepared fixed-shape step of num_tokens (padding included) as its layers read and write this cache;
        group: query heads per KV head."""
        return StaticStep(self, num_tokens, group)

    def store_step_queries(self, rows: torch.Tensor, queries: list[torch.Tensor]) -> None:
        """Keep a fixed-shape step's queries, every layer's (Hq, T, D), T = len(rows); a no-op but for a cache
        that selects with them (FullCache)."""

    def first_slot(self, layer: int) -> torch.Tensor | None:
        """For a fixed-shape step of a sliding-window layer: the first slot of layer's buffers it reads, (1,) int32
        on the device; None: slot 0."""
        return None

    @property
    def max_write(self) -> int | None:
        """Most positions one forward may write (None: as many as fit)."""
        return None

    @property
    def origin(self) -> int:
        """The position of the first key of the views update() returns, where they hold consecutive positions (the
        full cache's: FullCache.offset); 0 for the caches whose slots are no positions."""
        return 0

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        self.length = min(self.length, length)

    def reset(self) -> None:
        self.length = 0

    def _check_start(self, start: int) -> None:
        if start > self.length:
            raise ValueError(f"cannot write position {start}: the cache holds only {self.length} positions")


@dataclass
class EagerWrite:
    """An eager forward's write into a cache's storage, as every layer of it reads and writes the cache
    (KVCache.eager_write): the cache, its keys and values (layers, Hkv, S, D), the slots of the prepared positions,
    each layer's first slot read (its view: [first, slots.stop)), and the list where a full cache keeps each layer's
    queries. A layer either writes through update(), the cache's own, or writes the storage itself at the slots
    as update() does (kernels.step.cached_layer) and hands its queries to keep_queries."""

    cache: KVCache
    keys: torch.Tensor
    values: torch.Tensor
    slots: slice
    first_slots: list[int]
    origin: int  # the position of a view's first key where views hold consecutive positions (KVCache.origin)
    slots_are_positions: bool
    queries: list[torch.Tensor | None] | None  # FullCache.queries, None: not kept

    static_step = False

    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's update()."""
        return self.cache.update(layer, q, k, v)

    def keep_queries(self, layer: int, q: torch.Tensor) -> None:
        """Keep layer's queries q (Hq, T, D) where the cache keeps them (a full cache: FullCache.query_at)."""
        if self.queries is not None:
            self.queries[layer] = q


class StaticStep:
    """A fixed-shape step over a cache made static, as every layer of it reads and writes the cache.

    What the layers share is built once, at the top of the step, on the device from the cache's write_start: the
    slots the step writes (T,); each attention bias (kernels.step_attention_bias) on the first layer that reads
    it, kept for the others. Each layer then costs one in-place index_put_ into the whole (layers, Hkv, S, D)
    keys and one into the values (a write into a layer's view would compile to a copy of every layer's buffer),
    and the queries of every layer are stored once, at the end (finish).
    """

    static_step = True

    def __init__(self, cache: KVCache, num_tokens: int, group: int):
        if cache.write_start is None:
            raise ValueError("a fixed-shape step needs make_static() first")
        self.cache = cache
        self.write_start = cache.write_start
        self.slots_are_positions = cache.slots_are_positions
        self.group = group
        self.rows = torch.arange(num_tokens, device=cache.keys.device)  # (T,)
        self.slots = cache.write_start.long() + self.rows  # (T,)
        self.biases: dict[object, torch.Tensor] = {}
        self.queries: list[torch.Tensor] = []

    def first_slot(self, layer: int) -> torch.Tensor | None:
        return self.cache.first_slot(layer)

    def step_update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T, D) at the step's slots, in the cache's dtype, and keep q (Hq, T, D); return layer's
        whole (Hkv, S, D) buffers, for attention to mask past the last new slot: read widened to q's dtype where the
        cache keeps another (kv_dtype)."""
        keys, values = self.cache.keys, self.cache.values
        where = (self.cache.layer_ids[layer], self.cache.head_ids, self.slots)  # broadcast to (Hkv, T)
        keys.index_put_(where, k.to(keys.dtype))
        values.index_put_(where, v.to(values.dtype))
        self.queries.append(q)
        return keys[layer].to(q.dtype), values[layer].to(q.dtype)

    def step_bias(self, layer: int, window: int | None) -> torch.Tensor:
        """The float32 attention bias (G*T, S) of layer, whose sliding window is window (None: none): the full
        cache's layers mask by the window, a draft cache's windowed layers read from their first slot on."""
        if window is None:
            key = None
        elif self.slots_are_positions:
            key = window
        else:
            key = "first slots"
        num_slots = self.layer_slots(layer)
        if num_slots != self.cache.keys.shape[2]:
            key = (key, num_slots)
        if key not in self.biases:
            self.biases[key] = step_attention_bias(
                self.write_start,
                self.rows.shape[0],
                num_slots,
                self.group,
                window if self.slots_are_positions else None,
                self.cache.first_slots_at if key == "first slots" else None,
            )  # (G*T, S), or (layers, G*T, S) by first slot
        bias = self.biases[key]
        return bias[layer] if key == "first slots" else bias

    def layer_slots(self, layer: int) -> int:
        """S, the slots layer's attention reads: the cache's whole buffers."""
        return self.cache.keys.shape[2]

    def finish(self) -> None:
        """Store every layer's queries, once the last layer ran."""
        self.cache.store_step_queries(self.rows, self.queries)


class SlotCache(KVCache):
    """A cache whose prepare() puts the prepared positions in consecutive slots, ``_write``, right after the slots
    the forward reads with them (the StreamingLLM and the retrieval cache): update() stores there, and the view is
    every slot up to the last one written, from the layer's first slot on.

    A model's sliding-window layers (``windows``, ModelConfig.sliding_windows) may not read some of the first
    slots, whose positions lie before their window: the subclass sets each layer's first slot (``_start_views_at``),
    kept on the device too for fixed-shape steps (first_slot). Without windows every view starts at slot 0.
    """

    _write: slice  # the slots of the prepared positions, set by prepare()
    windows: tuple[int | None, ...] = ()
    first_slots: list[int]  # per layer, the first slot its view holds
    first_slots_at: torch.Tensor  # (layers, 1) int32 on the cache's device: first_slots, for fixed-shape steps

    def _hold_first_slots(self, windows: tuple[int | None, ...]) -> None:
        """Keep the model's sliding windows per layer, every view starting at slot 0 until told otherwise."""
        num_layers = self.keys.shape[0]
        self.windows = windows
        self.first_slots = [0] * num_layers
        self.first_slots_at = torch.zeros((num_layers, 1), dtype=torch.int32, device=self.keys.device)

    def _start_views_at(self, first_slots: list[int]) -> None:
        """Have each layer's view start at its slot in first_slots, on the device too."""
        self.first_slots = first_slots
        self.first_slots_at.copy_(torch.tensor(first_slots, dtype=torch.int32)[:, None])

    def make_static(self) -> None:
        super().make_static()
        torch._dynamo.mark_static_address(self.first_slots_at)

    def first_slot(self, layer: int) -> torch.Tensor:
        return self.first_slots_at[layer]

    def eager_write(self) -> EagerWrite:
        return EagerWrite(self, self.keys, self.values, self._write, self.first_slots, 0, False, None)

    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer, :, self._write] = k
        self.values[layer, :, self._write] = v
        view = slice(self.first_slots[layer], self._write.stop)
        return self.keys[layer, :, view], self.values[layer, :, view]
