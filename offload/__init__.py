"""CPU offload for GPUs too small for the model: the full KV cache (kv.py) and decoder layers' weights (weights.py)
in host memory, streamed to the device layer by layer."""

from offload.kv import LayerStream, offload_kv
from offload.queues import CudaQueue, HostQueue, queue_for
from offload.weights import WeightStream, offload_weights

__all__ = ["CudaQueue", "HostQueue", "LayerStream", "WeightStream", "offload_kv", "offload_weights", "queue_for"]
