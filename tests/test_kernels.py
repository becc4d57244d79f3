"""Attention and retrieval kernels against plain-torch references and explicit formulas."""

import contextlib
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from triforce_cli.kernels import (
    attention,
    attention_reference,
    chunk_mean_keys,
    gather_chunks,
    linear,
    linear_reference,
    score_chunks,
    score_workspace,
    summary_scores,
    top_chunks,
)
from triforce_cli.kernels import retrieval as kernel_retrieval
from triforce_cli.kernels.attention import (
    FEW_QUERIES,
    KEY_BLOCK,
    blocked_attention,
    grouped_attention,
    new_token_mask,
    sdpa_attention,
    torch_attention,
)
from triforce_cli.kernels.linear import FEW_ROWS, few_row_linear
from triforce_cli.kernels.retrieval import bound_scores, chunk_key_bounds

from triforce_cli.runtime.native import kernel_error

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


def qkv(num_q_heads: int, num_kv_heads: int, num_queries: int, num_keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q_heads, num_queries, HEAD_DIM, generator=g)
    k = torch.randn(num_kv_heads, num_keys, HEAD_DIM, generator=g)
    v = torch.randn(num_kv_heads, num_keys, HEAD_DIM, generator=g)
    return q, k, v


def explicit_attention(q, k, v, scale):
    """Loop over heads and queries: query t of head h reads KV head h // G, keys 0 .. L - T + t."""
    num_q_heads, num_queries, _ = q.shape
    num_kv_heads, num_keys, _ = k.shape
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    for h in range(num_q_heads):
        kv = h // group
        for t in range(num_queries):
            visible = num_keys - num_queries + t + 1
            weights = ((k[kv, :visible] @ q[h, t]) * scale).softmax(dim=0)
            out[h, t] = weights @ v[kv, :visible]
    return out


