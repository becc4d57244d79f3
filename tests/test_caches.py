"""Full, StreamingLLM and retrieval caches, driven directly through the per-layer protocol.

Keys written for position p in layer l, KV head h carry the value ``code(l, h, p)`` in every dimension, so a
view can be decoded back into the positions it holds.
"""

import pytest
import torch
from triforce_cli.cache import CacheCapacityError, FullCache, RetrievalCache, StreamingCache, kv_dtype

LAYERS, Q_HEADS, KV_HEADS, DIM = 2, 4, 2, 4


def code(layer: int, head: int, position: int) -> float:
    return layer * 10000 + head * 1000 + position


def kv_for(layer: int, start: int, num: int, salt: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + num, dtype=torch.float32)
    heads = torch.arange(KV_HEADS, dtype=torch.float32)[:, None]
    k = (layer * 10000 + heads * 1000 + positions[None, :] + salt)[:, :, None].expand(-1, -1, DIM).contiguous()
    return k, -k


def write(cache, start: int, num: int, salt: float = 0.0, q: torch.Tensor | None = None):
    """One forward's worth of cache traffic; returns the per-layer (keys, values) views."""
    cache.prepare(start, num)
    views = []
    for layer in range(LAYERS):
        k, v = kv_for(layer, start, num, salt)
        query = q[layer] if q is not None else torch.zeros(Q_HEADS, num, DIM)
        views.append(cache.update(layer, query, k, v))
    return views


def positions_of(keys: torch.Tensor, layer: int = 0, head: int = 0) -> list[float]:
    """Decode a (.., L, D) key view of one layer/head back into positions."""
    return (keys[:, 0] - code(layer, head, 0)).tolist()


def full_cache(capacity: int = 64) -> FullCache:
    return FullCache(LAYERS, KV_HEADS, DIM, capacity, torch.float32)


# --- full cache ------------------------------------------------------------------------------------------------


def test_full_cache_write_view_and_rollback():
    cache = full_cache(16)
    views = write(cache, 0, 5)
    assert cache.length == 5
    for layer, (keys, values) in enumerate(views):
        assert keys.shape == (KV_HEADS, 5, DIM)
        assert positions_of(keys[1], layer, 1) == [0, 1, 2, 3, 4]
        assert torch.equal(values, -keys)
    keys, _ = write(cache, 5, 2)[0]
    assert positions_of(keys[0]) == list(range(7))
    cache.rollback(6)
    assert cache.length == 6
    cache.rollback(9)  # rolling "forward" never adds positions
    assert cache.length == 6
    keys, _ = write(cache, 6, 1, salt=0.5)[1]
    assert positions_of(keys[0], 1) == [0, 1, 2, 3, 4, 5, 6.5]
    # overwrite inside the cache after a rollback
    cache.rollback(3)
    keys, _ = write(cache, 3, 2, salt=0.25)[0]
    assert positions_of(keys[0]) == [0, 1, 2, 3.25, 4.25]
    cache.reset()
    assert cache.length == 0


def test_kv_dtype_is_float16_for_a_float32_model_on_the_cpu_and_the_models_own_elsewhere():
    assert kv_dtype("cpu", torch.float32) == kv_dtype(torch.device("meta"), torch.float32) == torch.float16
    for dtype in (torch.bfloat16, torch.float16):  # a CPU in bfloat16 stands in for a GPU
        assert kv_dtype("cpu", dtype) == dtype
    for dtype in (torch.float32, torch.bfloat16):
        assert kv_dtype(torch.device("cuda", 0), dtype) == dtype


@pytest.mark.parametrize("kind", ["full", "streaming", "retrieval"])
def test_a_float16_cache_holds_each_write_rounded_once_and_views_it_so(kind):
    """Float32 keys and values written to a float16 cache are held, and viewed by attention, as their float16
    rounding; the full cache's views start at its first held position (origin), the others' at 0."""
    full = FullCache(LAYERS, KV_HEADS, DIM, 64, torch.float16)
    if kind == "streaming":
        cache = StreamingCache(LAYERS, KV_HEADS, DIM, 2, 8, 8, torch.float16)
    elif kind == "retrieval":
        torch.manual_seed(0)
        full.prepare(0, 16)
        for layer in range(LAYERS):
            full.update(
                layer, torch.randn(Q_HEADS, 16, DIM), torch.randn(KV_HEADS, 16, DIM), torch.randn(KV_HEADS, 16, DIM)
            )
        cache = RetrievalCache(full, 8, 4, 16)
        cache.select_chunks()
        assert cache.keys.dtype == cache.chunk_keys.dtype == torch.float16
    else:
        cache = full
    start = cache.length
    k, v = torch.randn(KV_HEADS, 3, DIM) * 3, torch.randn(KV_HEADS, 3, DIM) * 3
    cache.prepare(start, 3)
    keys, values = cache.update(0, torch.zeros(Q_HEADS, 3, DIM), k, v)
    assert keys.dtype == values.dtype == torch.float16
    assert torch.equal(keys[:, -3:], k.half()) and torch.equal(values[:, -3:], v.half())
    assert not torch.equal(keys[:, -3:].float(), k)  # rounded
    assert cache.origin == 0


