"""The warm-up of fixed-shape decode steps: every padded length a generation's steps take, recorded (as CUDA graphs,
or compiled) on the caches they write (runtime/graphs.py) before decoding needs them, and timed apart from the
prefill and the decode (GenerationStats.compile_seconds).

Steps on caches made static are recorded once per padded length and cache; the caches keep their addresses
(decoding/cache_pool.py), so the first generation records what decoding takes and later ones nothing. An offloaded
full cache's steps are recorded per length bucket (KVCache.step_slots), which the prompt decides: after the prefill.
"""

import time
from collections.abc import Iterator

import torch

from triforce_cli.cache import KVCache
from triforce_cli.decoding.cache_pool import InUse
from triforce_cli.decoding.sizing import CacheSpec
from triforce_cli.runtime.model import Transformer, padded_length


def recorded_steps(spec: CacheSpec, caches: InUse) -> Iterator[tuple[Transformer, KVCache, int]]:
    """The fixed-shape decode steps a generation takes: (model, cache, most tokens of one step). The full tier
    verifies its proposer's drafts and one token more; the retrieval tier gamma1 drafts and one more (one
    without a drafter); the drafter writes its last token and the bonus token of each tier above it, which it
    has not seen (ModelTier._forward). Its longer writes, of committed tokens it catches up on, run eager."""
    cfg, target = spec.config, spec.target.model
    top = cfg.gamma2 if cfg.uses_retrieval else cfg.gamma1 if cfg.uses_drafter else 0
    steps = [(target, caches.full, top + 1)]
    if caches.retrieval is not None:
        steps.append((target, caches.retrieval, cfg.gamma1 + 1 if cfg.uses_drafter else 1))
    if caches.streaming is not None:
        above = 2 if caches.retrieval is not None else 1
        steps.append((spec.drafter, caches.streaming, min(1 + above, caches.streaming.max_write)))
    for model, cache, longest in steps:
        if model.fixed_step is not None and cache.write_start is not None:
            yield model, cache, longest


def warm_up(spec: CacheSpec, caches: InUse, prefilled: bool = False) -> float:
    """Record every padded length of every fixed-shape step (recorded_steps) not yet recorded on these caches, and
    return the seconds it took. Each step runs at the cache's current length, written past what the cache holds
    and rolled back after, so a prefix kept from the last prefill (and the retrieval cache's summaries of its
    chunks) stays. The drafter's cache records no step longer than its longest (StepGraphs.limit).

    prefilled: record the steps of an offloaded full cache, after the prefill, at the prompt's length; else
    every other step, before the prefill."""
    pending = []
    for model, cache, longest in recorded_steps(spec, caches):
        if (cache is caches.full and spec.offloaded) != prefilled:
            continue
        if cache is caches.streaming:
            model.step_graphs.limit(cache, padded_length(longest))
        lengths = [1 << power for power in range(padded_length(longest).bit_length())]
        held = cache.length
        pending += [
            (model, cache, n) for n in lengths if not model.step_graphs.holds(cache, n, cache.step_slots(held + n))
        ]
    if not pending:
        return 0.0
    started = time.perf_counter()
    for model, cache, length in pending:
        held = cache.length
        model(torch.zeros(length, dtype=torch.long, device=spec.device), held, cache, num_logits=1)
        cache.rollback(held)
    if spec.device.type == "cuda":
        torch.cuda.synchronize(spec.device)  # the warm-up's work stays out of the prefill's time
    return time.perf_counter() - started
