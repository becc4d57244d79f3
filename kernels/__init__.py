"""Attention, linear and retrieval kernels: FlashAttention where installed on CUDA, torch SDPA, and a CPU path.

Every kernel here has a plain-torch reference beside it that the tests compare against.
"""

from triforce_cli.kernels.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    attention,
    attention_backend,
    attention_in_cache,
    attention_reference,
    runs_cache_attention,
    segment_keys,
)
from triforce_cli.kernels.linear import (
    half_weights_available,
    linear,
    linear_reference,
    pack_tiles,
    pad_bias,
    tiled_linear,
    tiled_linear_available,
    tiled_linear_reference,
    unpack_tiles,
)
from triforce_cli.kernels.retrieval import (
    CHUNK_SCORES,
    SUMMARIES,
    ChunkScore,
    chunk_mean_keys,
    chunk_summaries,
    gather_chunks,
    score_chunks,
    score_workspace,
    summary_scores,
    top_chunks,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "CHUNK_SCORES",
    "SUMMARIES",
    "AttentionBackend",
    "ChunkScore",
    "attention",
    "attention_backend",
    "attention_in_cache",
    "attention_reference",
    "chunk_mean_keys",
    "chunk_summaries",
    "gather_chunks",
    "half_weights_available",
    "linear",
    "linear_reference",
    "pack_tiles",
    "pad_bias",
    "runs_cache_attention",
    "score_chunks",
    "score_workspace",
    "segment_keys",
    "summary_scores",
    "tiled_linear",
    "tiled_linear_available",
    "tiled_linear_reference",
    "top_chunks",
    "unpack_tiles",
]