def test_the_full_caches_origin_is_its_first_held_position():
    cache = FullCache(LAYERS, KV_HEADS, DIM, 12, torch.float16, window=4, align=4)
    write(cache, 0, 8)
    assert cache.origin == cache.offset == 0
    keys, _ = write(cache, 8, 8)[0]
    assert cache.origin == cache.offset == 4
    assert positions_of(keys[0].float()) == list(range(4, 16))  # the view's first key is at position origin


def test_full_cache_capacity_and_gaps():
    cache = full_cache(8)
    write(cache, 0, 6)
    with pytest.raises(CacheCapacityError):
        cache.prepare(6, 3)
    with pytest.raises(ValueError):
        cache.prepare(7, 1)  # position 6 was never written
    write(cache, 6, 2)  # exactly full is fine
    assert cache.length == 8


def test_full_cache_query_at():
    cache = full_cache(16)
    write(cache, 0, 4)
    q = [
        torch.arange(Q_HEADS * 3 * DIM, dtype=torch.float32).reshape(Q_HEADS, 3, DIM) + 100 * layer
        for layer in range(2)
    ]
    write(cache, 4, 3, q=q)
    torch.testing.assert_close(cache.query_at(1, 5), q[1][:, 1])
    torch.testing.assert_close(cache.query_at(0, 6), q[0][:, 2])
    with pytest.raises(ValueError):
        cache.query_at(0, 3)  # not part of the last forward
    with pytest.raises(ValueError):
        cache.query_at(0, 7)
    with pytest.raises(ValueError):
        full_cache().query_at(0, 0)  # no forward yet


# --- StreamingLLM cache ----------------------------------------------------------------------------------------


def streaming(sinks: int = 2, window: int = 4, max_step: int = 3) -> StreamingCache:
    return StreamingCache(LAYERS, KV_HEADS, DIM, sinks, window, max_step, torch.float32)


def check_streaming_view(cache: StreamingCache, views, start: int, num: int):
    """The view of every layer/head holds exactly cached_positions(), in slot order, new tokens last."""
    held = cache.cached_positions()
    assert held[-num:] == list(range(start, start + num))
    for layer, (keys, values) in enumerate(views):
        for head in range(KV_HEADS):
            assert positions_of(keys[head], layer, head) == held
        assert torch.equal(values, -keys)


def test_streaming_keeps_sinks_and_window_across_evictions():
    sinks, window, max_step = 2, 4, 3
    cache = streaming(sinks, window, max_step)
    length = 0
    evictions = 0
    for step in [3, 1, 2, 3, 1, 1, 3, 2, 1, 3, 3, 1, 2]:
        before = cache.window_start
        views = write(cache, length, step)
        check_streaming_view(cache, views, length, step)
        held = cache.cached_positions()
        assert held[:sinks] == list(range(sinks))
        assert len(held) <= cache.capacity
        # the most recent `window` positions before the write are always still there
        assert set(range(max(sinks, length - window), length)) <= set(held)
        if cache.window_start != before:
            evictions += 1
            # an eviction keeps exactly the last `window` positions before the write
            assert held == [*range(sinks), *range(length - window, length + step)]
        length += step
    assert evictions >= 3
    assert cache.length == length


def test_streaming_prefill_chunk_larger_than_window():
    cache = streaming(sinks=2, window=4, max_step=8)
    views = write(cache, 0, 8)
    check_streaming_view(cache, views, 0, 8)
    views = write(cache, 8, 8)
    check_streaming_view(cache, views, 8, 8)
    assert cache.cached_positions() == [0, 1, 4, 5, 6, 7, *range(8, 16)]


