"""Attention, linear and retrieval kernels: FlashAttention where installed on CUDA, torch SDPA, and a CPU path.

Every kernel here has a plain-torch reference beside it that the tests compare against.
"""

from kernels.attention import (
    ATTENTION_BACKENDS,
    PackedPrefix,
    attention,
    attention_backend,
    attention_in_cache,
    attention_reference,
)
from kernels.linear import (
    half_weight_linear,
    half_weight_linear_reference,
    half_weights_available,
    linear,
    linear_reference,
    pack_half_weight,
    unpack_half_weight,
)
from kernels.retrieval import chunk_mean_keys, gather_chunks, score_chunks, top_chunks

__all__ = [
    "ATTENTION_BACKENDS",
    "PackedPrefix",
    "attention",
    "attention_backend",
    "attention_in_cache",
    "attention_reference",
    "chunk_mean_keys",
    "gather_chunks",
    "half_weight_linear",
    "half_weight_linear_reference",
    "half_weights_available",
    "linear",
    "linear_reference",
    "pack_half_weight",
    "score_chunks",
    "top_chunks",
    "unpack_half_weight",
]
