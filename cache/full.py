"""Full KV cache: every position stored at its own index, preallocated once, no reallocation while decoding.

A model whose every layer has the same sliding window W (``window``) reads no key more than W - 1 positions before
its query, so the cache may keep only the last positions: slot = position - ``offset``, and when a write would pass
the last slot the positions no query from the write on can read are dropped, the rest moved to slot 0 (_make_room).
A cache of W + slack slots then moves about W positions once every slack positions written, and rolling back
within the positions written since stays exact: every position the next write's queries read is still held.

Offloaded (offload/kv.py), its storage lives in host memory and a stream object installed as ``stream`` serves
the forwards on the device; the cache keeps its bookkeeping, and calls the stream where storage is touched. The
stream writes the storage back lazily: whatever reads ``keys`` or ``values`` calls ``settle`` first, and a cache on
the device reads positions through ``copy_positions``, which takes those not written back yet from the device.

A prompt may be written layer by layer instead of forward by forward (LayerwiseWrite, for
Transformer.prefill_layerwise): offloaded, each layer's keys and values then cross between host and device once
for the whole prompt, where each forward over it would stream every layer's prefix to the device again.
"""

from typing import Protocol

import torch
from triforce_cli.cache.base import CacheCapacityError, EagerWrite, KVCache, StaticStep
from triforce_cli.kernels.memory import huge_page_zeros


