"""Retrieval cache of the TriForce middle tier (Sun et al., 2024, arXiv 2404.11912).

It reads the full cache of the same model. Positions before ``selected_until`` (a multiple of chunk_size) are
represented by ``budget / chunk_size`` chunks per KV head: chunk 0, which holds the attention sinks, and the
chunks whose mean key scores best against the current query. Positions from ``selected_until`` on are kept
whole in a recent region after the selected chunks, at slot ``budget + position - selected_until``.

Chunks are scored by their mean key (``score="mean"``, TriForce's) or by Quest's bound from their minimum and
maximum keys (``score="bound"``, kernels/retrieval.py). A chunk's summary is computed once, when the chunk is
complete. ``select_chunks`` re-selects with the query
the full model computed at the last cached position (the last full verification pass, no extra forward);
``sync_recent`` copies the full model's keys/values of newly verified tokens over the middle tier's own.

A sliding-window layer (``windows``) never selects a chunk that lies wholly before the window of the position
selection serves (the full cache's length), chunk 0's sinks included: the target could never read it there. Where
the window holds fewer complete chunks than the budget, the layer's first slots hold unselectable chunks, and its
view starts after them (``first_slots``).

A full cache that keeps only the window (FullCache.window: every layer windowed alike) holds whole chunks from
``first_chunk`` on: the summaries of the chunks before it are dropped, chosen chunks are read at their slots there,
and the chunks filling the budget before the window, which no layer reads, may be any chunk held.

The full cache's storage may live elsewhere (in host memory, offload/kv.py): selection then gathers the chosen
chunks there and copies only them to this cache's device. Selection serves every layer at once: one scoring op on
the device, and where the storage is elsewhere one read of the chosen ids, one gather of every layer's chunks into
a staging buffer beside the storage (FullCache.host_buffer: pinned where the storage is, allocated once) and one
upload of it through the full cache (FullCache.upload: offloaded, asynchronous on the copy stream, one contiguous
copy per layer and KV head, as the stream copies every range); ``sync_recent`` copies its positions through the full
cache (FullCache.copy_positions: offloaded, from the device where they were not written back yet). The summaries
are computed on this cache's device: those of a prompt prefilled layer by layer as each layer's keys pass through
the device (``summarise_layer``), so the first selection averages no keys; those of later chunks from their keys
uploaded one layer at a time.
"""

import torch
import torch.nn.functional as F
from triforce_cli.cache.base import CacheCapacityError, SlotCache
from triforce_cli.cache.full import FullCache
from triforce_cli.kernels import (
    CHUNK_SCORES,
    SUMMARIES,
    chunk_summaries,
    gather_chunks,
    score_workspace,
    summary_scores,
    top_chunks,
)
from triforce_cli.kernels.memory import huge_page_zeros


