"""Attention, linear and retrieval kernels: FlashAttention where installed on CUDA, torch SDPA, and a CPU path.

Every kernel here has a plain-torch reference beside it that the tests compare against.
"""

from kernels.attention import attention, attention_reference
from kernels.linear import linear, linear_reference
from kernels.retrieval import chunk_mean_keys, gather_chunks, score_chunks, top_chunks

__all__ = [
    "attention",
    "attention_reference",
    "chunk_mean_keys",
    "gather_chunks",
    "linear",
    "linear_reference",
    "score_chunks",
    "top_chunks",
]