def test_new_token_mask_is_bottom_right_causal():
    mask = new_token_mask(3, 5, torch.device("cpu"))
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (1, 7), (3, 3), (4, 9)])
def test_new_token_mask_formula(num_queries, num_keys):
    mask = new_token_mask(num_queries, num_keys, torch.device("cpu"))
    assert mask.shape == (num_queries, num_keys)
    for t in range(num_queries):
        for j in range(num_keys):
            assert bool(mask[t, j]) == (j <= num_keys - num_queries + t)
    assert bool(mask[-1].all())  # the last query sees every key


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (1, 13), (4, 4), (5, 17)])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_explicit_loop(group, num_queries, num_keys):
    q, k, v = qkv(4, 4 // group, num_queries, num_keys)
    torch.testing.assert_close(attention_reference(q, k, v, SCALE), explicit_attention(q, k, v, SCALE))


@pytest.mark.parametrize("num_queries,num_keys", [(1, 1), (1, 13), (4, 4), (5, 17), (8, 40)])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    "kernel",
    [attention, grouped_attention, sdpa_attention, torch_attention],
    ids=["dispatch", "grouped", "sdpa", "torch"],
)
def test_attention_kernels_match_reference(kernel, group, num_queries, num_keys):
    q, k, v = qkv(4, 4 // group, num_queries, num_keys, seed=num_keys)
    out = kernel(q, k, v, SCALE)
    assert out.shape == q.shape
    torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_keys", [1, 13, 3000])
@pytest.mark.parametrize("group", [1, 3])
def test_grouped_single_query_matches_reference(group, num_keys):
    q, k, v = qkv(3, 3 // group, 1, num_keys, seed=num_keys)
    out = grouped_attention(q, k, v, SCALE)
    assert out.shape == q.shape
    torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("num_queries", [1, 2, FEW_QUERIES, FEW_QUERIES + 1])
def test_dispatch_matches_reference_on_a_long_strided_cache(num_queries, backend):
    """The cache hands attention views of a larger buffer; every path must read them as they are."""
    q, _, _ = qkv(6, 2, num_queries, 1, seed=num_queries)
    buffer = torch.randn(2, 2, 3064, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    k, v = buffer[0, :, :3003], buffer[1, :, :3003]  # (Hkv, L, D), head stride > L * D
    out = attention(q, k, v, SCALE, backend=backend)
    torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_queries", "half", "expected"),
    [
        (1, False, "grouped_attention"),
        (2, False, "grouped_attention"),
        (FEW_QUERIES, False, "grouped_attention"),
        (FEW_QUERIES + 1, False, "sdpa_attention"),
        (1, True, "cache_attention"),
        (FEW_QUERIES + 1, True, "cache_attention"),
    ],
)
def test_cpu_dispatch_by_number_of_queries_and_cache_dtype(monkeypatch, num_queries, half, expected):
    """A float16 cache runs cache_attention whatever the number of queries; float32 keys the few- and many-query
    paths."""
    q, k, v = qkv(4, 2, num_queries, 16)
    if half:
        if kernel_error() is not None:
            pytest.skip(kernel_error())
        k, v = k.half(), v.half()
    module = sys.modules["triforce_cli.kernels.attention"]  # the package re-exports a function under the same name
    calls = []
    for name in ("grouped_attention", "sdpa_attention", "cache_attention"):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original: calls.append(_n) or _f(*a))
    module.attention(q, k, v, SCALE)
    assert calls == [expected]


def test_multi_query_rows_equal_single_query_calls():
    """Verifying T tokens at once gives the same outputs as T decode steps against a growing cache."""
    q, k, v = qkv(4, 2, 5, 12, seed=3)
    batched = attention(q, k, v, SCALE)
    for t in range(5):
        keys = 12 - 5 + t + 1
        single = attention(q[:, t : t + 1], k[:, :keys], v[:, :keys], SCALE)
        torch.testing.assert_close(batched[:, t : t + 1], single, atol=1e-6, rtol=1e-5)


def test_masking_ignores_future_keys():
    """Changing keys/values a query may not see must not change its output."""
    q, k, v = qkv(4, 2, 3, 10, seed=4)
    out = attention(q, k, v, SCALE)
    k2, v2 = k.clone(), v.clone()
    k2[:, -1] += 5.0  # only the last query sees the last key
    v2[:, -1] -= 3.0
    out2 = attention(q, k2, v2, SCALE)
    torch.testing.assert_close(out[:, :2], out2[:, :2])
    assert not torch.allclose(out[:, 2], out2[:, 2])


# --- the sdpa backend: blocked attention ------------------------------------------------------------------------


@pytest.mark.parametrize(("num_keys", "block"), [(17, 16), (48, 16), (100, 16), (100, 1024), (40, 1)])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("num_queries", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_attention_matches_reference(dtype, num_queries, group, num_keys, block):
    """Blocks that divide L and blocks that leave a partial one, a block of one key, one block for all; the new keys
    spread over several blocks (17 queries in blocks of 16). bfloat16: within twice the reference's own error, the
    output's rounding."""
    q, k, v = (x.to(dtype) for x in qkv(4, 4 // group, num_queries, num_keys, seed=num_keys + num_queries))
    assert_near_reference(blocked_attention(q, k, v, SCALE, block=block), q, k, v, rounding=2, slack=1e-6)


def assert_near_reference(out, q, k, v, rounding: float, slack: float) -> None:
    """out, attention of q, k, v in their dtype, is attention_reference's: in float32 within the kernels'
    tolerance; in a 16-bit dtype within `rounding` times the reference's own error in that dtype (+ slack)."""
    assert out.shape == q.shape and out.dtype == q.dtype
    if q.dtype == torch.float32:
        torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)
        return
    exact = attention_reference(q.double(), k.double(), v.double(), SCALE)
    reference_error = (attention_reference(q, k, v, SCALE).double() - exact).abs().max().item()
    assert (out.double() - exact).abs().max().item() <= rounding * reference_error + slack


@pytest.mark.parametrize(
    ("num_queries", "num_keys"), [(1, 1), (1, 50), (7, 50), (50, 50), (1, 1000), (64, 1000), (300, 1000)]
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_matches_reference(dtype, group, num_queries, num_keys):
    """The 'sdpa' backend's split into the context part and the causal square of the new keys, merged by their
    log-sum-exps: one query, a chunk after others, a first chunk (T == L). float32 within the kernels' tolerance;
    bfloat16 within four times the reference's own error, the bound CUDA's test of this backend keeps (the two
    parts' outputs are rounded before the merge, and the merged one again)."""
    q, k, v = (x.to(dtype) for x in qkv(4, 4 // group, num_queries, num_keys, seed=num_keys + num_queries))
    assert_near_reference(torch_attention(q, k, v, SCALE), q, k, v, rounding=4, slack=1e-5)


def count_calls(monkeypatch, module, *names: str) -> list[str]:
    """Record the names of module's functions among names as they are called (and still run them)."""
    calls = []
    for name in names:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original, **kw: calls.append(_n) or _f(*a, **kw))
    return calls


@pytest.mark.parametrize(
    ("num_queries", "num_keys", "fused_calls"),
    [(1, 30, 1), (6, 6, 1), (5, 30, 2), (64, 16384, 2)],
    ids=["one-query", "first-chunk", "later-chunk", "long-context"],
)
def test_the_sdpa_backend_runs_fused_kernels_without_a_loop_over_key_blocks(num_queries, num_keys, fused_calls):
    """A prefill chunk after the first (T < L) runs two fused kernel calls, whatever L: no blocked_attention, whose
    Python loop took one iteration (two float32_bmm calls) per 1,024 keys, half a million of them for a 128K-token
    prefill. The CPU's fused kernel stands in for CUDA's."""
    module = sys.modules["triforce_cli.kernels.attention"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = count_calls(monkeypatch, module, "blocked_attention", "float32_bmm", "fused_attention")
        q, k, v = qkv(8, 2, num_queries, num_keys, seed=num_keys)
        out = attention(q, k, v, SCALE, backend="sdpa")
    assert calls == ["fused_attention"] * fused_calls
    torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


def test_torch_attention_runs_blocked_attention_where_no_fused_kernel_takes_the_inputs(monkeypatch):
    """float64, which the CPU's fused kernel is not asked to take, runs the blocked loop (float32 scores)."""
    module = sys.modules["triforce_cli.kernels.attention"]
    calls = count_calls(monkeypatch, module, "blocked_attention", "fused_attention")
    q, k, v = (x.double() for x in qkv(4, 2, 5, 30))
    out = torch_attention(q, k, v, SCALE)
    assert calls == ["blocked_attention"]
    torch.testing.assert_close(out, attention_reference(q, k, v, SCALE), atol=1e-5, rtol=1e-5)


def test_float32_bmm_upcasts_where_bmm_has_no_out_dtype(monkeypatch):
    """torch 2.7's bmm has no out_dtype (BMM_OUT_DTYPE false): 16-bit factors on CUDA are upcast instead, the same
    float32 product. Here a bmm without the keyword, as 2.7's, and CPU tensors that call themselves CUDA's."""
    module = sys.modules["triforce_cli.kernels.attention"]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 16, generator=g).bfloat16(), torch.randn(3, 16, 7, generator=g).bfloat16()
    expected = torch.bmm(a.float(), b.float())
    plain_bmm = torch.bmm
    monkeypatch.setattr(module, "BMM_OUT_DTYPE", False)
    monkeypatch.setattr(torch, "bmm", lambda x, y: plain_bmm(x, y))  # no out_dtype keyword
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    out = module.float32_bmm(a, b)
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_bmm_out_dtype_detection_is_torchs_own_overload():
    module = sys.modules["triforce_cli.kernels.attention"]
    assert module.BMM_OUT_DTYPE == ("dtype" in torch.ops.aten.bmm.overloads())


class LargestTensor(TorchDispatchMode):
    """Records the size in bytes of the largest tensor any op allocates while the mode is on (views of an op's
    inputs, such as a slice of the keys, allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


@pytest.mark.parametrize("math_only", [False, True], ids=["default", "math"])
def test_sdpa_backend_memory_is_bounded_by_the_chunk_not_the_context(math_only):
    """64 queries against 4,096 and 16,384 keys: the largest tensor any op makes is the same, one block's scores,
    far below the (Hq, T, L) float32 scores of SDPA's math kernel, which CUDA runs for a mask with grouped heads
    ("math" holds SDPA to that kernel here; "default" lets the CPU choose its own)."""
    num_q_heads, num_kv_heads, num_queries = 8, 2, 64
    largest = {}
    for num_keys in (4096, 16384):
        q, k, v = qkv(num_q_heads, num_kv_heads, num_queries, num_keys, seed=1)
        recorder = LargestTensor()
        with sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext(), recorder:
            attention(q, k, v, SCALE, backend="sdpa")
        largest[num_keys] = recorder.largest
    block_scores = num_q_heads * num_queries * KEY_BLOCK * 4  # Hkv * G*T * block float32 values
    assert largest[4096] == largest[16384] <= 2 * block_scores
    assert 8 * largest[16384] <= num_q_heads * num_queries * 16384 * 4


# --- retrieval kernels --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1024, 2])  # 2: three chunks averaged in two blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_mean_keys_matches_loop(block, dtype, monkeypatch):
    monkeypatch.setattr(kernel_retrieval, "MEAN_KEY_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 24, HEAD_DIM, generator=g).to(dtype)
    means = chunk_mean_keys(k, 8)
    assert means.shape == (2, 3, HEAD_DIM) and means.dtype == torch.float32
    for h in range(2):
        for c in range(3):
            torch.testing.assert_close(means[h, c], k[h, c * 8 : (c + 1) * 8].float().mean(dim=0))


@pytest.mark.parametrize("chunks_held", [0, 1, 2, 5])  # 0: a workspace smaller than a chunk, copied as without
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunk_means_through_a_workspace_are_the_means_without(chunks_held, dtype):
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 40, HEAD_DIM, generator=g).to(dtype)  # 5 chunks of 8
    workspace = torch.full((chunks_held * 3 * 8 * HEAD_DIM + 7,), float("nan"))  # stale contents, a ragged end
    assert torch.equal(chunk_mean_keys(k, 8, workspace), chunk_mean_keys(k, 8))
    assert workspace[: 3 * 8 * HEAD_DIM].isnan().any() == (chunks_held == 0)  # the copies went through it


@pytest.mark.parametrize("score", ["mean", "bound"])
@pytest.mark.parametrize("layers_held", [0, 1, 3, 4])  # 0: a workspace smaller than a layer, copied as without
def test_summary_scores_through_a_workspace_are_the_scores_without(score, layers_held):
    g = torch.Generator().manual_seed(3)
    summaries = torch.randn(2, 4, 3, 7, HEAD_DIM, generator=g).half()  # (2, layers, Hkv, C, D)
    held = summaries[: 1 if score == "mean" else 2, :, :, :5]  # 5 of 7 chunks summarised
    q = torch.randn(4, 6, HEAD_DIM, generator=g)  # (layers, Hq, D)
    workspace = torch.full((layers_held * held[:, 0].numel() + 3,), float("nan"))  # stale contents, a ragged end
    assert torch.equal(summary_scores(q, held, score, workspace), summary_scores(q, held, score))
    assert workspace[: held[:, 0].numel()].isnan().any() == (layers_held == 0)  # the copies went through it


def test_a_score_workspace_holds_its_bytes_or_one_layer_or_every_layer(monkeypatch):
    shape = (1, 4, 3, 7, HEAD_DIM)  # a layer's summaries: 168 float32, 672 bytes
    for workspace_bytes, layers in ((2 * 672 + 100, 2), (100, 1), (100 * 672, 4)):
        monkeypatch.setattr(kernel_retrieval, "SCORE_WORKSPACE_BYTES", workspace_bytes)
        workspace = score_workspace(shape, "cpu")
        assert workspace.dtype == torch.float32 and workspace.numel() == layers * 3 * 7 * HEAD_DIM


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_score_chunks_sums_query_heads_of_each_kv_head(num_q_heads, num_kv_heads):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(num_q_heads, HEAD_DIM, generator=g)
    means = torch.randn(num_kv_heads, 5, HEAD_DIM, generator=g)
    scores = score_chunks(q, means)
    group = num_q_heads // num_kv_heads
    expected = torch.zeros(num_kv_heads, 5)
    for h in range(num_q_heads):
        for c in range(5):
            expected[h // group, c] += torch.dot(q[h], means[h // group, c])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


def test_top_chunks_keeps_chunk_zero_sorted_and_best():
    scores = torch.tensor(
        [
            [-100.0, 1.0, 5.0, 3.0, 4.0, -2.0],
            [-1.0, 9.0, 0.0, 8.0, -5.0, 7.0],
        ]
    )
    chosen = top_chunks(scores, 3)
    assert chosen.tolist() == [[0, 2, 4], [0, 1, 3]]
    assert scores[0, 0] == -100.0  # the input is not modified
    assert top_chunks(scores, 1).tolist() == [[0], [0]]


def test_top_chunks_random_properties():
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        scores = torch.randn(3, 12, generator=g)
        chosen = top_chunks(scores, 4)
        assert chosen.shape == (3, 4)
        for h in range(3):
            ids = chosen[h].tolist()
            assert ids[0] == 0
            assert ids == sorted(ids) and len(set(ids)) == 4
            best_rest = sorted(range(1, 12), key=lambda c: -scores[h, c].item())[:3]
            assert set(ids[1:]) == set(best_rest)


def test_gather_chunks_picks_the_right_tokens():
    num_kv_heads, length, chunk = 2, 20, 4
    # key of token j in head h is (h * 1000 + j) in every dimension
    k = (torch.arange(num_kv_heads)[:, None] * 1000 + torch.arange(length)[None, :]).float()
    k = k[:, :, None].expand(-1, -1, HEAD_DIM).contiguous()
    ids = torch.tensor([[0, 3], [0, 4]])
    out = gather_chunks(k, ids, chunk)
    assert out.shape == (2, 8, HEAD_DIM)
    assert out[0, :, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert out[1, :, 0].tolist() == [1000, 1001, 1002, 1003, 1016, 1017, 1018, 1019]
    assert torch.equal(out[:, :, 0:1].expand(-1, -1, HEAD_DIM), out)


def test_gather_chunks_equals_a_gather_of_every_element_into_any_view():
    """Every layer's and head's chunks at once, from a view longer than its whole chunks, into a strided view."""
    g = torch.Generator().manual_seed(5)
    layers, num_kv_heads, chunk, chunks = 3, 2, 4, 6
    k = torch.randn(layers, num_kv_heads, chunks * chunk + 3, HEAD_DIM, generator=g).half()
    ids = torch.stack([torch.randperm(chunks, generator=g)[:3].sort().values for _ in range(layers * num_kv_heads)])
    ids = ids.view(layers, num_kv_heads, 3)
    positions = (ids[..., None] * chunk + torch.arange(chunk)).flatten(-2)  # (layers, Hkv, 3 * chunk)
    expected = torch.gather(k, -2, positions[..., None].expand(*positions.shape, HEAD_DIM))
    buffer = torch.zeros(layers, num_kv_heads, 5 * chunk, HEAD_DIM, dtype=k.dtype)
    gather_chunks(k, ids, chunk, out=buffer[:, :, chunk : 4 * chunk])
    assert torch.equal(buffer[:, :, chunk : 4 * chunk], expected)
    assert not buffer[:, :, :chunk].any() and not buffer[:, :, 4 * chunk :].any()
    strided = torch.zeros(layers, num_kv_heads, 3 * chunk, 2 * HEAD_DIM, dtype=k.dtype)[..., ::2]
    gather_chunks(k, ids, chunk, out=strided)
    assert torch.equal(strided, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_chunks_in_one_call_copies_what_a_copy_a_head_does(dtype, monkeypatch):
    """The extension's one call (csrc/gather_chunks.cpp) against the index_select of each head, from a view of the
    full cache's storage (its held positions, as RetrievalCache.select_chunks reads them) into the retrieval cache's
    first slots: the same bits, and nothing written outside the chosen slots."""
    if kernel_error() is not None:
        pytest.skip(kernel_error())
    g = torch.Generator().manual_seed(7)
    layers, num_kv_heads, chunk, chunks, keep = 4, 3, 16, 40, 9
    storage = torch.randn(layers, num_kv_heads, chunks * chunk + 21, HEAD_DIM, generator=g).to(dtype)
    source = storage[:, :, 2 * chunk :]  # heads further apart than their rows
    ids = torch.stack(
        [torch.randperm(chunks - 2, generator=g)[:keep].sort().values for _ in range(layers * num_kv_heads)]
    )
    ids = ids.view(layers, num_kv_heads, keep)
    slots = keep * chunk
    outputs = []
    for one_call in (True, False):
        monkeypatch.setattr(kernel_retrieval, "native_loaded", lambda one_call=one_call: one_call)
        buffer = torch.zeros(layers, num_kv_heads, slots + 2 * chunk, HEAD_DIM, dtype=dtype)
        assert kernel_retrieval._copies_in_one_call(source, ids, buffer[:, :, :slots]) == one_call
        gather_chunks(source, ids, chunk, out=buffer[:, :, :slots])
        outputs.append(buffer)
    assert torch.equal(outputs[0], outputs[1]) and outputs[0][:, :, :slots].any()
    assert not outputs[0][:, :, slots:].any()


def test_gather_chunks_in_one_call_refuses_a_chunk_outside_the_cache_and_an_out_over_its_source():
    if kernel_error() is not None:
        pytest.skip(kernel_error())
    k, out = torch.zeros(2, 20, HEAD_DIM), torch.zeros(2, 8, HEAD_DIM)
    for ids in ([[0, 5], [0, 1]], [[0, -1], [0, 1]]):  # 5 chunks of 4 tokens: 0..4
        with pytest.raises(RuntimeError, match="chunk indices in \\[0, L / chunk\\)"):
            torch.ops.triforce_cpu.gather_chunks(k, torch.tensor(ids), 4, out)
    assert not out.any()
    with pytest.raises(RuntimeError, match="out: memory apart from source's"):  # out over the chunks it reads
        torch.ops.triforce_cpu.gather_chunks(k, torch.tensor([[0, 3], [0, 3]]), 4, k[:, :8])


# --- linear ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_few_row_linear_matches_reference(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 24, generator=g), torch.randn(40, 24, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    expected = linear_reference(x, weight, bias)
    out = few_row_linear(x, weight, bias)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, expected)
    with torch.inference_mode():
        torch.testing.assert_close(linear(x, weight, bias), expected)


def test_linear_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(
        sys.modules["triforce_cli.kernels.linear"],
        "few_row_linear",
        lambda *args: calls.append(args[0].shape) or args[0],
    )
    weight = torch.randn(6, 4)
    with torch.inference_mode():
        linear(torch.randn(FEW_ROWS, 4), weight)  # decode and verification steps
        linear(torch.randn(FEW_ROWS + 1, 4), weight)  # prefill chunks: torch's linear
        linear(torch.randn(1, 2, 4), weight)  # batched input: torch's linear
    linear(torch.randn(2, 4, requires_grad=True), weight)  # training needs autograd: torch's linear
    assert calls == [(FEW_ROWS, 4)]


@pytest.mark.parametrize("num_queries, num_keys", [(1, 300), (1, 40), (3, 257), (8, 120), (20, 2100)])
@pytest.mark.parametrize("window", [None, 50])
def test_attention_reads_a_float16_cache_with_float32_queries(num_queries, num_keys, window):
    """attention() on a float16 cache: cache_attention, the window passed to it, gives the attention on the float16
    values (and not the one on the float32 values they were rounded from)."""
    if kernel_error() is not None:
        pytest.skip(kernel_error())
    q, k, v = qkv(6, 2, num_queries, num_keys, seed=num_keys)
    with torch.inference_mode():
        out = attention(q, k.half(), v.half(), SCALE, window=window, origin=7)
    expected = attention_reference(q, k.half().float(), v.half().float(), SCALE, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, attention_reference(q, k, v, SCALE, window), atol=1e-6, rtol=1e-6)


def test_a_failed_build_of_the_cpu_kernels_is_tried_once(monkeypatch, tmp_path):
    """Every CPU model load asks for the extension; a compile that fails (seconds) must not be repeated."""
    from torch.utils import cpp_extension
    from triforce_cli.kernels import native

    builds = []

    def failing_build(**kwargs):
        builds.append(kwargs["name"])
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(native, "native_loaded", lambda: False)
    monkeypatch.setattr(native, "_failure", [])
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpp_extension, "load", failing_build)
    for _ in range(3):
        with pytest.raises(native.KernelUnavailable, match="g\\+\\+: not found.*C\\+\\+ compiler"):
            native.load_native(tmp_path)
    assert len(builds) == 1


def test_bound_scores_bound_every_key_of_a_chunk_and_sum_the_query_group():
    """Quest's bound is no smaller than the best q . k of any key in the chunk, for each query head, and equals
    the brute-force sum over the group of sum_d max(q_d min_d, q_d max_d)."""
    torch.manual_seed(0)
    kv_heads, group, chunks, chunk, dim = 2, 3, 5, 4, 8
    keys = torch.randn(kv_heads, chunks * chunk, dim)
    q = torch.randn(kv_heads * group, dim)
    lows, highs = chunk_key_bounds(keys, chunk)
    scores = bound_scores(q, lows, highs)
    grouped = q.reshape(kv_heads, group, dim)
    brute = torch.maximum(grouped[:, :, None] * lows[:, None], grouped[:, :, None] * highs[:, None]).sum(-1).sum(1)
    torch.testing.assert_close(scores, brute)
    logits = torch.einsum("hgd,hld->hgl", grouped, keys).reshape(kv_heads, group, chunks, chunk)
    assert (scores >= logits.amax(dim=-1).sum(dim=1) - 1e-5).all()


def test_a_chunk_with_one_matching_key_scores_first_by_bound_but_not_by_mean():
    """One key along the query among keys that cancel out: its chunk's mean is average, its bound the highest."""
    query = torch.tensor([[1.0, 0.0]])
    keys = torch.tensor([[[0.5, 1], [0.5, -1], [0.5, 1], [0.5, -1], [4.0, 0], [-3.5, 0], [0.0, 1], [0.0, -1]]])
    mean = score_chunks(query, chunk_mean_keys(keys, 2))
    bound = bound_scores(query, *chunk_key_bounds(keys, 2))
    assert mean.argmax() == 0 and bound.argmax() == 2