def test_streaming_window_started_after_the_sinks_holds_them_and_the_positions_from_there():
    cache = streaming(sinks=2, window=4, max_step=8)
    write(cache, 0, 2)
    cache.start_window_at(20)
    views = write(cache, 20, 3)
    check_streaming_view(cache, views, 20, 3)
    assert cache.cached_positions() == [0, 1, 20, 21, 22]
    views = write(cache, 23, 5)
    assert cache.cached_positions() == [0, 1, *range(20, 28)]
    check_streaming_view(cache, views, 23, 5)
    views = write(cache, 28, 6)  # evicts all but the window's last 4 positions before the write
    assert cache.cached_positions() == [0, 1, *range(24, 34)]
    check_streaming_view(cache, views, 28, 6)


def test_streaming_window_starts_only_after_exactly_the_sinks():
    cache = streaming(sinks=2, window=4, max_step=8)
    write(cache, 0, 3)  # a window position held already
    with pytest.raises(ValueError, match="cannot start the window at 20 with 3 positions held"):
        cache.start_window_at(20)


def test_streaming_rollback_within_a_step():
    cache = streaming(sinks=2, window=4, max_step=3)
    for start in range(0, 12, 3):
        write(cache, start, 3)
    # a speculative step of 3 tokens, two of them rejected
    write(cache, 12, 3)
    cache.rollback(13)
    assert cache.length == 13
    views = write(cache, 13, 2, salt=0.5)
    held = cache.cached_positions()
    assert held[-3:] == [12, 13, 14]
    keys = views[0][0][0]
    assert positions_of(keys)[-3:] == [12, 13.5, 14.5]


def test_streaming_rollback_past_eviction_restarts_the_window():
    """Evicted positions cannot come back: a rollback into them keeps the sinks and restarts the window there."""
    cache = streaming(sinks=2, window=4, max_step=3)
    for start in range(0, 15, 3):
        write(cache, start, 3)
    assert cache.window_start > cache.sink_tokens
    evicted = cache.window_start - 1
    cache.rollback(evicted)
    assert cache.cached_positions() == [0, 1]
    assert cache.window_start == evicted
    views = write(cache, evicted, 3)
    assert cache.cached_positions() == [0, 1, evicted, evicted + 1, evicted + 2]
    check_streaming_view(cache, views, evicted, 3)


def test_streaming_write_into_evicted_positions_is_an_error():
    cache = streaming(sinks=2, window=4, max_step=3)
    for start in range(0, 15, 3):
        write(cache, start, 3)
    with pytest.raises(ValueError, match="evicted"):
        cache.prepare(cache.window_start - 1, 1)


def test_streaming_step_limit():
    cache = streaming(max_step=3)
    with pytest.raises(CacheCapacityError):
        cache.prepare(0, 4)


def test_streaming_rollback_into_sinks_after_eviction():
    cache = streaming(sinks=2, window=4, max_step=3)
    for start in range(0, 15, 3):
        write(cache, start, 3)
    cache.rollback(1)
    for start, num in [(1, 3), (4, 3), (7, 3)]:
        views = write(cache, start, num)
        check_streaming_view(cache, views, start, num)


def test_streaming_fill_from_full_cache():
    full = full_cache(64)
    write(full, 0, 30)
    cache = streaming(sinks=3, window=8, max_step=4)
    cache.fill_from(full)
    held = cache.cached_positions()
    assert held == [0, 1, 2, *range(22, 30)]
    assert cache.length == 30
    for layer in range(LAYERS):
        for slot, position in enumerate(held):
            assert cache.slot(position) == slot
            torch.testing.assert_close(cache.keys[layer, :, slot], full.keys[layer, :, position])
            torch.testing.assert_close(cache.values[layer, :, slot], full.values[layer, :, position])
    # decoding continues from there
    views = write(cache, 30, 2)
    check_streaming_view(cache, views, 30, 2)


def test_streaming_fill_from_short_full_cache():
    full = full_cache(16)
    write(full, 0, 5)
    cache = streaming(sinks=3, window=8, max_step=4)
    cache.fill_from(full)
    assert cache.cached_positions() == [0, 1, 2, 3, 4]
    views = write(cache, 5, 1)
    check_streaming_view(cache, views, 5, 1)


# --- retrieval cache -------------------------------------------------------------------------------------------


