"""The target's full KV cache in host memory, streamed to the device layer by layer (TriForce's offloading).

``offload_kv(full, device)`` transforms a FullCache built on the host: its keys and values (the whole context, in
pinned memory on a CUDA machine) stay the cache's storage, and a forward over it reads each layer from a two-slot
ring on the device. While layer i computes from one slot, layer i + 1 is copied into the other on a side stream;
each copy waits for an event saying the compute that last read its slot is done, and each layer's compute waits
for the event of its own copy, so the transfer of one layer overlaps the compute of the previous one and nothing
synchronises the whole device. The new tokens' keys and values are written into the slot and copied back to the
host asynchronously. ``on_chip_layers`` keeps the first layers' keys and values on the device for good: they need
no transfer.

A prompt is prefilled layer by layer instead (cache.full.LayerwiseWrite, Transformer.prefill_layerwise): each layer
takes its device buffer once (``buffers``), runs every chunk of the prompt in it and copies its new positions back
once (``write_back``), so no chunk streams the prefix written by the chunks before it again.

The head-major (layers, Hkv, positions, D) layout every cache uses keeps each KV head's prefix one contiguous range,
so a layer streams as Hkv contiguous asynchronous copies (a copy of a strided range would be staged through
pageable memory on the host, synchronously); a few copies more per layer cost microseconds against the
milliseconds a layer's transfer takes. The retrieval cache reads the host storage (RetrievalCache takes its own
device), so only its budget crosses PCIe; the drafter and its cache never touch the full cache.
"""

import torch
from triforce_cli.cache import FullCache
from triforce_cli.offload.pinning import pin_exactly
from triforce_cli.offload.queues import HostQueue, Ring, queue_for


class LayerStream:
    """The device side of an offloaded FullCache: the on-chip layers, the ring, and the copies between them and
    the host storage (see the module docstring). FullCache calls begin() from prepare, update() per layer of a
    forward (a layerwise write: buffers() and write_back() per layer), forget_beyond() on rollback and settle()
    before the host storage is read; upload() serves the retrieval cache, which reads the host storage."""

    def __init__(self, full: FullCache, device: torch.device, on_chip_layers: int, queue: HostQueue):
        num_layers, num_kv_heads, capacity, head_dim = full.keys.shape
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
        self.chip_valid = 0  # positions the on-chip layers hold as the host does
        self._prefix = 0  # positions before the prepared write: what a forward streams
        self.ring = Ring(queue, self.on_chip)

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for t in (self.chip_keys, self.chip_values, self.ring_keys, self.ring_values))

    def begin(self, full: FullCache, start: int) -> None:
        """A forward writes from start: bring the on-chip layers up to start, and start copying the first
        offloaded layer's prefix [0, start)."""
        self._prefix = start
        if self.chip_valid < start:  # after a restore from a saved prompt, or a reset
            stale = slice(self.chip_valid, start)
            for layer in range(self.on_chip):
                self._copy_heads(self.chip_keys[layer], full.keys[layer], stale)
                self._copy_heads(self.chip_values[layer], full.values[layer], stale)
            self.queue.wait("compute", self.queue.record("copy"))
            self.chip_valid = start
        self.ring.clear()
        if self.on_chip < self.num_layers:
            self._fetch(full, self.on_chip)

    @staticmethod
    def _head_copies(dst: torch.Tensor, src: torch.Tensor, positions: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(Hkv, S, D) dst[:, positions] = src[:, positions] as one contiguous (dst, src) copy per KV head."""
        return [(dst[head, positions], src[head, positions]) for head in range(src.shape[0])]

    def _copy_heads(self, dst: torch.Tensor, src: torch.Tensor, positions: slice) -> None:
        for pair in self._head_copies(dst, src, positions):
            self.queue.copy(*pair)

    def _fetch(self, full: FullCache, layer: int) -> None:
        """Copy layer's prefix into its slot (Ring.fetch: after the slot's last reader)."""
        slot, prefix = self.ring.slot(layer), slice(0, self._prefix)
        copies = self._head_copies(self.ring_keys[slot], full.keys[layer], prefix)
        self.ring.fetch(layer, copies + self._head_copies(self.ring_values[slot], full.values[layer], prefix))

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

    def write_back(self, full: FullCache, layer: int, positions: slice) -> None:
        """Copy layer's positions, written into its buffers() by the compute queued so far, back to the host
        storage, asynchronously: one contiguous copy per KV head of the keys and of the values."""
        keys, values = self._device(layer)
        if layer == self.on_chip - 1:
            self.chip_valid = positions.stop
        self.queue.wait("copy", self.queue.record("compute"))  # the new rows are written
        self._copy_heads(full.keys[layer], keys, positions)
        self._copy_heads(full.values[layer], values, positions)

    def update(
        self, full: FullCache, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FullCache.update for layer: store k, v (Hkv, T, D) on the device and back on the host; return the
        (Hkv, L, D) device views attention reads."""
        keys, values = self.buffers(full, layer)
        write = full._write
        keys[:, write] = k
        values[:, write] = v
        self.write_back(full, layer, write)
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

    def forget_beyond(self, length: int) -> None:
        self.chip_valid = min(self.chip_valid, length)

    def settle(self) -> None:
        """Return once the host storage holds every write (the copies back are asynchronous)."""
        self.queue.settle()


def offload_kv(
    full: FullCache, device: torch.device, on_chip_layers: int = 0, queue: HostQueue | None = None
) -> LayerStream:
    """Serve full's forwards on device from its host storage, streaming layer by layer (module docstring).

    Args:
        full: a FullCache built on the host in ordinary memory; for a CUDA device its keys and values are
            page-locked here, exactly their bytes (offload/pinning.py).
        device: where the model computes.
        on_chip_layers: the first layers kept on the device, never streamed.
        queue: streams and events for the copies; by default CUDA's on a GPU, the host's (no-ops) on the CPU.
    Returns:
        The stream now installed as full.stream.
    """
    if full.keys.device.type != "cpu":
        raise ValueError(f"an offloaded full cache lives in host memory, not on {full.keys.device}")
    if full.window is not None:
        raise ValueError("a full cache keeping only a sliding window cannot be offloaded: its forwards stream from 0")
    if torch.device(device).type == "cuda":  # asynchronous copies need page-locked host memory
        pin_exactly(full.keys)
        pin_exactly(full.values)
    stream = LayerStream(full, torch.device(device), on_chip_layers, queue or queue_for(torch.device(device)))
    full.stream = stream
    return stream
