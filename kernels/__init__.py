"""Attention, linear and retrieval kernels: FlashAttention where installed on CUDA, torch SDPA, and a CPU path.

Every kernel here has a plain-torch reference beside it that the tests compare against.
"""

from triforce_cli.kernels.attention import (
    ATTENTION_BACKENDS,
    attention,
    attention_backend,
    attention_in_cache,
    attention_reference,
)
from triforce_cli.kernels.linear import (
    half_weight_linear,
    half_weight_linear_reference,
    half_weights_available,
    linear,
    linear_reference,
    pack_half_weight,
    unpack_half_weight,
)
from triforce_cli.kernels.retrieval import (
    CHUNK_SCORES,
    SUMMARIES,
    chunk_mean_keys,
    chunk_summaries,
    gather_chunks,
    score_chunks,
    summary_scores,
    top_chunks,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CHUNK_SCORES",
    "SUMMARIES",
    "attention",
    "attention_backend",
    "attention_in_cache",
    "attention_reference",
    "chunk_mean_keys",
    "chunk_summaries",
    "gather_chunks",
    "half_weight_linear",
    "half_weight_linear_reference",
    "half_weights_available",
    "linear",
    "linear_reference",
    "pack_half_weight",
    "score_chunks",
    "summary_scores",
    "top_chunks",
    "unpack_half_weight",
]