def crafted_full(chunk: int, num_chunks: int, chunk_keys: dict[int, torch.Tensor], query: torch.Tensor) -> FullCache:
    """Full cache whose chunk c has every key equal to chunk_keys[c] (others zero), in every layer.

    ``query`` (Hq, D) is the query of the last position.
    """
    length = chunk * num_chunks
    full = full_cache(length + 32)
    full.prepare(0, length)
    for layer in range(LAYERS):
        k = torch.zeros(KV_HEADS, length, DIM)
        for c, key in chunk_keys.items():
            k[:, c * chunk : (c + 1) * chunk] = key  # key (Hkv, D) or (D,)
        q = torch.zeros(Q_HEADS, length, DIM)
        q[:, -1] = query
        full.update(layer, q, k, torch.randn(KV_HEADS, length, DIM))
    return full


def test_retrieval_select_prefers_aligned_chunk_and_keeps_chunk_zero():
    chunk, num_chunks = 4, 6
    e = torch.eye(DIM)
    query = e[2].expand(Q_HEADS, DIM)
    # chunk 0 points away from the query; chunk 4 is aligned with it; chunk 2 a little
    full = crafted_full(chunk, num_chunks, {0: -e[2], 2: 0.1 * e[2], 4: e[2], 5: e[1]}, query)
    retrieval = RetrievalCache(full, budget=2 * chunk, chunk_size=chunk, recent_capacity=8)
    retrieval.select_chunks()
    assert retrieval.chunk_ids.shape == (LAYERS, KV_HEADS, 2)
    assert retrieval.chunk_ids.tolist() == [[[0, 4]] * KV_HEADS] * LAYERS
    retrieval3 = RetrievalCache(full, budget=3 * chunk, chunk_size=chunk, recent_capacity=8)
    retrieval3.select_chunks()
    assert retrieval3.chunk_ids.tolist() == [[[0, 2, 4]] * KV_HEADS] * LAYERS
    assert retrieval3.selected_until == 24 and retrieval3.length == 24
    # the selected region holds exactly the chosen chunks' keys and values
    for layer in range(LAYERS):
        for h in range(KV_HEADS):
            tokens = [*range(4), *range(8, 12), *range(16, 20)]
            torch.testing.assert_close(retrieval3.keys[layer, h, :12], full.keys[layer, h, tokens])
            torch.testing.assert_close(retrieval3.values[layer, h, :12], full.values[layer, h, tokens])


def test_retrieval_gqa_scores_sum_the_query_heads():
    """KV head 0 is read by query heads 0 and 1: neither alone prefers chunk 3, their sum does."""
    chunk, num_chunks = 2, 5
    e = torch.eye(DIM)
    keys = {1: e[0], 2: e[1], 3: e[2], 4: e[3]}
    query = torch.stack(
        [
            3 * e[0] + 1 * e[2],  # head 0: chunk 1 (3) > chunk 3 (1)
            -2 * e[0] + 2 * e[1] + 1.5 * e[2],  # head 1: chunk 2 (2) > chunk 3 (1.5)
            5 * e[3] - 1 * e[0],  # heads 2, 3 -> KV head 1: chunk 4 (5), then chunk 2 (0.5)
            0.5 * e[1],
        ]
    )
    full = crafted_full(chunk, num_chunks, keys, query)
    retrieval = RetrievalCache(full, budget=2 * chunk, chunk_size=chunk, recent_capacity=4)
    retrieval.select_chunks()
    assert retrieval.chunk_ids[0].tolist() == [[0, 3], [0, 4]]
    retrieval = RetrievalCache(full, budget=3 * chunk, chunk_size=chunk, recent_capacity=4)
    retrieval.select_chunks()
    assert retrieval.chunk_ids[1].tolist() == [[0, 2, 3], [0, 2, 4]]


def test_retrieval_budget_validation():
    full = full_cache(64)
    with pytest.raises(ValueError, match="multiple"):
        RetrievalCache(full, budget=10, chunk_size=4, recent_capacity=8)
    write(full, 0, 11)  # two whole chunks of 4
    retrieval = RetrievalCache(full, budget=12, chunk_size=4, recent_capacity=8)
    with pytest.raises(ValueError, match="exceeds"):
        retrieval.select_chunks()
    RetrievalCache(full, budget=8, chunk_size=4, recent_capacity=8).select_chunks()


def recent_positions(retrieval: RetrievalCache, layer: int = 0, head: int = 0) -> list[float]:
    stop = retrieval.budget + retrieval.length - retrieval.selected_until
    return positions_of(retrieval.keys[layer, head, retrieval.budget : stop], layer, head)


