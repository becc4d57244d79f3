"""Retrieval-cache kernels: chunk summaries, GQA-aware chunk scores, top-chunk choice and gather.

TriForce (Sun et al., 2024, arXiv 2404.11912) scores each chunk of the prompt's cached keys by the current
query against the chunk's mean key and keeps the best chunks that fit the budget (score "mean"). Quest (Tang et
al., 2024, arXiv 2406.10774) keeps each chunk's elementwise minimum and maximum key instead and scores a chunk by
an upper bound of the largest attention logit any of its keys can reach (score "bound"): a chunk with one key that
matters is not averaged away.

Scores, top-chunk choice and gather take any leading dimensions (the layers of a cache), so that one call serves
every layer at once.
"""

import itertools
import math
from enum import StrEnum

import torch
from triforce_cli.kernels.native import native_loaded

MEAN_KEY_BLOCK = 1024  # chunks averaged at once


class ChunkScore(StrEnum):
    """How a retrieval-cache chunk is scored against the current query."""

    MEAN = "mean"  # the query against the chunk's mean key (TriForce)
    BOUND = "bound"  # an upper bound from the chunk's minimum and maximum keys (Quest)


CHUNK_SCORES = tuple(score.value for score in ChunkScore)
SUMMARIES = {ChunkScore.MEAN: 1, ChunkScore.BOUND: 2}  # keys kept per chunk: the mean; the minimum and the maximum
SCORE_BLOCK_BYTES = 1 << 28  # float32 copy of summaries that one scoring op makes at most (summary_scores)
SCORE_WORKSPACE_BYTES = 1 << 23  # a retrieval cache's float32 buffer for that copy, kept (score_workspace)


