"""cache_attention (csrc/cache_attention.cpp): float32 queries against a float16 KV cache view on the CPU.

Each body the CPU can run must give the float64 attention on the float16 values to float32 rounding, for any shape,
strides, origin and window; and a query row's output must be the same bits however it is computed: inside a batch of
T rows or alone on the view cut at its position (a prompt prefilled in chunks and token by token), with 1 thread or
2.
"""

import random

import pytest
import torch
from triforce_cli.kernels.attention import POSITION_SEGMENT, SLOT_SEGMENT, cache_attention

from triforce_cli.runtime.native import kernel_error

KERNEL_ERROR = kernel_error()

pytestmark = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"no CPU kernels here: {KERNEL_ERROR}")

# float32 rounding of the scores, exponentials and sums over a few thousand keys, against float64
TOLERANCE = {"rtol": 1e-5, "atol": 2e-5}


def reference(q, k, v, scale, window=None):
    """float64 attention on the float16 values: query t, at view index L - T + t, reads keys j <= L - T + t (and
    j > L - T + t - window with a window) of KV head h // G."""
    group = q.shape[0] // k.shape[0]
    keys = k.double().repeat_interleave(group, 0)  # (Hq, L, D)
    values = v.double().repeat_interleave(group, 0)
    num_queries, num_keys = q.shape[1], k.shape[1]
    position = torch.arange(num_keys - num_queries, num_keys)[:, None]
    key = torch.arange(num_keys)[None, :]
    visible = key <= position
    if window is not None:
        visible &= key > position - window
    scores = (q.double() @ keys.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return scores.softmax(-1) @ values


def cache_views(kv_heads, length, dim, seed=0):
    """Keys and values (Hkv, L, D) float16 as views of a longer buffer whose rows are wider than D and whose heads
    hold more positions, as a cache's layer is."""
    g = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(kv_heads, length + 29, dim + 16, generator=g).half() for _ in range(2)]
    return [buffer[:, 3 : 3 + length, :dim] for buffer in buffers]


@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 48), (2, 1, 20)])
@pytest.mark.parametrize(
    ("queries", "length", "origin", "window"),
    [
        (1, 1, 0, None),
        (1, 300, 0, None),
        (5, 300, 17, None),
        (70, 700, 100, None),
        (7, 2600, 2040, 300),
        (1, 4200, 0, None),
        (30, 200, 5, 16),
    ],
)
def test_matches_the_float64_attention_on_the_float16_values(
    body, q_heads, kv_heads, dim, queries, length, origin, window
):
    """Head dims the vector bodies compile for (64, 128), others they take (32, 48) and one only the plain body does
    (20); blocks and segments cut across by the view's start (origin), windows, grouped heads and strided views."""
    g = torch.Generator().manual_seed(length + queries)
    q = torch.randn(q_heads, queries, dim, generator=g)
    k, v = cache_views(kv_heads, length, dim, seed=length)
    scale = dim**-0.5 * 2  # peaked scores
    out = cache_attention(q, k, v, scale, origin, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, k, v, scale, window), **TOLERANCE)


CASES = [  # (origin, window, context): the first new query's view index is `context`
    (0, None, 40),
    (1990, None, 120),  # the view's start and the new rows on either side of a segment's boundary
    (37, 200, 330),  # a window that cuts every query's keys
    (POSITION_SEGMENT - 50, 100, 20),  # a window reaching across a segment's boundary (of either size)
]


