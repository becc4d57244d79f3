"""CPU offload for GPUs too small for the full KV cache: host storage streamed layer by layer (kv.py)."""

from offload.kv import LayerStream, offload_kv
from offload.queues import CudaQueue, HostQueue, queue_for

__all__ = ["CudaQueue", "HostQueue", "LayerStream", "offload_kv", "queue_for"]
