"""Where host-device copies run beside compute, and the events that order the two.

A queue has two streams, "compute" (where the model runs) and "copy" (a side stream for transfers), and events
recorded on one and waited for on the other: CUDA streams and events on a GPU. On the CPU the host is the device,
every copy is done when the call returns, and recording or waiting does nothing, so the same code runs and gives
the same tokens; tests instrument a HostQueue to check the order of what a GPU would overlap.

The same events order a CUDA graph's capture: a copy stream that waits for an event recorded on the capturing
stream joins the capture (a fork), and the capturing stream's wait for the copy stream's event joins it back, so a
Ring's copies inside a captured step become graph nodes that overlap its compute as they do eagerly. Every copy
queued inside a capture must be waited for by the compute before the capture ends (Ring.arrive of every layer
fetched), and reads pinned host memory (a pageable copy would synchronise, which a capture refuses).
"""

import torch


class HostQueue:
    """Copies done at once; events and waits that order nothing, there being one timeline."""

    def record(self, stream: str) -> object:
        """An event marking the work queued so far on stream ("compute" or "copy")."""
        return stream

    def wait(self, stream: str, event: object) -> None:
        """Have stream wait for event before its next work."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) on the copy stream."""
        dst.copy_(src)

    def settle(self) -> None:
        """Return once every copy queued so far is done."""


class CudaQueue(HostQueue):
    """A side CUDA stream for copies, ordered against the current stream by events: no device-wide synchronise."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def _stream(self, name: str) -> torch.cuda.Stream:
        return self.copy_stream if name == "copy" else torch.cuda.current_stream(self.device)

    def record(self, stream: str) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return event

    def wait(self, stream: str, event: torch.cuda.Event) -> None:
        self._stream(stream).wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)  # truly asynchronous: pinned host memory, contiguous ranges

    def settle(self) -> None:
        self.copy_stream.synchronize()  # the copy stream only: compute queued beside it goes on


class Ring:
    """The order of a two-slot device ring that layers from ``first`` on take in turn (offload/kv.py for KV
    caches, offload/weights.py for weights): a copy into a slot waits for the compute queued so far, which holds
    the slot's last reader, and a layer's compute waits for its own copy."""

    def __init__(self, queue: HostQueue, first: int):
        self.queue = queue
        self.first = first
        self._copied: dict[int, object] = {}  # layer -> event of its copy into its slot

    def slot(self, layer: int) -> int:
        return (layer - self.first) % 2

    def fetch(self, layer: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue layer's (dst, src) copies into its slot, after the compute queued so far."""
        self.queue.wait("copy", self.queue.record("compute"))
        for dst, src in copies:
            self.queue.copy(dst, src)
        self._copied[layer] = self.queue.record("copy")

    def arrive(self, layer: int) -> None:
        """Have the compute wait for layer's copy before it reads the slot."""
        self.queue.wait("compute", self._copied.pop(layer))

    def clear(self) -> None:
        """Forget copies no forward will wait for (a forward cut short)."""
        self._copied.clear()


def queue_for(device: torch.device) -> HostQueue:
    return CudaQueue(device) if device.type == "cuda" else HostQueue()
