"""The target's full KV cache in host memory, streamed to the device layer by layer (TriForce's offloading).

``offload_kv(full, device)`` transforms a FullCache built on the host: its keys and values (the whole context, in
pinned memory on a CUDA machine) stay the cache's storage, and a forward over it reads each layer from a two-slot
ring on the device. While layer i computes from one slot, layer i + 1 is copied into the other on a side stream;
each copy waits for an event saying the compute that last read its slot is done, and each layer's compute waits
for the event of its own copy, so the transfer of one layer overlaps the compute of the previous one and nothing
synchronises the whole device. ``on_chip_layers`` keeps the first layers' keys and values on the device for good:
they need no transfer.

A forward's new keys and values do not go back to the host at once. Each offloaded layer's are also written into
the tail, a device buffer (2, tail positions, layers, Hkv, D) of the positions written since the host storage last
took them (``host_valid``), and the next forward's fetch of a layer copies them from there into its slot; an
on-chip layer's stay in its own buffers. So a step copies nothing from the device to the host. ``settle``, which a
reader of the host storage calls first (FullCache.settle: the retrieval cache's selection, a prompt's capture),
flushes them: the on-chip layers' positions are gathered into the tail on the device, the tail goes to a pinned
host buffer of its shape in one copy per tensor, and the host scatters it into the storage. A forward that would
overflow the tail flushes it first (the copy stream waited for, once per that many positions); one writing more
positions than the tail holds writes each layer back at once instead.

A prompt is prefilled layer by layer instead (cache.full.LayerwiseWrite, Transformer.prefill_layerwise): each layer
takes its device buffer once (``buffers``), runs every chunk of the prompt in it and copies its new positions back
once (``write_back``), so no chunk streams the prefix written by the chunks before it again, and the host holds
the prompt when the prefill ends, as the first chunk selection needs.

The head-major (layers, Hkv, positions, D) layout every cache uses keeps each KV head's prefix one contiguous range,
so a layer streams as Hkv contiguous asynchronous copies (a copy of a strided range would be staged through
pageable memory on the host, synchronously); a few copies more per layer cost microseconds against the
milliseconds a layer's transfer takes. Every host buffer a copy reads or writes is page-locked on a CUDA machine
(``host_buffer``: the storage, the flush's buffer, the retrieval cache's staging), so every copy is asynchronous.
The retrieval cache reads the host storage (RetrievalCache takes its own device) for its selection, and the
positions not flushed yet on the device (``read``), so only its budget crosses PCIe; the drafter and its cache
never touch the full cache.

A fixed-shape step (the cache made static, FullCache.make_static; begin_step: StreamStep) streams at a fixed shape,
so that one CUDA graph of it serves every step until the length leaves its bucket: each offloaded layer's fetch
copies the host storage's first B positions, B the length the step writes up to rounded up to a multiple of
``bucket_positions`` (``bucket``, at most the capacity), whatever the host holds of them, into the slot viewed as
(Hkv, B, D) (``slot_view``: contiguous, so attention's split value product needs no copy), and attention reads
those, the step's bias masking the ones past its tokens; an on-chip layer is read whole, as the device's static
cache is. The tail goes into the slot at fixed shape too: all its rows, at the positions from ``host_valid_at`` (the
device's copy of host_valid) on, on the compute stream once the layer's copy arrived; rows past the positions
written land where the step writes or where the bias masks. The copies run on the copy stream, forked from the
compute stream by an event and joined back by another (Ring), as a CUDA graph's capture takes them, so layer i + 1's
copy overlaps layer i's compute in the graph too. Nothing in the step reads a host-side length; begin() does
everything that depends on one before it (a flush, the on-chip layers' refresh, host_valid_at), and a reader's
settle() also waits for the compute stream, whose replays read the host storage. Every bucket is one more graph per
padded length (runtime/graphs.py keys them by KVCache.step_slots), recorded when first needed; the ring holds the
whole capacity, so buckets add no ring memory.
"""

import torch
from triforce_cli.cache import FullCache, StaticStep
from triforce_cli.offload.pinning import pin_exactly
from triforce_cli.offload.queues import HostQueue, Ring, queue_for