def test_retrieval_sync_recent_copies_full_kv():
    full = full_cache(64)
    write(full, 0, 14)
    retrieval = RetrievalCache(full, budget=8, chunk_size=4, recent_capacity=10)
    retrieval.select_chunks()
    assert retrieval.selected_until == 12
    assert retrieval.length == 14 and retrieval.recent_tokens == 2
    assert recent_positions(retrieval) == [12, 13]
    write(full, 14, 3)
    retrieval.sync_recent()
    assert retrieval.length == 17
    for layer in range(LAYERS):
        for head in range(KV_HEADS):
            assert recent_positions(retrieval, layer, head) == [12, 13, 14, 15, 16]
    torch.testing.assert_close(retrieval.values[:, :, 8:13], full.values[:, :, 12:17])


def test_retrieval_middle_tier_writes_rollback_and_resync():
    full = full_cache(64)
    write(full, 0, 12)
    retrieval = RetrievalCache(full, budget=8, chunk_size=4, recent_capacity=8)
    retrieval.select_chunks()
    # the middle tier drafts positions 12..14 with its own (salted) keys
    views = write(retrieval, 12, 3, salt=0.5)
    keys, _ = views[0]
    assert keys.shape == (KV_HEADS, 8 + 3, DIM)
    assert positions_of(keys[0])[-3:] == [12.5, 13.5, 14.5]
    torch.testing.assert_close(keys[:, :8], retrieval.keys[0, :, :8])  # the selected chunks come first
    # the full tier accepts one token: everything rolls back to 13, the full model's KV replaces the draft's
    retrieval.rollback(13)
    assert retrieval.length == 13
    write(full, 12, 2)  # verified positions 12, 13
    full.rollback(13)
    retrieval.sync_recent()
    assert retrieval.length == 13
    assert recent_positions(retrieval) == [12]
    views = write(retrieval, 13, 1, salt=0.25)
    assert positions_of(views[1][0][0], 1)[-2:] == [12, 13.25]
    with pytest.raises(ValueError, match="selected chunks"):
        retrieval.prepare(11, 1)


def test_retrieval_recent_region_capacity():
    full = full_cache(64)
    write(full, 0, 8)
    retrieval = RetrievalCache(full, budget=8, chunk_size=4, recent_capacity=4)
    retrieval.select_chunks()
    write(retrieval, 8, 4)  # fills the recent region exactly
    with pytest.raises(CacheCapacityError):
        retrieval.prepare(12, 1)
    retrieval.rollback(8)
    write(full, 8, 5)
    with pytest.raises(CacheCapacityError):
        retrieval.sync_recent()
    # a new selection moves the complete chunk 2 (positions 8..11) out of the recent region
    retrieval.select_chunks()
    assert retrieval.selected_until == 12
    assert recent_positions(retrieval) == [12]


def test_retrieval_mean_keys_are_incremental_and_reselection_sees_new_chunks():
    chunk = 4
    e = torch.eye(DIM)
    query = e[1].expand(Q_HEADS, DIM)
    full = crafted_full(chunk, 3, {1: e[0], 2: 0.5 * e[1]}, query)
    retrieval = RetrievalCache(full, budget=2 * chunk, chunk_size=chunk, recent_capacity=16)
    retrieval.select_chunks()
    assert retrieval.num_mean_keys == 3
    assert retrieval.chunk_ids[0, 0].tolist() == [0, 2]
    # four new tokens whose keys align better with the query complete chunk 3
    full.prepare(12, 4)
    for layer in range(LAYERS):
        q = torch.zeros(Q_HEADS, 4, DIM)
        q[:, -1] = query
        full.update(layer, q, (2 * e[1]).expand(KV_HEADS, 4, DIM), torch.zeros(KV_HEADS, 4, DIM))
    retrieval.sync_recent()
    retrieval.select_chunks()
    assert retrieval.num_mean_keys == 4
    torch.testing.assert_close(retrieval.mean_keys[0, :, 3], (2 * e[1]).expand(KV_HEADS, DIM))
    assert retrieval.chunk_ids[:, :, 1].unique().tolist() == [3]
    assert retrieval.selected_until == 16 and retrieval.length == 16


def test_retrieval_reset():
    full = full_cache(32)
    write(full, 0, 9)
    retrieval = RetrievalCache(full, budget=4, chunk_size=4, recent_capacity=8)
    retrieval.select_chunks()
    retrieval.reset()
    assert retrieval.length == 0 and retrieval.selected_until == 0 and retrieval.chunk_ids is None
    assert retrieval.num_mean_keys == 0
