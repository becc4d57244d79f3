"""A prompt's prefill into one cache: the target's full cache chunk by chunk (or, offloaded, layer by layer), the
drafter's StreamingLLM cache from its last windows alone. Engine.generate calls these in its step 2.
"""

from collections.abc import Callable

import torch

from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache
from triforce_cli.decoding.clock import DeviceClock
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.offload import prefill_layerwise
from triforce_cli.runtime.environment import available_memory, torch_threads
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.parallel import least

PrefillCallback = Callable[[str, int, int], None]  # (model name, tokens done, tokens total)
ChunkCallback = Callable[[float], None]  # seconds one prefill chunk took on the device

# windows of the prompt's last positions the drafter's prefill computes (prefill_drafter): its cache keeps one; the
# one before gives every kept position the window it would have seen after a prefill of the whole prompt
DRAFTER_READS = 2


def prefill(
    loaded: LoadedModel,
    cache,
    ids: list[int],
    chunk: int,
    threads: int | None = None,
    on_prefill: PrefillCallback | None = None,
    on_chunk: ChunkCallback | None = None,
    first: int = 0,
    retrieval: RetrievalCache | None = None,
) -> torch.Tensor | None:
    """Run the prompt through model in chunks of `chunk` tokens on `threads` (None: torch's); return the logits
    (1, V) after its last token.

    A full cache in host memory is prefilled layer by layer (offload.prefill_layerwise, in segments that fit the
    least free memory of any rank, parallel.least, summarising chunks into retrieval as it goes); any other cache
    chunk by chunk. A chunk is timed by the device's clock (DeviceClock): on a GPU to the end of its work, which the
    host then waits for, not to the end of its launch; without on_chunk nothing is timed and nothing waits.

    Args:
        loaded, cache: the model that computes, and the cache it writes.
        ids: the prompt's token ids.
        on_prefill: receives (the model's name, tokens done, tokens total) after each chunk.
        on_chunk: receives each chunk's seconds.
        first: the positions before it are in the cache already (kept from what it held, Held.reusable: a multiple
            of the chunk but under the numeric contract); the chunks start there.
        retrieval: the retrieval cache a layer-wise prefill fills beside the full cache, or None.
    Returns:
        The logits after the last token; None where no chunk ran (first at the prompt's end).
    """
    name, model = loaded.name, loaded.model
    tokens = torch.tensor(ids, dtype=torch.long, device=model.device)
    clock = DeviceClock(tokens.device)
    logits = None
    with torch_threads(threads):
        if isinstance(cache, FullCache) and cache.stream is not None:
            return prefill_layerwise(
                model,
                cache,
                tokens,
                chunk,
                first=first,
                free=least(available_memory(tokens.device), tokens.device),
                retrieval=retrieval,
                on_progress=None if on_prefill is None else lambda done, total: on_prefill(name, done, total),
                on_chunk=on_chunk,
                clock=clock,
            )
        for start in range(first, len(ids), chunk):
            began = clock.mark() if on_chunk is not None else None
            logits = model(tokens[start : start + chunk], start, cache, num_logits=1, decoding=False)
            if on_chunk is not None:
                on_chunk(clock.seconds(began, clock.mark()))
            if on_prefill is not None:
                on_prefill(name, min(start + chunk, len(ids)), len(ids))
    return logits


def prefill_drafter(
    drafter: LoadedModel,
    streaming: StreamingCache,
    prompt_ids: list[int],
    chunk: int,
    config: EngineConfig,
    threads: int | None = None,
    on_prefill: PrefillCallback | None = None,
) -> None:
    """Prefill the drafter's StreamingLLM cache with the prompt's sinks (config.sink_tokens) and its last
    DRAFTER_READS windows (config.draft_window) only.

    Its cache keeps the sinks and the last window, so the positions before those windows would be computed only
    to be evicted; each kept position still sees a window of the ones before it. The time is the same for any
    prompt length, and the same prompt always leaves the same drafter state, prefix reuse or not.
    """
    sinks = min(config.sink_tokens, len(prompt_ids))
    resume = max(sinks, len(prompt_ids) - DRAFTER_READS * config.draft_window)
    if sinks:
        prefill(drafter, streaming, prompt_ids[:sinks], chunk, threads)
    streaming.start_window_at(resume)
    prefill(drafter, streaming, prompt_ids, chunk, threads, on_prefill, first=resume)