class RetrievalCache(SlotCache):
    def __init__(
        self,
        full: FullCache,
        budget: int,
        chunk_size: int,
        recent_capacity: int,
        device: torch.device | str | None = None,
        score: str = "mean",
        windows: tuple[int | None, ...] = (),
    ):
        """device: where this cache lives and the model computes; None: where the full cache's storage is.
        score: how chunks are scored, one of kernels.CHUNK_SCORES.
        windows: the model's sliding window per layer (ModelConfig.sliding_windows), () where none has one."""
        if budget % chunk_size:
            raise ValueError(f"budget {budget} is not a multiple of chunk size {chunk_size}")
        if score not in CHUNK_SCORES:
            raise ValueError(f"unknown chunk score '{score}' (choose from {', '.join(CHUNK_SCORES)})")
        self.full = full
        self.score = score
        self.budget = budget
        self.chunk_size = chunk_size
        self.recent_capacity = recent_capacity
        num_layers, num_kv_heads, capacity, head_dim = full.keys.shape
        device = full.keys.device if device is None else device
        shape = (num_layers, num_kv_heads, budget + recent_capacity, head_dim)
        self.keys = huge_page_zeros(shape, full.keys.dtype, device)
        self.values = huge_page_zeros(shape, full.keys.dtype, device)
        # one (mean) or two (min and max) keys per chunk, in the cache dtype: 1/(2 chunk_size) of the full cache's
        # bytes each, scored in float32
        self.chunk_keys = torch.zeros(
            (SUMMARIES[score], num_layers, num_kv_heads, capacity // chunk_size, head_dim),
            dtype=full.keys.dtype,
            device=device,
        )
        # float32 copies of keys averaged into them and of them scored (kernels.score_workspace)
        self.score_workspace = score_workspace(self.chunk_keys.shape, device)
        self.num_mean_keys = 0  # chunks summarised: [first_chunk, num_mean_keys) at chunk_keys' [0, num - first)
        self.first_chunk = 0  # the first chunk summarised (the full cache dropped those before: FullCache.window)
        self.chunk_ids: torch.Tensor | None = None  # (layers, Hkv, budget/chunk) after the first selection
        # the chosen chunks' keys and values of every layer, gathered where the storage is when that is elsewhere
        self.staging: torch.Tensor | None = None  # (2, layers, Hkv, budget, D)
        if full.stream is not None or full.keys.device != self.keys.device:
            self.staging = full.host_buffer((2, num_layers, num_kv_heads, budget, head_dim))
        # a windowed layer's view starts past the chunks selected only to fill the budget
        self._hold_first_slots(windows)
        self.selected_until = 0
        self.synced_until = 0
        self.length = 0
        self._write = slice(0, 0)

    def first_selectable(self, length: int) -> list[int]:
        """Per layer, the first chunk that may be selected for a query at position ``length``: the chunk holding
        the first position of its sliding window, 0 for a layer without one."""
        windows = self.windows or (None,) * len(self.first_slots)
        return [0 if window is None else max(0, length - window + 1) // self.chunk_size for window in windows]

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)
        self.synced_until = min(self.synced_until, length)

    def reset(self, keep: int = 0) -> None:
        """Forget every position; keep: the first positions of the full cache that hold what they held (a prompt
        prefix reused), whose complete chunks' summaries are kept rather than computed again."""
        self.length = self.selected_until = self.synced_until = 0
        self.num_mean_keys = min(self.num_mean_keys, keep // self.chunk_size)
        if self.num_mean_keys <= self.first_chunk:
            self.num_mean_keys = self.first_chunk = 0
        self.chunk_ids = None

    @property
    def mean_keys(self) -> torch.Tensor:
        """(layers, Hkv, chunks, D): the mean key of each chunk (score "mean"), the minimum key (score "bound")."""
        return self.chunk_keys[0]

    @property
    def recent_tokens(self) -> int:
        return self.length - self.selected_until

    def _update_mean_keys(self, complete_chunks: int) -> None:
        """Summarise the complete chunks not summarised yet, up to complete_chunks; first drop the summaries of
        the chunks the full cache no longer holds whole (FullCache.window), which no layer may select."""
        first_held = -(-self.full.offset // self.chunk_size)
        if first_held > self.first_chunk:
            shift, still = first_held - self.first_chunk, max(0, self.num_mean_keys - first_held)
            if still:
                self.chunk_keys[:, :, :, :still] = self.chunk_keys[:, :, :, shift : shift + still].clone()
            self.first_chunk = first_held
            self.num_mean_keys = max(self.num_mean_keys, first_held)
        if complete_chunks <= self.num_mean_keys:
            return
        first, stop = self.num_mean_keys * self.chunk_size, complete_chunks * self.chunk_size
        held = slice(first - self.full.offset, stop - self.full.offset)
        self.full.settle()
        uploaded = None  # one layer's keys on this cache's device, where the storage is elsewhere
        if self.staging is not None:
            _, num_kv_heads, _, head_dim = self.keys.shape
            uploaded = self.keys.new_empty((num_kv_heads, stop - first, head_dim))
        for layer in range(self.keys.shape[0]):
            keys = self.full.keys[layer, :, held]
            if uploaded is not None:
                self.full.upload(uploaded, keys)
                keys = uploaded
            self._summarise(layer, keys, self.num_mean_keys, complete_chunks)
        self.num_mean_keys = complete_chunks

    def _summarise(self, layer: int, keys: torch.Tensor, first: int, stop: int) -> None:
        """Summarise layer's chunks [first, stop) from keys (Hkv, (stop - first) * chunk_size, D) on this cache's
        device."""
        summaries = chunk_summaries(keys, self.chunk_size, self.score, self.score_workspace)
        for summary_keys, summary in zip(self.chunk_keys, summaries, strict=True):
            summary_keys[layer, :, first - self.first_chunk : stop - self.first_chunk] = summary

    def summarise_layer(self, layer: int, keys: torch.Tensor, length: int) -> None:
        """Summarise layer's complete chunks before length not summarised yet from keys (Hkv, >= length, D), the
        layer's keys on this cache's device with positions [0, length) at their slots, as a layer-wise prefill of
        the full cache leaves them (offload.prefill_layerwise); after the last layer, count them summarised.

        A ValueError where the full cache dropped its first positions (FullCache.window): no offloaded cache does.
        """
        if self.full.offset:
            raise ValueError("a full cache keeping only its window is summarised when chunks are selected")
        first, stop = self.num_mean_keys, length // self.chunk_size
        if stop > first:
            self._summarise(layer, keys[:, first * self.chunk_size : stop * self.chunk_size], first, stop)
        if layer == self.keys.shape[0] - 1:
            self.num_mean_keys = max(first, stop)

    def select_chunks(self) -> None:
        """Choose the best chunks for the query at the full cache's last position and rebuild the view.

        Every layer at once (module docstring): the scores of all layers in one op (kernels.summary_scores), then
        the chosen chunks gathered straight into this cache where the storage is on its device, else on the
        storage into the staging buffer and uploaded from there.
        """
        length = self.full.length
        complete_chunks = length // self.chunk_size
        keep = self.budget // self.chunk_size
        if complete_chunks < keep:
            raise ValueError(f"budget {self.budget} exceeds the {length} cached tokens")
        self._update_mean_keys(complete_chunks)
        queries = self.full.queries_at(length - 1).to(self.chunk_keys.device)  # (layers, Hq, D)
        summaries = self.chunk_keys[:, :, :, : max(0, complete_chunks - self.first_chunk)]
        scores = summary_scores(queries, summaries, self.score, self.score_workspace)  # (layers, Hkv, chunks held)
        if self.first_chunk:  # (layers, Hkv, C): the chunks the full cache dropped, before the window, never chosen
            scores = F.pad(scores, (self.first_chunk, 0), value=float("-inf"))
        first_selectable = [max(first, self.first_chunk) for first in self.first_selectable(length)]
        selectable = None
        if self.windows or self.first_chunk:
            selectable = torch.tensor(first_selectable, device=scores.device)
        self.chunk_ids = top_chunks(scores, keep, selectable)  # (layers, Hkv, keep)
        if selectable is not None:
            filling = [max(0, keep - max(0, complete_chunks - first)) for first in first_selectable]
            self._start_views_at([chunks * self.chunk_size for chunks in filling])
        selected = slice(0, self.budget)
        # the full cache's slots from chunk first_chunk on, and the chunks there; those filling the budget before a
        # window (never read) may lie before it: any chunk held serves
        held = slice(self.first_chunk * self.chunk_size - self.full.offset, None)
        pairs = ((self.keys, self.full.keys[:, :, held]), (self.values, self.full.values[:, :, held]))
        chunk_ids = (self.chunk_ids - self.first_chunk).clamp_(min=0) if self.first_chunk else self.chunk_ids
        if self.staging is None:
            for buffer, source in pairs:
                gather_chunks(source, chunk_ids, self.chunk_size, out=buffer[:, :, selected])
        else:
            self.full.settle()  # the storage holds every write, and the staging buffer's last upload is done
            at_storage = chunk_ids.to(self.full.keys.device)  # the one read of the device
            for (buffer, source), staged in zip(pairs, self.staging, strict=True):
                gather_chunks(source, at_storage, self.chunk_size, out=staged)
                self.full.upload(buffer[:, :, selected], staged)
        self.selected_until = complete_chunks * self.chunk_size
        self.synced_until = self.selected_until
        self.sync_recent()

    def sync_recent(self) -> None:
        """Copy the full cache's positions [synced_until, full.length) into the recent region
        (FullCache.copy_positions: offloaded, from the device where it holds them alone, else uploaded from the
        storage, queued after the copies that write them there).

        Where the full cache, keeping only its window, dropped some of them (the middle tier skipped for some
        rounds), choose the chunks again instead (select_chunks), which copies only the positions from its chunks'
        end on: held wherever the full cache's first position is a multiple of the chunk size.
        """
        start, stop = self.synced_until, self.full.length
        if start < self.full.offset <= stop // self.chunk_size * self.chunk_size:
            self.select_chunks()
            return
        if stop - self.selected_until > self.recent_capacity:
            raise CacheCapacityError("recent region of the retrieval cache is full; select chunks again first")
        if stop > start:
            slots = slice(self.budget + start - self.selected_until, self.budget + stop - self.selected_until)
            held = slice(start - self.full.offset, stop - self.full.offset)
            if held.start < 0:
                raise ValueError(f"the full cache no longer holds position {start}; select chunks again first")
            self.full.copy_positions(self.keys[:, :, slots], self.values[:, :, slots], slice(start, stop))
        self.synced_until = stop
        self.length = stop

    def prepare(self, start: int, num_tokens: int, padding: int | None = None) -> None:
        self._check_start(start)
        if start < self.selected_until:
            raise ValueError(f"position {start} lies in the selected chunks and cannot be rewritten")
        first = self.budget + start - self.selected_until
        if first + num_tokens + (padding or 0) > self.budget + self.recent_capacity:
            raise CacheCapacityError("recent region of the retrieval cache is full; select chunks again first")
        self._write = self._begin_write(first, num_tokens, padding)
        self.length = start + num_tokens