def chunk_mean_keys(k: torch.Tensor, chunk_size: int, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Mean key of every complete chunk. k (Hkv, L, D) with L a multiple of chunk_size -> float32 (Hkv, L/chunk, D).

    Averaged in float32 MEAN_KEY_BLOCK chunks at a time, so that a 16-bit k is never copied whole to float32 (a
    layer's keys at 128K tokens, half a gigabyte for a model with 8 KV heads of 128).

    workspace: a float32 buffer (N,) (score_workspace) the blocks' float32 copies are written into, blocks then of
    as many chunks as it holds (up to MEAN_KEY_BLOCK): the same means without a fresh copy's first touches of its
    pages (summarising the embedded model's 32K-token prompt: 62 ms, 39 with it).
    """
    num_kv_heads, length, head_dim = k.shape
    chunks = k.reshape(num_kv_heads, length // chunk_size, chunk_size, head_dim)
    means = torch.empty((num_kv_heads, chunks.shape[1], head_dim), dtype=torch.float32, device=k.device)
    held = 0 if workspace is None else workspace.numel() // (num_kv_heads * chunk_size * head_dim)
    step = min(MEAN_KEY_BLOCK, held) or MEAN_KEY_BLOCK
    for first in range(0, chunks.shape[1], step):
        means[:, first : first + step] = _float32(chunks[:, first : first + step], workspace).mean(dim=2)
    return means


def _float32(block: torch.Tensor, workspace: torch.Tensor | None) -> torch.Tensor:
    """block in float32: copied into workspace's first elements where it holds them, else a fresh copy."""
    if workspace is not None and block.numel() <= workspace.numel():
        return workspace[: block.numel()].view(block.shape).copy_(block)
    return block.float()


def score_chunks(q: torch.Tensor, mean_keys: torch.Tensor) -> torch.Tensor:
    """Score of each chunk for each KV head, summed over the query heads that share it.

    q (..., Hq, D), mean_keys (..., Hkv, C, D) in any float dtype -> float32 (..., Hkv, C). The sum of the group's
    dot products with a mean key is the dot product of the group's summed query with it.
    """
    grouped = q.float().unflatten(-2, (mean_keys.shape[-3], -1)).sum(dim=-2)  # (..., Hkv, D)
    return torch.einsum("...hd,...hcd->...hc", grouped, mean_keys.float())


def chunk_key_bounds(k: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise minimum and maximum key of every complete chunk, exact in k's dtype.
    k (Hkv, L, D) with L a multiple of chunk_size -> two (Hkv, L/chunk, D)."""
    num_kv_heads, length, head_dim = k.shape
    chunks = k.reshape(num_kv_heads, length // chunk_size, chunk_size, head_dim)
    return chunks.amin(dim=2), chunks.amax(dim=2)


def bound_scores(q: torch.Tensor, min_keys: torch.Tensor, max_keys: torch.Tensor) -> torch.Tensor:
    """Quest's bound of each chunk for each KV head, summed over the query heads that share it: per query head,
    sum over d of max(q_d * min_d, q_d * max_d), no smaller than q . k for any key k of the chunk. The positive
    parts of the queries meet the maximum keys and the negative parts the minimum keys, so the group's sum is two
    products. q (..., Hq, D), min_keys and max_keys (..., Hkv, C, D) -> float32 (..., Hkv, C)."""
    grouped = q.float().unflatten(-2, (min_keys.shape[-3], -1))  # (..., Hkv, group, D)
    positive, negative = grouped.clamp(min=0).sum(dim=-2), grouped.clamp(max=0).sum(dim=-2)  # (..., Hkv, D)
    return torch.einsum("...hd,...hcd->...hc", positive, max_keys.float()) + torch.einsum(
        "...hd,...hcd->...hc", negative, min_keys.float()
    )


def chunk_summaries(
    k: torch.Tensor, chunk_size: int, score: str, workspace: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """What `score` keeps of every complete chunk of k (Hkv, L, D): its mean key (averaged through workspace where
    given: chunk_mean_keys), or its minimum and maximum keys."""
    if score == "mean":
        return (chunk_mean_keys(k, chunk_size, workspace),)
    return chunk_key_bounds(k, chunk_size)


def summary_scores(
    q: torch.Tensor, summaries: torch.Tensor, score: str, workspace: torch.Tensor | None = None
) -> torch.Tensor:
    """Chunk scores (..., Hkv, C) float32 of q (..., Hq, D) from the summaries (SUMMARIES[score], ..., Hkv, C, D).

    Each op copies the summaries it scores to float32. With a leading dimension (layers), q's rows are scored in
    blocks whose copy takes at most SCORE_BLOCK_BYTES: for 128K tokens in chunks of 16, every layer's mean keys of
    Llama-3.1-8B would take 1 GiB in float32, one layer's 32 MiB. Each (row, KV head) is the same product in any
    block, so the blocks give the scores one op would.

    workspace: a float32 buffer (N,) (score_workspace) that the blocks' copies are written into, blocks then of as
    many rows as it holds: a fresh copy of tens of megabytes costs more in first touches of its pages than in the
    copying (at 32K tokens, the embedded model's 47 MB of mean keys: 24 ms a selection against 3 in blocks of 8 MiB
    written into one buffer). Rows it cannot hold are copied as without it.
    """
    if q.dim() == 2:
        return _scores(q, summaries, score)
    row_elements = summaries[:, 0].numel()
    held = 0 if workspace is None else workspace.numel() // row_elements
    rows = held or max(1, SCORE_BLOCK_BYTES // (row_elements * 4))
    blocks = [
        _scores(q[i : i + rows], _float32(summaries[:, i : i + rows], workspace), score)
        for i in range(0, q.shape[0], rows)
    ]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def score_workspace(summary_shape: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """A float32 buffer for summary_scores' copies of summaries of summary_shape (SUMMARIES[score], layers, Hkv, C,
    D): SCORE_WORKSPACE_BYTES, or one layer's where that is more, or all of them where that is less."""
    summaries, layers, *per_layer = summary_shape
    row = summaries * math.prod(per_layer)
    rows = min(layers, max(1, SCORE_WORKSPACE_BYTES // (row * 4)))
    return torch.empty(rows * row, dtype=torch.float32, device=device)


def _scores(q: torch.Tensor, summaries: torch.Tensor, score: str) -> torch.Tensor:
    return score_chunks(q, summaries[0]) if score == "mean" else bound_scores(q, summaries[0], summaries[1])


def top_chunks(scores: torch.Tensor, num_chunks: int, first_selectable: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (..., Hkv, num_chunks), ascending, of the best chunks per KV head of scores (..., Hkv, C); chunk 0
    (the sinks) always kept.

    first_selectable: (...,) per leading index (a layer), the first chunk that may be chosen: the chunks before it
    lie before a sliding window, chunk 0 included. They are taken only where fewer than num_chunks remain, and then
    come first, as many for every KV head of that index (the reader skips them, RetrievalCache.first_slots).
    """
    scores = scores.clone()
    scores[..., 0] = float("inf")
    if first_selectable is not None:
        chunk = torch.arange(scores.shape[-1], device=scores.device)
        scores.masked_fill_(chunk < first_selectable[..., None, None], float("-inf"))
    chosen = scores.topk(num_chunks, dim=-1).indices
    return chosen.sort(dim=-1).values


def gather_chunks(
    k: torch.Tensor, chunk_ids: torch.Tensor, chunk_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Tokens of the chosen chunks. k (..., Hkv, L, D), chunk_ids (..., Hkv, n) -> (..., Hkv, n*chunk_size, D),
    written into out (a view of that shape, any strides) where given.

    A chunk's chunk_size rows of D lie next to each other in k, so each (leading index, KV head) copies whole chunks,
    rows of chunk_size * D elements chosen by an index of n: no index of every element (which for a 4,096-token
    budget over 30 layers would itself take 190 MB of int64). On the CPU, where the extension is loaded and each
    head's rows lie D apart in k and out, one call copies every chunk of every head (csrc/gather_chunks.cpp): at 32K
    tokens the embedded model's choice (90 heads of 64 chunks of 16) took 2.2 ms for keys or values in an
    index_select a head within a decoding, 0.95 ms in one call.
    """
    length, dim = k.shape[-2:]
    if out is None:
        out = k.new_empty((*chunk_ids.shape[:-1], chunk_ids.shape[-1] * chunk_size, dim))
    if _copies_in_one_call(k, chunk_ids, out):
        torch.ops.triforce_cpu.gather_chunks(k, chunk_ids, chunk_size, out)
        return out
    whole = length // chunk_size * chunk_size
    chunks = k[..., :whole, :].unflatten(-2, (whole // chunk_size, chunk_size))  # (..., Hkv, C, chunk, D)
    picked = out.unflatten(-2, (chunk_ids.shape[-1], chunk_size))  # (..., Hkv, n, chunk, D)
    for index in itertools.product(*(range(size) for size in chunk_ids.shape[:-1])):
        rows, ids = picked[index], chunk_ids[index]  # (n, chunk, D), (n,)
        if rows.is_contiguous():
            torch.index_select(chunks[index].flatten(-2), 0, ids, out=rows.view(len(ids), -1))
        else:
            rows.copy_(chunks[index].index_select(0, ids))
    return out


def _copies_in_one_call(k: torch.Tensor, chunk_ids: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether gather_chunks copies with the extension's one call: CPU tensors of one dtype, int64 ids, one leading
    shape, the extension loaded, and in k and out rows of D contiguous and D apart."""
    dim = k.shape[-1]
    return (
        k.device.type == out.device.type == chunk_ids.device.type == "cpu"
        and k.dim() == out.dim() == chunk_ids.dim() + 1
        and k.shape[:-2] == out.shape[:-2] == chunk_ids.shape[:-1]
        and k.dtype == out.dtype
        and chunk_ids.dtype == torch.int64
        and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (k, out))
        and native_loaded()
    )