TAIL_POSITIONS = 256  # positions written on the device before the host storage takes them, at most (a flush)
BUCKET_POSITIONS = 4096  # a fixed-shape step streams the length it reaches rounded up to a multiple of this


def pins_for(device: torch.device) -> bool:
    """Whether host memory that copies to and from device read or write is page-locked: on a CUDA device."""
    return device.type == "cuda"


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor that copies to and from device run asynchronously with: pinned, exactly its bytes
    (pin_exactly), where device needs it (pins_for)."""
    buffer = torch.empty(shape, dtype=dtype)
    return pin_exactly(buffer) if pins_for(device) else buffer


class LayerStream:
    """The device side of an offloaded FullCache: the on-chip layers, the ring, the tail, and the copies between
    them and the host storage (see the module docstring). FullCache calls begin() from prepare, update() per layer
    of a forward (a layerwise write: buffers() and write_back() per layer; a fixed-shape step: begin_step()),
    forget_beyond() on rollback, settle() before the host storage is read and stored() after writing it; upload()
    and read() serve the retrieval cache."""

    def __init__(
        self,
        full: FullCache,
        device: torch.device,
        on_chip_layers: int,
        queue: HostQueue,
        tail_positions: int = TAIL_POSITIONS,
        bucket_positions: int = BUCKET_POSITIONS,
    ):
        num_layers, num_kv_heads, capacity, head_dim = full.keys.shape
        self.device = device
        self.queue = queue
        self.on_chip = max(0, min(on_chip_layers, num_layers))
        self.num_layers = num_layers
        chip_shape = (self.on_chip, num_kv_heads, capacity, head_dim)
        self.chip_keys = torch.zeros(chip_shape, dtype=full.keys.dtype, device=device)
        self.chip_values = torch.zeros_like(self.chip_keys)
        slots = min(2, num_layers - self.on_chip)
        ring_shape = (slots, num_kv_heads, capacity, head_dim)
        self.ring_keys = torch.zeros(ring_shape, dtype=full.keys.dtype, device=device)
        self.ring_values = torch.zeros_like(self.ring_keys)
        tail_shape = (2, min(tail_positions, capacity), num_layers, num_kv_heads, head_dim)  # keys, values
        self.tail = torch.zeros(tail_shape, dtype=full.keys.dtype, device=device)
        self.flushed = host_buffer(tail_shape, full.keys.dtype, device)  # where a flush copies the tail to
        self.host_valid = 0  # positions [0, host_valid) the host storage holds as written
        self.device_until = 0  # positions [host_valid, device_until) are on the device alone: chip and tail
        self.chip_valid = 0  # positions the on-chip layers hold as written
        self._prefix = 0  # positions before the prepared write: what a forward streams
        self._write_through = False  # the prepared write outgrows the tail: each layer goes back at once
        self.ring = Ring(queue, self.on_chip)
        self.capacity = capacity
        self.bucket_positions = bucket_positions
        self.step_positions = 0  # B of the prepared fixed-shape step: the positions it streams and reads
        # fixed-shape steps, from the first one on: host_valid on the device (1,) and the tail's rows (tail positions,)
        self.host_valid_at: torch.Tensor | None = None
        self.tail_offsets: torch.Tensor | None = None
        self._host_valid_on_device = -1
        self._replays_read_host = False  # a fixed-shape step may read the host storage on the compute stream

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for t in (self.chip_keys, self.chip_values, self.ring_keys, self.ring_values, self.tail))

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor beside the storage that this stream's copies read or write (module host_buffer)."""
        return host_buffer(shape, dtype, self.device)

    def bucket(self, stop: int) -> int:
        """B for a fixed-shape step writing up to position stop: stop rounded up to a multiple of bucket_positions,
        at most the capacity."""
        return min(-(-stop // self.bucket_positions) * self.bucket_positions, self.capacity)

    def begin(self, full: FullCache, start: int, padding: int | None = None) -> None:
        """A forward writes full's prepared positions from start (a fixed-shape step: padding more after them):
        make room in the tail (or write through), bring the on-chip layers up to start, and start copying the first
        offloaded layer's prefix [0, start); for a fixed-shape step, have the device hold host_valid and the
        compute stream wait for the copies queued so far instead, its step fetching every layer (StreamStep)."""
        self.forget_beyond(start)  # positions from start on are written anew
        stop = full._write.stop
        written = stop + (padding or 0)  # a fixed-shape step's padding rows go into the tail too
        if self.device_until - self.host_valid + written - start > self.tail.shape[1]:
            self.flush(full)
        self._write_through = written - start > self.tail.shape[1]
        if self._write_through and padding is not None:
            raise ValueError(
                f"a fixed-shape step of {written - start} positions outgrows the tail of {self.tail.shape[1]}"
                " (`tail_positions`)"
            )
        self._prefix = start
        if self.chip_valid < start:  # after a restore from a saved prompt, or a reset: the host holds [0, start)
            stale = slice(self.chip_valid, start)
            for layer in range(self.on_chip):
                self._copy_heads(self.chip_keys[layer], full.keys[layer], stale)
                self._copy_heads(self.chip_values[layer], full.values[layer], stale)
            self.queue.wait("compute", self.queue.record("copy"))
            self.chip_valid = start
        self.ring.clear()
        if padding is not None:
            self.chip_valid = stop  # what the step writes into the on-chip layers
            self.step_positions = self.bucket(written)
            if self.host_valid_at is None:
                self.host_valid_at = torch.zeros(1, dtype=torch.long, device=self.device)
                self.tail_offsets = torch.arange(self.tail.shape[1], device=self.device)
            if self._host_valid_on_device != self.host_valid:
                self.host_valid_at.fill_(self.host_valid)  # a device write, no read
                self._host_valid_on_device = self.host_valid
            self.queue.wait("compute", self.queue.record("copy"))  # the step's fetches read the storage after these
            self._replays_read_host = True
        elif self.on_chip < self.num_layers:
            self._fetch(full, self.on_chip)
        self.device_until = stop
        if self._write_through:  # nothing left in the tail (flushed above): every position goes back as written
            self.host_valid = stop

    @staticmethod
    def _head_copies(dst: torch.Tensor, src: torch.Tensor, positions: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(Hkv, S, D) dst[:, positions] = src[:, positions] as one contiguous (dst, src) copy per KV head; none
        for no positions."""
        if positions.stop <= positions.start:
            return []
        return [(dst[head, positions], src[head, positions]) for head in range(src.shape[0])]

    def _copy_heads(self, dst: torch.Tensor, src: torch.Tensor, positions: slice) -> None:
        for pair in self._head_copies(dst, src, positions):
            self.queue.copy(*pair)

    def _fetch(self, full: FullCache, layer: int) -> None:
        """Copy layer's prefix into its slot (Ring.fetch: after the slot's last reader): the positions the host
        holds from there, one copy per KV head and tensor, and those after them from the tail, one per tensor."""
        slot = self.ring.slot(layer)
        on_host = min(self.host_valid, self._prefix)
        copies = []
        for part, (ring, storage) in enumerate(((self.ring_keys, full.keys), (self.ring_values, full.values))):
            copies += self._head_copies(ring[slot], storage[layer], slice(0, on_host))
            if self._prefix > on_host:  # (T, Hkv, D) rows of the tail -> (Hkv, T, D) positions of the slot
                rows = self.tail[part, : self._prefix - on_host, layer].transpose(0, 1)
                copies.append((ring[slot, :, on_host : self._prefix], rows))
        self.ring.fetch(layer, copies)

    def slot_view(self, layer: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's ring slot as (Hkv, positions, D) keys and values, each contiguous (the slot's first elements):
        what a fixed-shape step fetches and reads, with no copy for attention's split value product."""
        slot = self.ring.slot(layer)
        num_kv_heads, _, head_dim = self.ring_keys.shape[1:]
        shape = (num_kv_heads, positions, head_dim)
        size = num_kv_heads * positions * head_dim
        return tuple(ring[slot].view(-1)[:size].view(shape) for ring in (self.ring_keys, self.ring_values))

    def fetch_positions(self, full: FullCache, layer: int, positions: int) -> None:
        """Copy layer's first positions from the host storage into its slot_view, whatever the host holds of them,
        one copy per KV head and tensor (Ring.fetch: after the slot's last reader): a fixed-shape step's fetch."""
        copies = []
        for view, storage in zip(self.slot_view(layer, positions), (full.keys, full.values), strict=True):
            copies += self._head_copies(view, storage[layer], slice(0, positions))
        self.ring.fetch(layer, copies)

    def begin_step(self, full: FullCache, num_tokens: int, group: int) -> "StreamStep":
        """The prepared fixed-shape step of num_tokens (padding included) over full, group query heads per KV
        head."""
        return StreamStep(full, self, num_tokens, group)

    def _device(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's (Hkv, capacity, D) keys and values on the device: its on-chip buffers, or its ring slot."""
        if layer < self.on_chip:
            return self.chip_keys[layer], self.chip_values[layer]
        slot = self.ring.slot(layer)
        return self.ring_keys[slot], self.ring_values[slot]

    def buffers(self, full: FullCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer computes: its (Hkv, capacity, D) keys and values on the device, holding the positions before
        the prepared write; an offloaded layer's once its copy has arrived. Starts copying the next layer into the
        other slot, whose last reader (the layer before) has its compute queued by now."""
        if layer >= self.on_chip:
            self.ring.arrive(layer)
            if layer + 1 < self.num_layers:
                self._fetch(full, layer + 1)
        return self._device(layer)

    def layer_keys(self, layer: int) -> torch.Tensor:
        """Layer's (Hkv, capacity, D) keys on the device, as its last write left them: for a ring layer, valid
        until the next layer's buffers() (which fetches into the other slot, and the layer after into this one)."""
        return self._device(layer)[0]

    def write_back(self, full: FullCache, layer: int, positions: slice) -> None:
        """Copy layer's positions, written into its buffers() by the compute queued so far, back to the host
        storage, asynchronously, with the positions before them that the host lacks (the slot was fetched with
        them): one contiguous copy per KV head of the keys and of the values. After the last layer, the host holds
        every position up to positions.stop."""
        keys, values = self._device(layer)
        if layer == self.on_chip - 1:
            self.chip_valid = positions.stop
        back = slice(min(self.host_valid, positions.start), positions.stop)
        self.queue.wait("copy", self.queue.record("compute"))  # the new rows are written
        self._copy_heads(full.keys[layer], keys, back)
        self._copy_heads(full.values[layer], values, back)
        if layer == self.num_layers - 1:
            self.host_valid = self.device_until = positions.stop

    def update(
        self, full: FullCache, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FullCache.update for layer: store k, v (Hkv, T, D) on the device (an offloaded layer's in the tail too,
        or written through to the host where the write outgrows the tail); return the (Hkv, L, D) device views
        attention reads."""
        keys, values = self.buffers(full, layer)
        write = full._write
        keys[:, write] = k
        values[:, write] = v
        if self._write_through:
            self.write_back(full, layer, write)
        else:
            if layer == self.on_chip - 1:
                self.chip_valid = write.stop
            if layer >= self.on_chip:
                rows = slice(write.start - self.host_valid, write.stop - self.host_valid)
                self.tail[0, rows, layer] = k.transpose(0, 1)  # (T, Hkv, D)
                self.tail[1, rows, layer] = v.transpose(0, 1)
        return keys[:, : write.stop], values[:, : write.stop]

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[...] = src asynchronously, for a cache on the device reading the host storage (or a staging buffer
        beside it): after the compute queued so far, which may still read dst, and before any compute queued
        later. Copies queued after the write-backs, on the same copy stream, read the host storage as they left it.

        Args:
            dst: (..., S, D) on the device, each (S, D) matrix contiguous, as in every cache's head-major layout.
            src: dst's shape in host memory, each (S, D) matrix contiguous (pinned on a CUDA machine).
        """
        matrices = (-1, *dst.shape[-2:])  # a view, never a copy: each (S, D) matrix is one contiguous range
        self.queue.wait("copy", self.queue.record("compute"))
        for to, source in zip(dst.view(matrices), src.view(matrices), strict=True):
            self.queue.copy(to, source)
        self.queue.wait("compute", self.queue.record("copy"))

    def read(self, full: FullCache, keys: torch.Tensor, values: torch.Tensor, positions: slice) -> None:
        """keys, values (layers, Hkv, n, D) on the device = every layer's at positions: those the host holds
        uploaded from there (upload), those on the device alone copied on the device, from the on-chip buffers and
        the tail (one copy per tensor each), after the compute queued so far that wrote them."""
        on_host = min(max(self.host_valid, positions.start), positions.stop)
        if positions.stop > self.device_until:
            raise ValueError(f"positions up to {positions.stop} requested, {self.device_until} written")
        near = slice(0, on_host - positions.start)
        if near.stop:
            self.upload(keys[:, :, near], full.keys[:, :, positions.start : on_host])
            self.upload(values[:, :, near], full.values[:, :, positions.start : on_host])
        far = slice(near.stop, positions.stop - positions.start)
        if far.stop > far.start:
            held = slice(on_host, positions.stop)
            rows = slice(on_host - self.host_valid, positions.stop - self.host_valid)
            for part, (dst, chip) in enumerate(((keys, self.chip_keys), (values, self.chip_values))):
                dst[: self.on_chip, :, far] = chip[:, :, held]
                dst[self.on_chip :, :, far] = self.tail[part, rows, self.on_chip :].permute(1, 2, 0, 3)

    def flush(self, full: FullCache) -> None:
        """Have the host storage hold every position written (the module docstring): the on-chip layers' positions
        the host lacks gathered into the tail, the tail copied to the pinned buffer, one copy per tensor, the copy
        stream waited for, and the buffer scattered into the storage."""
        first, stop = self.host_valid, self.device_until
        count = stop - first
        if count <= 0:
            return
        if self.on_chip:  # (on_chip, Hkv, n, D) -> (n, on_chip, Hkv, D)
            self.tail[0, :count, : self.on_chip] = self.chip_keys[:, :, first:stop].permute(2, 0, 1, 3)
            self.tail[1, :count, : self.on_chip] = self.chip_values[:, :, first:stop].permute(2, 0, 1, 3)
        self.queue.wait("copy", self.queue.record("compute"))
        for part in range(2):
            self.queue.copy(self.flushed[part, :count], self.tail[part, :count])
        self.queue.settle()
        full.keys[:, :, first:stop] = self.flushed[0, :count].permute(1, 2, 0, 3)  # (layers, Hkv, n, D)
        full.values[:, :, first:stop] = self.flushed[1, :count].permute(1, 2, 0, 3)
        self.host_valid = stop

    def stored(self, length: int) -> None:
        """The host storage was written directly with positions [0, length) (FullCache.assign, after a reset): it
        holds them all, and the on-chip layers refresh from it at the next begin()."""
        self.host_valid = self.device_until = length

    def forget_beyond(self, length: int) -> None:
        self.chip_valid = min(self.chip_valid, length)
        self.device_until = min(self.device_until, length)
        self.host_valid = min(self.host_valid, length)

    def settle(self, full: FullCache) -> None:
        """Return once the host storage holds every write (flush, and the copies back are asynchronous) and no
        fixed-shape step still reads it (their fetches run on the compute stream, inside the step's graph)."""
        self.flush(full)
        if self._replays_read_host:
            self.queue.wait("copy", self.queue.record("compute"))
            self._replays_read_host = False
        self.queue.settle()


class StreamStep(StaticStep):
    """A fixed-shape step over an offloaded full cache (module docstring), as every layer of it reads and writes
    the device's copies: an on-chip layer's whole buffers, as the device's static cache's, or an offloaded layer's
    ring slot viewed as (Hkv, B, D), contiguous, with its first B positions fetched from the host and the tail
    placed after host_valid, the tail also taking the step's keys and values. What the layers share is built once,
    at the top of the step, on the device: the slots written (T,), their rows in the tail (T,), the tail's
    positions in a slot (tail positions,), and each attention bias, over B slots or the capacity."""

    def __init__(self, full: FullCache, stream: LayerStream, num_tokens: int, group: int):
        if full.write_start is None:
            raise ValueError("a fixed-shape step needs make_static() first")
        self.cache = full
        self.stream = stream
        self.write_start = full.write_start
        self.slots_are_positions = True
        self.group = group
        self.num_slots = stream.step_positions  # B
        self.rows = torch.arange(num_tokens, device=stream.device)  # (T,)
        self.slots = full.write_start.long() + self.rows  # (T,)
        self.tail_rows = self.slots - stream.host_valid_at  # (T,)
        # rows of the tail past B (past the positions written: the step writes over them or masks them) all land
        # in the last slot read
        self.tail_slots = (stream.host_valid_at + stream.tail_offsets).clamp_(max=self.num_slots - 1)
        self.biases: dict[object, torch.Tensor] = {}
        self.queries: list[torch.Tensor] = []
        if stream.on_chip < stream.num_layers:
            stream.fetch_positions(full, stream.on_chip, self.num_slots)

    def step_update(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (Hkv, T, D) at the step's slots of layer's device buffers (and, offloaded, at its rows of the
        tail) and keep q (Hq, T, D); return the (Hkv, S, D) buffers attention reads, masking past the last new
        slot: an on-chip layer's whole buffers, an offloaded layer's slot of B positions, which first waits for its
        fetch and takes the tail, and then the next layer's fetch starts into the other slot; read widened to q's
        dtype where the cache keeps another (kv_dtype)."""
        stream, full = self.stream, self.cache
        k, v = k.to(full.keys.dtype), v.to(full.values.dtype)  # the cache's dtype (kv_dtype)
        if layer < stream.on_chip:
            keys, values = stream.chip_keys[layer], stream.chip_values[layer]
        else:
            stream.ring.arrive(layer)
            keys, values = stream.slot_view(layer, self.num_slots)
            for part, buffer in enumerate((keys, values)):  # (tail, Hkv, D) rows -> (Hkv, tail, D) positions
                buffer.index_copy_(1, self.tail_slots, stream.tail[part, :, layer].transpose(0, 1))
            if layer + 1 < stream.num_layers:
                stream.fetch_positions(full, layer + 1, self.num_slots)
            rows = (self.tail_rows[:, None], full.layer_ids[layer], full.head_ids[:, 0])  # broadcast to (T, Hkv)
            stream.tail[0].index_put_(rows, k.transpose(0, 1))
            stream.tail[1].index_put_(rows, v.transpose(0, 1))
        where = (full.head_ids, self.slots)  # broadcast to (Hkv, T)
        keys.index_put_(where, k)
        values.index_put_(where, v)
        self.queries.append(q)
        return keys.to(q.dtype), values.to(q.dtype)

    def layer_slots(self, layer: int) -> int:
        """The slots layer's attention reads: an on-chip layer's capacity, an offloaded layer's B."""
        return self.stream.capacity if layer < self.stream.on_chip else self.num_slots


def offload_kv(
    full: FullCache,
    device: torch.device,
    on_chip_layers: int = 0,
    queue: HostQueue | None = None,
    tail_positions: int = TAIL_POSITIONS,
    bucket_positions: int | None = None,
) -> LayerStream:
    """Serve full's forwards on device from its host storage, streaming layer by layer (module docstring).

    Args:
        full: a FullCache built on the host in ordinary memory; for a CUDA device its keys and values are
            page-locked here, exactly their bytes (offload/pinning.py).
        device: where the model computes.
        on_chip_layers: the first layers kept on the device, never streamed.
        queue: streams and events for the copies; by default CUDA's on a GPU, the host's (no-ops) on the CPU.
        tail_positions: positions written on the device before they go back to the host, at most (the tail).
        bucket_positions: a fixed-shape step streams the positions it writes up to rounded up to a multiple of
            this (LayerStream.bucket); None: BUCKET_POSITIONS.
    Returns:
        The stream now installed as full.stream.
    """
    if full.keys.device.type != "cpu":
        raise ValueError(f"an offloaded full cache lives in host memory, not on {full.keys.device}")
    if full.window is not None:
        raise ValueError("a full cache keeping only a sliding window cannot be offloaded: its forwards stream from 0")
    device = torch.device(device)
    if pins_for(device):  # asynchronous copies need page-locked host memory
        pin_exactly(full.keys)
        pin_exactly(full.values)
    bucket = BUCKET_POSITIONS if bucket_positions is None else bucket_positions
    stream = LayerStream(full, device, on_chip_layers, queue or queue_for(device), tail_positions, bucket)
    full.stream = stream
    return stream
