"""What one target forward of T new tokens costs after a long prompt, against the full and the retrieval cache.

Speculation pays only when verifying T tokens costs little more than one decode step, so `triforce bench
--forward-costs 1,2,4,8` times exactly that: T tokens appended to the prefilled prompt, rolled back after each
repeat, with the logits of all T positions as a verification needs them.
"""

import statistics
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from triforce_cli.cache import FullCache, RetrievalCache, kv_dtype
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.stats import summary_of
from triforce_cli.runtime.loading import LoadedModel


@dataclass
class ForwardCost:
    """The measured milliseconds of forwards of `tokens` new tokens after a prompt of `context` tokens, on one cache
    (plan.model.PredictedForward holds predicted ones)."""

    prompt: str
    context: int
    cache: str  # "full" or "retrieval"
    tokens: int
    ms: list[float]  # one per repeat

    DERIVED: ClassVar[tuple[str, ...]] = ("median_ms", "min_ms", "max_ms")

    median_ms = summary_of("ms", statistics.median)
    min_ms = summary_of("ms", min)
    max_ms = summary_of("ms", max)


def _time_forward(target: LoadedModel, cache, new_ids: torch.Tensor, start: int, repeats: int) -> list[float]:
    """Milliseconds of each forward; on a GPU each ends when the device has finished it, not when it was queued."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        began = time.perf_counter()
        with torch.inference_mode():
            target.model(new_ids, start, cache, num_logits=len(new_ids))
        if new_ids.is_cuda:
            torch.cuda.synchronize(new_ids.device)
        times.append(1000 * (time.perf_counter() - began))
        cache.rollback(start)
    return times[1:]


def measure_forward_costs(
    prompt: str,
    target: LoadedModel,
    state: PromptState,
    token_counts: tuple[int, ...],
    repeats: int,
    budget: int,
    chunk_size: int,
) -> list[ForwardCost]:
    """Median-ready timings of forwards of each token count, full cache first, then the retrieval cache."""
    cfg = target.model.config
    context, held = state.prompt_ids.shape[0], state.keys.shape[2]
    most = max(token_counts)
    window = cfg.shared_window if held < context else None  # a state that kept only the window: as it was held
    cache_dtype = kv_dtype(target.device, target.dtype)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, held + most, cache_dtype, target.device)
    full = FullCache(*shape, window=window)
    state.restore(full)
    retrieval = RetrievalCache(full, budget, chunk_size, chunk_size + most, windows=cfg.sliding_windows)
    retrieval.select_chunks()
    new_ids = state.prompt_ids[-most:].to(target.device)  # any tokens: only the cost is measured
    costs = []
    for name, cache in (("full", full), ("retrieval", retrieval)):
        for count in token_counts:
            ms = _time_forward(target, cache, new_ids[:count], context, repeats)
            costs.append(ForwardCost(prompt, context, name, count, ms))
    return costs
