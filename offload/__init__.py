"""CPU offload for GPUs too small for the model: the full KV cache (kv.py, prefilled layer by layer: prefill.py) and
decoder layers' weights (weights.py) in host memory, streamed to the device layer by layer; on a CUDA machine that
host memory is page-locked, exactly its bytes (pinning.py)."""

from triforce_cli.offload.kv import LayerStream, offload_kv
from triforce_cli.offload.pinning import pin_exactly, pinned_bytes
from triforce_cli.offload.prefill import prefill_layerwise
from triforce_cli.offload.queues import CudaQueue, HostQueue, queue_for
from triforce_cli.offload.weights import WeightStream, offload_weights

__all__ = [
    "CudaQueue",
    "HostQueue",
    "LayerStream",
    "WeightStream",
    "offload_kv",
    "offload_weights",
    "pin_exactly",
    "pinned_bytes",
    "prefill_layerwise",
    "queue_for",
]