class StorageStream(Protocol):
    """What serves an offloaded FullCache's forwards on the device (offload.LayerStream)."""

    device_bytes: int

    device: torch.device

    def begin(self, full: "FullCache", start: int, padding: int | None) -> None: ...

    def begin_step(self, full: "FullCache", num_tokens: int, group: int) -> StaticStep: ...

    def bucket(self, stop: int) -> int: ...

    def update(
        self, full: "FullCache", layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def buffers(self, full: "FullCache", layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_back(self, full: "FullCache", layer: int, positions: slice) -> None: ...

    def layer_keys(self, layer: int) -> torch.Tensor: ...

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def read(self, full: "FullCache", keys: torch.Tensor, values: torch.Tensor, positions: slice) -> None: ...

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def stored(self, length: int) -> None: ...

    def forget_beyond(self, length: int) -> None: ...

    def settle(self, full: "FullCache") -> None: ...


class FullCache(KVCache):
    slots_are_positions = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window: int | None = None,
        align: int = 1,
    ):
        """An empty cache, its buffers allocated (zeros).

        Args:
            dtype: of the keys and values, kv_dtype's for the model (cache.base).
            capacity: slots per layer and KV head: the positions [0, capacity) without window; with it, the most
                positions held at once (any number written).
            window: the sliding window W every layer of the model shares, or None (every position kept): a write
                then keeps only the positions from W - 1 before its first one on (module docstring).
            align: with window, the first position held (offset) is always a multiple of it: the retrieval
                cache's chunk size, so that each of its chunks is held whole or not at all.
        """
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.keys = huge_page_zeros(shape, dtype, device)
        self.values = huge_page_zeros(shape, dtype, device)
        self.stream: StorageStream | None = None  # set by offload.offload_kv
        self.capacity = capacity
        self.window = window
        self.align = align
        self.offset = 0  # the position slot 0 holds: positions before it were dropped (only with window)
        self.length = 0
        # Queries of the last forward, per layer (Hq, T, D), and the position of their first row: the retrieval
        # cache selects chunks with them, so re-selection costs no extra forward.
        self.queries: list[torch.Tensor | None] = [None] * num_layers
        self.query_start = 0
        # with make_static: (max_step, layers, Hq, D), where fixed-shape steps write their queries instead
        self.step_queries: torch.Tensor | None = None
        self._write = slice(0, 0)

    @property
    def origin(self) -> int:
        return self.offset

    def rollback(self, length: int) -> None:
        """Forget every position from length on; rolled back to 0, the cache is empty (nothing dropped)."""
        super().rollback(length)
        if self.length == 0:
            self.offset = 0
        if self.stream is not None:
            self.stream.forget_beyond(self.length)

    def reset(self) -> None:
        self.rollback(0)

    def can_write_from(self, position: int) -> bool:
        """Whether a forward may write from position: every earlier position its queries read is held (always
        without window; with it, none of the W - 1 before position was dropped)."""
        return self.window is None or max(0, position - self.window + 1) >= self.offset

    def _make_room(self, start: int, stop: int) -> None:
        """Before a write of positions [start, stop), padding included, with window: where stop would pass the last
        slot, drop the positions before the first that the write's queries read (rounded down to align) and move
        the rest, up to start, to slot 0. A ValueError where that first position was dropped
        already (a rollback further back than the last write)."""
        first_read = max(0, start - self.window + 1)
        if first_read < self.offset:
            raise ValueError(
                f"cannot write position {start}: its window starts at {first_read}, and the cache dropped the"
                f" positions before {self.offset}"
            )
        if stop - self.offset <= self.capacity:
            return
        offset = max(self.offset, first_read // self.align * self.align)
        shift = offset - self.offset
        count = start - offset  # positions [offset, start) stay, from slot shift to slot 0
        for buffer in (self.keys, self.values) if count > 0 else ():
            for layer in range(buffer.shape[0]):  # one layer at a time: the ranges overlap
                buffer[layer, :, :count] = buffer[layer, :, shift : shift + count].clone()
        self.offset = offset

    def settle(self) -> None:
        """Return once reads of keys and values see every write (an offloaded cache writes back lazily and
        asynchronously: LayerStream.settle)."""
        if self.stream is not None:
            self.stream.settle(self)

    def host_buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        """An empty buffer of the storage's dtype beside the storage, for a cache elsewhere to stage what it copies
        from it: offloaded, in host memory that copies run asynchronously with (LayerStream.host_buffer)."""
        if self.stream is None:
            return torch.empty(shape, dtype=self.keys.dtype, device=self.keys.device)
        return self.stream.host_buffer(shape, self.keys.dtype)

    def copy_positions(self, keys: torch.Tensor, values: torch.Tensor, positions: slice) -> None:
        """keys[...], values[...] = every layer's keys and values at positions, for a cache on the compute device:
        offloaded, those not written back yet copied on the device (LayerStream.read), the others uploaded; else
        from the storage (upload).

        Args:
            keys, values: (layers, Hkv, n, D) on the device the model computes on, each (n, D) matrix contiguous.
            positions: n positions the cache holds.
        """
        if self.stream is not None:
            self.stream.read(self, keys, values, positions)
            return
        held = slice(positions.start - self.offset, positions.stop - self.offset)
        self.upload(keys, self.keys[:, :, held])
        self.upload(values, self.values[:, :, held])

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[...] = src, for a cache on the compute device that reads this cache's storage: offloaded, queued on
        the stream's copy stream (LayerStream.upload: asynchronous, ordered after the copies back to the host, and
        before the compute queued later); else at once.

        Args:
            dst: (..., S, D), each (S, D) matrix contiguous, on the device the model computes on.
            src: dst's shape in the storage (or a staging buffer beside it), each (S, D) matrix contiguous.
        """
        if self.stream is None:
            dst.copy_(src)
        else:
            self.stream.upload(dst, src)

    @property
    def compute_device(self) -> torch.device:
        return self.keys.device if self.stream is None else self.stream.device

    def step_slots(self, stop: int) -> int:
        """Offloaded: the positions of the length bucket holding stop that a fixed-shape step streams and reads
        (LayerStream.bucket); else 0, the whole buffers."""
        return 0 if self.stream is None else self.stream.bucket(stop)

    def begin_step(self, num_tokens: int, group: int) -> StaticStep:
        if self.stream is not None:
            return self.stream.begin_step(self, num_tokens, group)
        return super().begin_step(num_tokens, group)

    def make_static(self, num_query_heads: int, max_step: int, query_dtype: torch.dtype) -> None:
        """As KVCache.make_static, with room for the queries of steps of up to max_step tokens (padding included),
        which a fixed-shape step writes into a buffer instead of handing them over (on the compute device); query_dtype: the model's dtype."""
        super().make_static()
        num_layers, _, _, head_dim = self.keys.shape
        shape = (max_step, num_layers, num_query_heads, head_dim)  # a step's rows first: one write for every layer
        self.step_queries = torch.zeros(shape, dtype=query_dtype, device=self.compute_device)
        torch._dynamo.mark_static_address(self.step_queries)

    def prepare(self, start: int, num_tokens: int, padding: int | None = None) -> None:
        self._check_start(start)
        stop = start + num_tokens + (padding or 0)
        if self.window is not None:
            self._make_room(start, stop)
        self._prepare_slots(start, num_tokens, padding)

    def _prepare_slots(self, start: int, num_tokens: int, padding: int | None) -> None:
        """Prepare the slots of positions [start, start + num_tokens), padding after them; CacheCapacityError where
        they pass the last slot."""
        stop = start + num_tokens + (padding or 0)
        if stop - self.offset > self.capacity:
            held = f"positions {self.offset}-{self.offset + self.capacity}" if self.offset else "positions"
            raise CacheCapacityError(f"full cache holds {self.capacity} {held}, up to {stop} requested")
        self._write = self._begin_write(start - self.offset, num_tokens, padding)
        self.query_start = start
        self.length = start + num_tokens
        if self.stream is not None:
            self.stream.begin(self, start, padding)

    def assign(self, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold keys and values (layers, Hkv, n, D) as positions [first, first + n) and nothing else, as a prefill
        of them leaves them (a saved prefill put back, PromptState.restore); with window, only the last of them
        that fit, from a multiple of align. A ValueError where first > 0 without window, or where the positions
        held lack one that a write right after them reads.
        """
        stop = first + keys.shape[2]
        self.reset()
        self.settle()  # no copy in flight reads or writes the storage written below
        if self.window is None:
            if first:
                raise ValueError(f"a cache keeping every position cannot start at position {first}")
        else:
            if stop - first > self.capacity:
                first = -(-(stop - self.capacity) // self.align) * self.align
            if first > max(0, stop - self.window + 1):
                raise ValueError(f"positions {first}-{stop} lack some of the window before position {stop}")
        self.offset = first
        self._prepare_slots(first, stop - first, None)
        count = stop - first
        self.keys[:, :, :count] = keys[:, :, keys.shape[2] - count :]
        self.values[:, :, :count] = values[:, :, values.shape[2] - count :]
        if self.stream is not None:
            self.stream.stored(self.length)

    def held(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The positions held: the first, and the keys and values (layers, Hkv, length - first, D), views."""
        held = slice(0, self.length - self.offset)
        return self.offset, self.keys[:, :, held], self.values[:, :, held]

    def store_step_queries(self, rows: torch.Tensor, queries: list[torch.Tensor]) -> None:
        stacked = torch.stack([q.transpose(0, 1) for q in queries], dim=1)  # (T, layers, Hq, D)
        self.step_queries.index_copy_(0, rows, stacked)

    def eager_write(self) -> EagerWrite | None:
        """The storage's write, every view from slot 0; None offloaded (the stream serves update())."""
        if self.stream is not None:
            return None
        first_slots = [0] * len(self.queries)
        return EagerWrite(self, self.keys, self.values, self._write, first_slots, self.offset, True, self.queries)

    def update(self, layer, q, k, v):
        self.queries[layer] = q
        if self.stream is not None:
            return self.stream.update(self, layer, k, v)
        self.keys[layer, :, self._write] = k
        self.values[layer, :, self._write] = v
        return self.keys[layer, :, : self._write.stop], self.values[layer, :, : self._write.stop]

    def query_at(self, layer: int, position: int) -> torch.Tensor:
        """The (Hq, D) query the last forward computed at ``position``."""
        queries = self.step_queries[:, layer].transpose(0, 1) if self.static_step else self.queries[layer]
        row = position - self.query_start
        if queries is None or not 0 <= row < queries.shape[1]:
            raise ValueError(f"no query for position {position} in the last forward")
        return queries[:, row]

    def queries_at(self, position: int) -> torch.Tensor:
        """The (layers, Hq, D) queries every layer of the last forward computed at ``position``."""
        return torch.stack([self.query_at(layer, position) for layer in range(len(self.queries))])


class LayerwiseWrite:
    """Positions [start, start + T) of a FullCache written one layer at a time (Transformer.prefill_layerwise): all
    of a layer's forwards, each over the positions after the one before, then the next layer's.

    Attention reads it as it reads the cache: ``update`` stores a forward's keys and values and returns the views
    up to them, as FullCache.update does. ``begin_layer`` takes the layer's (Hkv, capacity, D) keys and values once:
    the storage's own, or offloaded, its device buffer from the stream (LayerStream.buffers: an on-chip layer's, or
    its ring slot with its positions before start copied in); ``end_layer`` copies the layer's T positions back to
    the host storage at once (LayerStream.write_back). The queries of each layer's last forward are kept, as after
    forwards chunk by chunk (query_at). A cache keeping only a window (FullCache.window) is written the same way,
    by slot, but must hold every position of the T, and the window before them, at once.
    """

    static_step = False  # eager forwards of any length
    slots_are_positions = True

    def __init__(self, full: FullCache, start: int, num_tokens: int):
        """Prepare full for the positions [start, start + num_tokens) (FullCache.prepare)."""
        full.prepare(start, num_tokens)
        self.full = full
        self.start = start
        self.layer = -1  # the layer being written, once begun
        self.written = start  # positions the layer being written holds
        self._keys: torch.Tensor | None = None  # (Hkv, capacity, D) of the layer being written
        self._values: torch.Tensor | None = None

    def begin_layer(self, layer: int) -> None:
        """Take layer's keys and values for its forwards."""
        full = self.full
        self._keys, self._values = (
            (full.keys[layer], full.values[layer]) if full.stream is None else full.stream.buffers(full, layer)
        )
        self.layer, self.written = layer, self.start

    def update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T', D) of the layer's next T' positions, and its queries q (Hq, T', D); return the
        (Hkv, L, D) views attention reads, L the last new position + 1."""
        positions = slice(self.written, self.written + k.shape[1])
        if layer != self.layer or positions.stop > self.full.length:
            raise ValueError(f"layer {layer} cannot write positions {positions.start}-{positions.stop} now")
        slots = slice(positions.start - self.full.offset, positions.stop - self.full.offset)
        self._keys[:, slots] = k
        self._values[:, slots] = v
        self.full.queries[layer] = q
        self.full.query_start = positions.start
        self.written = positions.stop
        return self._keys[:, : slots.stop], self._values[:, : slots.stop]

    @property
    def origin(self) -> int:
        return self.full.origin

    def end_layer(self) -> None:
        """The layer has written every position: offloaded, copy them back to the host storage."""
        if self.written != self.full.length:
            raise ValueError(f"layer {self.layer} wrote positions up to {self.written} of {self.full.length}")
        if self.full.stream is not None:
            self.full.stream.write_back(self.full, self.layer, slice(self.start, self.written))
