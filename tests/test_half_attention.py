"""half_prefix_attention (csrc/half_attention.cpp): attention of a few queries against a plain float16 prefix and a
float32 tail.

Each body the CPU can run must give the float64 attention on the float16 values to float32 rounding, for any
shape and strides; and the same result bit for bit whatever the number of threads.
"""

import random

import pytest
import torch
from triforce_cli.kernels.attention import half_prefix_attention, half_prefix_available

from triforce_cli.runtime.native import kernel_error

KERNEL_ERROR = kernel_error()

pytestmark = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"no CPU kernels here: {KERNEL_ERROR}")

PREFIX_LENGTHS = (0, 1, 255, 256, 257, 1000, 4100)  # around the kernel's blocks of 512 keys and its steps of 16
TOLERANCE = {"rtol": 1e-5, "atol": 3e-6}  # float32 rounding of sums over thousands of keys


def reference(q, k_half, v_half, k_tail, v_tail, scale):
    """float64 attention over [prefix | tail], looped over query heads and queries: query t of head h reads KV head
    h // G, every prefix key and tail keys 0 .. Lt - T + t."""
    num_q_heads, num_queries, _ = q.shape
    keys = torch.cat((k_half.double(), k_tail.double()), dim=1)
    values = torch.cat((v_half.double(), v_tail.double()), dim=1)
    group = num_q_heads // keys.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        for t in range(num_queries):
            seen = k_half.shape[1] + k_tail.shape[1] - num_queries + t + 1
            weights = (keys[h // group, :seen] @ q[h, t].double() * scale).softmax(dim=0)
            out[h, t] = weights @ values[h // group, :seen]
    return out


def inputs(kv_heads, group, dim, queries, prefix, tail, seed=0):
    """q (Hq, T, D); the prefix's float16 keys and values as views [:, :P] of a longer buffer whose rows are wider
    than D; the tail's float32 ones as views [:, s : s + Lt] of a longer buffer."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(kv_heads * group, queries, dim, generator=g)
    halves = [torch.randn(kv_heads, prefix + 37, dim + 16, generator=g).half()[:, :prefix, :dim] for _ in range(2)]
    start = 5
    tails = [torch.randn(kv_heads, start + tail + 11, dim, generator=g)[:, start : start + tail] for _ in range(2)]
    return q, *halves, *tails


def random_shape(rng: random.Random) -> dict:
    queries = rng.randint(1, 9)
    return {
        "kv_heads": rng.randint(1, 4),
        "group": rng.randint(1, 4),
        "dim": rng.choice((64, 128)),
        "queries": queries,
        "tail": queries + rng.randint(0, 300),
    }


@pytest.mark.parametrize("prefix", PREFIX_LENGTHS)
@pytest.mark.parametrize("seed", range(3))
def test_matches_float64_on_the_float16_values(body, prefix, seed):
    shape = random_shape(random.Random(prefix * 10 + seed))
    q, k_half, v_half, k_tail, v_tail = inputs(**shape, prefix=prefix, seed=seed)
    assert k_half.stride(0) > prefix * shape["dim"] and k_tail.stride(0) > shape["tail"] * shape["dim"]
    scale = shape["dim"] ** -0.5
    out = half_prefix_attention(q, k_half, v_half, k_tail, v_tail, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k_half, v_half, k_tail, v_tail, scale), **TOLERANCE)


@pytest.mark.parametrize("dim", [8, 80])
def test_other_head_dims_run_the_plain_body(dim):
    q, k_half, v_half, k_tail, v_tail = inputs(2, 3, dim, 3, 600, 10)
    out = half_prefix_attention(q, k_half, v_half, k_tail, v_tail, 0.3)
    torch.testing.assert_close(out.double(), reference(q, k_half, v_half, k_tail, v_tail, 0.3), **TOLERANCE)


@pytest.mark.parametrize("queries, tail", [(1, 1), (4, 4), (5, 70), (9, 600)])
def test_a_query_never_reads_the_keys_after_its_own(body, queries, tail):
    """Tail keys and values a query may not see, replaced by huge ones, leave its output the same bit for bit; the
    keys it sees do change it."""
    q, k_half, v_half, k_tail, v_tail = inputs(2, 2, 64, queries, 300, tail, seed=queries)
    out = half_prefix_attention(q, k_half, v_half, k_tail, v_tail, 0.125)
    for t in range(queries):
        first_hidden = tail - queries + t + 1
        k_changed, v_changed = k_tail.clone(), v_tail.clone()
        k_changed[:, first_hidden:] = 1e4
        v_changed[:, first_hidden:] = 1e4
        changed = half_prefix_attention(q, k_half, v_half, k_changed, v_changed, 0.125)
        assert torch.equal(changed[:, : t + 1], out[:, : t + 1])
        if t + 1 < queries:
            assert not torch.allclose(changed[:, t + 1 :], out[:, t + 1 :])
        k_changed[:, first_hidden - 1] = 1e4  # query t's own key
        assert not torch.allclose(half_prefix_attention(q, k_half, v_half, k_changed, v_tail, 0.125)[:, t], out[:, t])


@pytest.mark.parametrize(
    "kv_heads, group, dim, queries, prefix",
    [(3, 3, 64, 1, 7000), (3, 3, 64, 4, 4100), (1, 4, 128, 2, 2000), (8, 4, 128, 8, 1500)],
)
def test_the_result_does_not_depend_on_the_number_of_threads(body, kv_heads, group, dim, queries, prefix):
    q, k_half, v_half, k_tail, v_tail = inputs(kv_heads, group, dim, queries, prefix, queries + 40)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(half_prefix_attention(q, k_half, v_half, k_tail, v_tail, 0.1))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_available_for_float32_on_the_cpu():
    assert half_prefix_available(torch.zeros(1, 1, 64))
    assert not half_prefix_available(torch.zeros(1, 1, 64, dtype=torch.float64))


def test_a_wrong_input_is_one_clear_error():
    q, k_half, v_half, k_tail, v_tail = inputs(2, 2, 64, 3, 10, 5)
    with pytest.raises(RuntimeError, match="k_half"):
        half_prefix_attention(q, k_half.float(), v_half, k_tail, v_tail, 1.0)
    with pytest.raises(RuntimeError, match="at least T"):
        half_prefix_attention(q, k_half, v_half, k_tail[:, :2], v_tail[:, :2], 1.0)
    with pytest.raises(RuntimeError, match="multiple"):
        half_prefix_attention(q[:3], k_half, v_half, k_tail, v_tail, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        half_prefix_attention(q, k_half.transpose(1, 2), v_half.transpose(1, 2), k_tail, v_tail, 1.0)
