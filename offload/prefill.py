"""The prefill of a full KV cache offloaded to host memory (offload_kv), layer by layer.

Chunk by chunk, every chunk would stream every layer's whole prefix to the device again (about 2 TB over PCIe for
128K tokens of an 8B model); layer by layer (the model's prefill_layerwise), each layer's keys and values go back to
the host once.
"""

from collections.abc import Callable
from typing import Protocol

import torch
from triforce_cli.cache import FullCache, RetrievalCache


class Clock(Protocol):
    """Marks in a device's queue of work and the seconds between two (the engine's DeviceClock)."""

    def mark(self) -> object: ...

    def seconds(self, start: object, end: object) -> float: ...


def prefill_layerwise(
    model,
    full: FullCache,
    tokens: torch.Tensor,
    chunk: int,
    *,
    first: int = 0,
    free: int | None = None,
    retrieval: RetrievalCache | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_chunk: Callable[[float], None] | None = None,
    clock: Clock | None = None,
) -> torch.Tensor:
    """Prefill tokens into the offloaded full cache layer by layer (model.prefill_layerwise); the logits (1, V)
    after the last token.

    The hidden states of the tokens in flight stay on the device: the whole prompt where they take at most half of
    free (the rest left to one forward's activations), else segments of as many chunks as fit there, each fetching
    the segments before it once per offloaded layer. A retrieval cache over full summarises each layer's chunks from
    its keys on the device as the layer ends (RetrievalCache.summarise_layer), where its first selection would
    average them in host memory.

    Args:
        model: the target (runtime.model.Transformer): prefill_layerwise and prefill_layerwise_bytes.
        full: the offloaded full cache, holding [0, first) already.
        tokens: (T,) the prompt's token ids on the device.
        chunk: tokens per forward of a layer.
        first: the first position to prefill.
        free: the device's free bytes (under tensor parallelism the least of any rank's, so that every rank
            all-reduces the same segments); None: unknown, one segment.
        retrieval: the retrieval cache in use, or None.
        on_progress: receives (tokens done, tokens total), a segment's tokens counted in proportion to the layers
            done.
        on_chunk: receives each chunk's seconds on clock: its segment's mean.
        clock: the device's clock; needed with on_chunk.
    Returns:
        Float32 logits (1, V) after the last token.
    """
    total = len(tokens)
    segment = total - first
    if free is not None and model.prefill_layerwise_bytes(segment) > free // 2:
        segment = max(1, free // 2 // model.prefill_layerwise_bytes(chunk)) * chunk
    num_layers = model.config.num_layers
    summarise = retrieval is not None and retrieval.full is full
    logits = None
    for start in range(first, total, segment):
        size = min(segment, total - start)

        def on_layer(layers: int, start: int = start, size: int = size) -> None:
            if summarise:
                retrieval.summarise_layer(layers - 1, full.stream.layer_keys(layers - 1), start + size)
            if on_progress is not None:
                on_progress(start + size * layers // num_layers, total)

        began = clock.mark() if on_chunk is not None else None
        logits = model.prefill_layerwise(tokens[start : start + size], start, full, chunk, on_layer)
        if on_chunk is not None:
            seconds, chunks = clock.seconds(began, clock.mark()), -(-size // chunk)
            for _ in range(chunks):
                on_chunk(seconds / chunks)
    return logits
