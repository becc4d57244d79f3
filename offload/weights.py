"""Decoder layers' weights in host memory, streamed to the device through a two-slot ring, for models larger than
the card (``--offload kv+weights``).

``offload_weights(model, device, resident_layers)`` transforms a built model, whether its parameters are still in
host memory (as the loader calls it, before anything crosses to the device: runtime/loading.py) or on the device
already: the layers from ``resident_layers`` on keep their parameters in host memory (page-locked, exactly their
bytes, on a CUDA machine: offload/pinning.py), and a forward pre-hook on each points its parameters at a device
slot that holds its copy, once the copy's event is reached, and starts copying the next streamed layer into the
other slot, after the compute that last read that slot. The first streamed layer's copy starts when a forward
begins (a pre-hook on the embedding). Every decoder layer has the same parameter shapes, so two slots of one
layer's tensors serve them all. The same queue (offload/queues.py) orders the copies: CUDA streams and events on a
GPU, no-ops on the CPU. The other parameters are left where they are.
"""

import torch
from torch import nn
from triforce_cli.offload.pinning import pin_exactly
from triforce_cli.offload.queues import HostQueue, Ring, queue_for


class WeightStream:
    def __init__(self, layers: nn.ModuleList, embedding: nn.Module, device: torch.device, resident: int, queue):
        self.layers = list(layers)
        self.first = max(0, min(resident, len(self.layers)))
        self.ring = Ring(queue, self.first)
        pin = device.type == "cuda"
        # one layer's bytes, constant whichever tensors its parameters point at
        self.layer_bytes = sum(p.numel() * p.element_size() for p in self.layers[0].parameters())
        self.host: dict[int, list[torch.Tensor]] = {}
        for index in range(self.first, len(self.layers)):
            self.host[index] = [self._host_copy(p, pin) for p in self.layers[index].parameters()]
            for param, host in zip(self.layers[index].parameters(), self.host[index], strict=True):
                param.data = host  # frees a device copy: the slots hold what a forward reads
        template = self.host.get(self.first, [])
        self.slots = [[torch.empty_like(t, device=device) for t in template] for _ in range(min(2, len(self.host)))]
        if self.host:
            embedding.register_forward_pre_hook(lambda module, args: self._fetch(self.first))
            for index in self.host:
                self.layers[index].register_forward_pre_hook(lambda module, args, index=index: self._arrive(index))

    @staticmethod
    def _host_copy(param: torch.Tensor, pin: bool) -> torch.Tensor:
        """param's values in host memory: for a CUDA device a fresh copy, page-locked (a checkpoint's tensor may be a
        view of a memory-mapped file, which cannot be locked, or of a larger storage); else param itself where it
        is in host memory already."""
        if pin:
            return pin_exactly(param.detach().to("cpu", copy=True))
        return param.detach().to("cpu")

    @property
    def streamed_layers(self) -> list[nn.Module]:
        """The layers whose weights live in host memory."""
        return [self.layers[index] for index in self.host]

    @property
    def device_bytes(self) -> int:
        return sum(t.nbytes for slot in self.slots for t in slot)

    @property
    def host_bytes(self) -> int:
        return sum(t.nbytes for tensors in self.host.values() for t in tensors)

    def _fetch(self, index: int) -> None:
        """Copy layer index's weights into its slot (Ring.fetch: after the slot's last reader)."""
        self.ring.fetch(index, list(zip(self.slots[self.ring.slot(index)], self.host[index], strict=True)))

    def _arrive(self, index: int) -> None:
        """Before layer index computes: wait for its copy, read it from its slot, and start the next layer's."""
        self.ring.arrive(index)
        for param, slot in zip(self.layers[index].parameters(), self.slots[self.ring.slot(index)], strict=True):
            param.data = slot
        if index + 1 < len(self.layers):
            self._fetch(index + 1)


def offload_weights(
    model: nn.Module, device: torch.device, resident_layers: int = 0, queue: HostQueue | None = None
) -> WeightStream:
    """Stream model's decoder layers from resident_layers on from host memory (module docstring).

    Args:
        model: a runtime Transformer with dense weights (packed half or quantized weights are no parameters and
            cannot be streamed this way), its parameters in host memory or on device.
        device: where it computes.
        resident_layers: the first layers whose weights stay on the device.
        queue: streams and events for the copies; by default CUDA's on a GPU, no-ops on the CPU.
    Returns:
        The stream, also kept as model.weight_stream.
    """
    layers = model.model.layers
    if any(hasattr(module, "tiles") or hasattr(module, "scales_and_zeros") for module in layers.modules()):
        raise ValueError("streamed weights must be dense (`weights` dense)")
    stream = WeightStream(
        layers,
        model.model.embed_tokens,
        torch.device(device),
        resident_layers,
        queue or queue_for(torch.device(device)),
    )
    model.weight_stream = stream
    return stream