@pytest.mark.parametrize("segment", [POSITION_SEGMENT, SLOT_SEGMENT])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("origin", "window", "context"), CASES)
def test_a_row_gives_the_same_bits_in_any_batch(body, origin, window, context, threads, segment):
    """T rows (1 to 300) in one call, in chunks at random split points, and each alone on the view cut at its
    position: every row the same bits, whether its keys were read directly (up to 9 rows with AVX-512: a decode or
    short verification step) or packed once for many rows, with the full cache's segments and the small caches'."""
    rng = random.Random(origin + context + threads)
    queries = rng.randint(1, 300) if body != "scalar" else rng.randint(1, 60)
    q_heads, kv_heads, dim = rng.choice([(9, 3, 64), (8, 2, 128), (6, 2, 48)])  # 48: a vector body's any-D path
    g = torch.Generator().manual_seed(context)
    q = torch.randn(q_heads, queries, dim, generator=g)
    k, v = cache_views(kv_heads, context + queries, dim, seed=context)
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = cache_attention(q, k, v, scale, origin, window, segment)  # (Hq, T, D)
        splits = sorted(rng.sample(range(1, queries), min(queries - 1, 4))) if queries > 1 else []
        chunked = []
        for start, stop in zip([0, *splits], [*splits, queries]):
            seen = context + stop  # the view up to the chunk's last query's own key
            chunked.append(cache_attention(q[:, start:stop], k[:, :seen], v[:, :seen], scale, origin, window, segment))
        assert torch.equal(torch.cat(chunked, dim=1), whole)
        rows = range(queries) if body != "scalar" else rng.sample(range(queries), min(queries, 8))
        for t in rows:
            seen = context + t + 1
            alone = cache_attention(q[:, t : t + 1], k[:, :seen], v[:, :seen], scale, origin, window, segment)
            assert torch.equal(alone[:, 0], whole[:, t]), f"row {t} of {queries}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 2, 64), (3, 3, 32)])
def test_a_verification_row_gives_its_decode_and_prefill_bits(body, q_heads, kv_heads, dim, threads):
    """Verification batches of 1 to 16 queries (G to 16 G rows of a KV head): the few rows of a decode step's grouped
    heads read their keys directly, more rows pack them once; each row of every batch is the bits of the same row
    alone (a decode step) and inside a batch of 40 queries (a prefill chunk), with keys across several blocks and a
    segment's boundary."""
    g = torch.Generator().manual_seed(dim + q_heads)
    context, chunk = 2100, 40
    q = torch.randn(q_heads, chunk, dim, generator=g)
    k, v = cache_views(kv_heads, context + chunk, dim, seed=dim)
    scale = dim**-0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefill = cache_attention(q, k, v, scale, 30)
        for queries in (*range(1, 9), 16):
            start = chunk - queries - 3  # the batch ends 3 queries before the chunk's end: its view is cut there
            seen = context + start + queries
            batch = cache_attention(q[:, start : start + queries], k[:, :seen], v[:, :seen], scale, 30)
            assert torch.equal(batch, prefill[:, start : start + queries]), f"{queries} queries"
            for t in range(queries):
                own = seen - queries + t + 1  # the view up to query t's own key
                alone = cache_attention(q[:, start + t : start + t + 1], k[:, :own], v[:, :own], scale, 30)
                assert torch.equal(alone[:, 0], batch[:, t]), f"query {t} of {queries}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("length", "segment"), [(9000, POSITION_SEGMENT), (9000, SLOT_SEGMENT), (1040, SLOT_SEGMENT)])
def test_two_threads_give_one_threads_bits(body, length, segment):
    """A 1-row decode splits its keys into segments over the threads, each taking a run of about equal keys (1,040:
    the retrieval tier's view, 512 + 512 + 16 keys a head); the merge order is fixed."""
    q = torch.randn(8, 3, 128, generator=torch.Generator().manual_seed(1))
    k, v = cache_views(2, length, 128, seed=1)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(cache_attention(q, k, v, 0.1, 123, None, segment))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_rejects_what_it_cannot_read():
    q = torch.randn(4, 2, 64)
    k, v = cache_views(2, 10, 64)
    with pytest.raises(RuntimeError, match="float16"):
        cache_attention(q, k.float(), v, 1.0)
    with pytest.raises(RuntimeError, match="at least T"):
        cache_attention(torch.randn(4, 11, 64), k, v, 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        cache_attention(q[:3], k, v, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        cache_attention(q, k.transpose(1, 2)[:, :, :10], v, 1.0)
    with pytest.raises(RuntimeError, match="origin"):
        cache_attention(q, k, v, 1.0, -1)
    with pytest.raises(RuntimeError, match="segment: a positive multiple of 64"):
        cache_attention(q, k, v, 1.0, 0, None, 100)
