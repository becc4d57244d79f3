"""Attention of T new queries against a cache view whose last T keys belong to those same queries.

Every cache (full, StreamingLLM, retrieval) hands attention a view laid out as
``[context keys visible to every query | the T new keys]``, so one mask serves all of them: query t sees the
whole context and new keys 0..t ("bottom-right aligned" causal mask, as in FlashAttention 2).

Shapes: q (Hq, T, D); k, v (Hkv, L, D) with L >= T and Hq a multiple of Hkv (grouped-query attention,
query head h reads KV head h // (Hq // Hkv)). Output (Hq, T, D).

A sliding-window layer (Mistral, Qwen2's and Qwen3's windowed layers) reads a view of consecutive positions
(the full cache's, from its first held one): query t, at index L - T + t, reads keys j with L - T + t - W < j
(``window`` W), as transformers' sliding_window_overlay masks by position. cache_attention (a float16 CPU cache)
takes the window itself, keeping its blocks aligned to absolute positions. Elsewhere, where every query's window
starts at or before key 0 nothing changes; otherwise the keys before the first query's window are cut off the
view, which serves one query exactly, and several queries get each its own lower bound (windowed_attention).
"""

from enum import StrEnum

import torch
import torch.nn.functional as F
from triforce_cli.kernels import optional
from triforce_cli.kernels.native import native_loaded

FEW_QUERIES = 8  # grouped_attention beat or tied SDPA at every count measured up to here (docs/performance.md)
# keys per block of blocked_attention (the sdpa backend's fallback where no fused kernel takes the inputs): a block's
# scores are Hkv * G*T * KEY_BLOCK float32 values, 128 MiB per 1,024 queries of a model with 32 query heads,
# whatever the context length
KEY_BLOCK = 1024
# queries per SDPA call of windowed_attention on the 'sdpa' backend: a banded mask with grouped heads runs SDPA's math
# kernel on CUDA, (Hq, B, W + B) scores and K/V expanded to Hq heads over W + B keys, 0.3 GiB for 32 query heads and a
# 4,096-key window at 512, whatever the prefill chunk
WINDOW_QUERY_BLOCK = 512
# fewest slots per part of a fixed-shape step's split value product (attention_in_cache, slot_splits)
SPLIT_SLOTS = 256


def new_token_mask(num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Boolean (T, L) mask, True where query t may read key j: j <= L - T + t."""
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return cols <= rows + offset


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Plain attention: repeat KV heads, explicit masked softmax in float32; window: a sliding window, as
    attention() takes it."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # (Hq, L, D)
    v = v.repeat_interleave(group, dim=0)
    scores = (q.float() @ k.float().transpose(1, 2)) * scale  # (Hq, T, L)
    mask = new_token_mask(q.shape[1], k.shape[1], q.device)
    if window is not None:
        mask &= window_mask(q.shape[1], k.shape[1], window, q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype)


def mask_future_new_keys(scores: torch.Tensor, num_queries: int) -> None:
    """Scores (Hkv, G*T, L) of grouped query rows: -inf, in place, where query t would read new key j > t.

    Every query sees the context; only the last T columns (the new keys) need masking.
    """
    if num_queries == 1:
        return
    group = scores.shape[1] // num_queries
    future = ~new_token_mask(num_queries, num_queries, scores.device).repeat(group, 1)  # (G*T, T)
    scores[:, :, scores.shape[2] - num_queries :].masked_fill_(future, float("-inf"))


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """CPU path for few queries against a long cache: one batched matmul per KV head, no KV copies. window: a
    sliding window, each query reading its last ``window`` keys at most (window_mask).

    The G query heads that share a KV head are stacked into one (G*T, D) matrix, so each cached key is read
    once per KV head instead of once per query head. For one query the scores come from keys @ queries, a tall
    (L, G) product: MKL streams a long (L, D) matrix at close to full bandwidth as the left factor with a few
    columns on the right, and slowly as the right factor of a few rows (kernels/linear.py shows the same
    effect on weights). For T > 1 queries the few-row shape measured faster.
    """
    num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_kv_heads, group * num_queries, head_dim) * scale  # (Hkv, G*T, D)
    if num_queries == 1:
        scores = torch.bmm(k, qg.transpose(1, 2)).transpose(1, 2)  # (Hkv, G, L) from an (Hkv, L, G) product
    else:
        scores = torch.bmm(qg, k.transpose(1, 2))  # (Hkv, G*T, L)
        if window is None:
            mask_future_new_keys(scores, num_queries)
        else:
            hidden = ~window_mask(num_queries, k.shape[1], window, q.device)
            scores.masked_fill_(hidden.repeat(group, 1), float("-inf"))
    probs = scores.float().softmax(dim=-1).to(v.dtype)  # contiguous
    out = torch.bmm(probs, v)  # (Hkv, G*T, D)
    return out.reshape(num_q_heads, num_queries, head_dim)


def cache_attention_available(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the CPU extension's cache_attention (csrc/cache_attention.cpp) takes q against k: float32 queries and
    float16 keys on the CPU, the extension loaded (kernels.native). Every x86 CPU runs it; AVX-512 and AVX2 ones fast
    for head dims 64 and 128."""
    return q.dtype == torch.float32 and k.dtype == torch.float16 and q.device.type == "cpu" and native_loaded()


POSITION_SEGMENT = 2048  # keys per segment of cache_attention over a view of consecutive positions
SLOT_SEGMENT = 512  # keys per segment over a view of slots (the retrieval and StreamingLLM caches)


def segment_keys(slots_are_positions: bool) -> int:
    """The keys a segment of cache_attention holds over a cache's views (KVCache.slots_are_positions).

    A segment is the work a thread takes for one KV head, and its boundaries are part of the order of arithmetic.
    The full cache's views hold positions and keep 2,048: prefill chunks of a long prompt, which read every segment
    once per group of rows, lost 15% of their speed with 512 at 32K tokens. The retrieval and StreamingLLM caches'
    views are read by a few rows at a time (steps and verifications) or hold a window; at the default budget a
    retrieval view is about 1,040 slots, one segment of 2,048 for each of the embedded model's 3 KV heads, which
    leaves one of two threads idle a third of its time; segments of 512 give both the same keys to read
    (docs/performance.md, "Segments for the small caches").
    """
    return POSITION_SEGMENT if slots_are_positions else SLOT_SEGMENT


def cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    origin: int = 0,
    window: int | None = None,
    segment: int = POSITION_SEGMENT,
) -> torch.Tensor:
    """Attention of T float32 queries against a float16 cache view on the CPU, in one order of arithmetic per query:
    row t's result is the same bits whatever T, whichever rows go with it and however many threads run (so a
    prompt prefilled in chunks and token by token leave the same outputs).

    Keys are read in blocks of 64 and segments of `segment` aligned to absolute positions (origin + view index), each
    score is an FMA chain over the head dim, the softmax runs online over a segment's blocks in increasing position
    and segments merge in order; see the top of csrc/cache_attention.cpp. The float16 keys and values are widened
    exactly, so the result is softmax(scale q k^T) v on them up to float32 rounding.

    Args:
        q: (Hq, T, D) float32 queries, Hq a multiple of Hkv, query head h reading KV head h // (Hq // Hkv).
        k, v: (Hkv, L, D) float16, L >= T, laid out [context | the T new keys]; any head and row strides, each row's
            D contiguous (views of a longer cache buffer).
        scale: the factor on the scores.
        origin: the absolute position of view index 0 (>= 0).
        window: a sliding window W: query t, at view index L - T + t, reads keys j > L - T + t - W; None: every key
            up to its own.
        segment: keys a segment holds, a multiple of 64 (segment_keys).

    Returns:
        (Hq, T, D) float32.
    """
    return torch.ops.triforce_cpu.cache_attention(q, k, v, scale, origin, window or 0, segment)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch scaled_dot_product_attention with an explicit bottom-right mask (SDPA's is_causal is top-left): the
    CPU kernels' choice for many queries where cache_attention cannot run. On the CPU SDPA takes the mask into its
    own flash kernel; on CUDA a mask with grouped heads sends it to the math kernel, which expands K/V to every
    query head and materialises (Hq, T, L) scores, so the 'sdpa' backend runs torch_attention instead."""
    mask = None if q.shape[1] == 1 else new_token_mask(q.shape[1], k.shape[1], q.device)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0]


# whether torch.bmm takes out_dtype (its 'dtype' overload, torch 2.8 on): float32 products of 16-bit factors
BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def float32_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched product a @ b, a (B, M, K) and b (B, K, N) of one dtype, accumulated and returned in float32 (B, M, N).

    16-bit inputs on CUDA go through bmm's out_dtype (CUDA-only, float16/bfloat16 to float32, where torch has it:
    BMM_OUT_DTYPE): the tensor cores' product without a rounding of the result to 16 bits. Elsewhere both factors
    are upcast (a no-op for float32), which gives the same float32 product.
    """
    if BMM_OUT_DTYPE and a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def hidden_new_keys(num_queries: int, group: int, first: int, stop: int, device: torch.device) -> torch.Tensor:
    """Boolean (G*T, stop - first), True where query row g*T + t may not read key n of [first, stop), keys counted
    from the first new key (negative: context, seen by every query): where n > t."""
    keys = torch.arange(first, stop, device=device)[None, :]
    queries = torch.arange(num_queries, device=device)[:, None]
    return (keys > queries).repeat(group, 1)


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int = KEY_BLOCK
) -> torch.Tensor:
    """Grouped-query attention read in blocks of keys with an online softmax, in plain torch ops on any device.

    The G = Hq / Hkv query heads of a KV head are stacked into (Hkv, G*T, D) rows, so K/V are never expanded to
    the query heads. Keys and values are read block positions at a time; each block's float32 scores update a
    running row maximum, a running sum of exponentials and a float32 output accumulator, both rescaled when the
    maximum grows. Only blocks reaching into the last T keys (the new ones) are masked. The extra memory is that of
    one block, O(Hkv * G*T * block), whatever L; the first block holds key 0, which every query sees, so every
    row's maximum is finite from then on.

    Args:
        q: (Hq, T, D) queries.
        k, v: (Hkv, L, D) keys and values, L >= T, the last T keys the queries' own.
        scale: the factor on the scores.
        block: keys per block.

    Returns:
        (Hq, T, D) in q's dtype.
    """
    num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys, _ = k.shape
    group = num_q_heads // num_kv_heads
    rows = group * num_queries
    first_new = num_keys - num_queries
    qg = q.reshape(num_kv_heads, rows, head_dim)  # (Hkv, G*T, D)
    top = torch.full((num_kv_heads, rows, 1), float("-inf"), device=q.device)  # running maximum
    total = torch.zeros(num_kv_heads, rows, 1, device=q.device)  # running sum of exponentials
    out = torch.zeros(num_kv_heads, rows, head_dim, device=q.device)  # float32 accumulator
    for start in range(0, num_keys, block):
        stop = min(start + block, num_keys)
        scores = float32_bmm(qg, k[:, start:stop].transpose(1, 2)).mul_(scale)  # (Hkv, G*T, B)
        if stop > first_new:
            hidden = hidden_new_keys(num_queries, group, start - first_new, stop - first_new, q.device)
            scores.masked_fill_(hidden, float("-inf"))
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
        rescale = (top - new_top).exp_()  # (Hkv, G*T, 1), 0 before the first block
        weights = scores.sub_(new_top).exp_()
        total.mul_(rescale).add_(weights.sum(dim=-1, keepdim=True))
        out.mul_(rescale).add_(float32_bmm(weights.to(v.dtype), v[:, start:stop]))  # (Hkv, G*T, D)
        top = new_top
    return out.div_(total).to(q.dtype).reshape(num_q_heads, num_queries, head_dim)


FUSED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the CPU's fused SDPA kernel takes


def fused_kernel(q: torch.Tensor, k: torch.Tensor, causal: bool) -> str | None:
    """Which of SDPA's fused kernels that return their log-sum-exp takes q (1, H, T, D) against k and v (1, Hk, L, D):
    'cpu' (the CPU's flash kernel), 'flash' (CUDA's, 16-bit), 'efficient' (CUDA's memory-efficient kernel, float32
    included) or None (none does). Only 'flash' reads grouped heads (Hk < H) natively; grouped inputs are asked
    of the others as torch_attention then calls them, with the keys expanded to q's heads, which only the square
    part has (L == T), so q stands in for those keys. On CUDA the head dim must be a multiple of 8: SDPA pads
    others before it calls these kernels, which torch_attention does not."""
    if q.device.type == "cpu":
        return "cpu" if q.dtype in FUSED_CPU_DTYPES else None
    if q.device.type != "cuda" or q.shape[-1] % 8:
        return None
    grouped = q.shape[1] != k.shape[1]
    if torch.backends.cuda.can_use_flash_attention(torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, causal, grouped)):
        return "flash"
    keys = q if grouped else k
    if torch.backends.cuda.can_use_efficient_attention(
        torch.backends.cuda.SDPAParams(q, keys, keys, None, 0.0, causal, False)
    ):
        return "efficient"
    return None


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused SDPA kernel (fused_kernel's choice) on q (1, H, T, D) and k, v (1, Hk, L, D): every key visible,
    or SDPA's top-left causal mask (query t reads keys 0..t). Returns the output (1, H, T, D) in q's dtype and the
    float32 natural log-sum-exp of each row's scaled scores (1, H, T)."""
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kernel == "flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse.narrow(-1, 0, q.shape[2])  # the kernel pads its rows of log-sum-exp to a multiple of 32


def merge_by_log_sum_exp(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's own: outputs (H, T, D) and their rows'
    log-sum-exps (H, T), weighted by each set's share of the softmax mass, in float32. Returns (H, T, D) in dtype."""
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)  # (H, T)
    out = None
    for part, lse in parts:
        weighted = part.float().mul_((lse - total).exp_().unsqueeze(-1))  # (H, T, D) float32, a new tensor
        out = weighted if out is None else out.add_(weighted)
    return out.to(dtype)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The 'sdpa' backend: torch ops only, any device, memory bounded by the chunk rather than the context.
    q (Hq, T, D), k and v (Hkv, L, D) as attention() takes them; output (Hq, T, D).

    The bottom-right causal mask splits into two masks SDPA's fused kernels know without a mask tensor: the context
    keys [0, L - T), which every query reads (no mask), and the T new keys, a square whose bottom-right mask is
    SDPA's top-left is_causal. Each part runs one fused kernel (fused_kernel) that also returns the log-sum-exp of
    each row, and the two are merged by it (merge_by_log_sum_exp); one query, or T == L, is one part alone.
    Grouped heads are never expanded over the context: for the context part, which masks nothing, the G query heads
    of a KV head are stacked into (Hkv, G*T, D) rows (every kernel takes that); the square part reads grouped heads
    natively in CUDA's flash kernel and expands only the T new keys and values for the others. Memory beyond the
    kernels' tiles is a few (Hq, T, D) tensors. Inputs no fused kernel takes (a head dim or dtype) run
    blocked_attention.
    """
    num_q_heads, num_queries, head_dim = q.shape
    num_kv_heads, num_keys, _ = k.shape
    group = num_q_heads // num_kv_heads
    square = num_queries > 1  # the new keys as a part of their own; one query reads every key unmasked
    context = num_keys - num_queries if square else num_keys  # keys every query reads
    # views by narrow and unsqueeze, not indexing, so that fake CUDA tensors run this too (tests/memory_accounting.py)
    stacked = q.reshape(num_kv_heads, group * num_queries, head_dim).unsqueeze(0)  # (1, Hkv, G*T, D)
    context_keys, context_values = (x.narrow(1, 0, context).unsqueeze(0) for x in (k, v))  # (1, Hkv, context, D)
    new_keys, new_values = (x.narrow(1, context, num_keys - context).unsqueeze(0) for x in (k, v))  # (1, Hkv, T, D)
    context_kernel = fused_kernel(stacked, context_keys, causal=False) if context else None
    square_kernel = fused_kernel(q.unsqueeze(0), new_keys, causal=True) if square else None
    if (context and context_kernel is None) or (square and square_kernel is None):
        return blocked_attention(q, k, v, scale)
    parts = []  # (output (Hq, T, D), log-sum-exp (Hq, T)) of each part
    if context:
        out, lse = fused_attention(stacked, context_keys, context_values, scale, False, context_kernel)
        parts.append((out.reshape(num_q_heads, num_queries, head_dim), lse.reshape(num_q_heads, num_queries)))
    if square:
        if square_kernel != "flash" and group > 1:
            new_keys, new_values = (x.repeat_interleave(group, dim=1) for x in (new_keys, new_values))  # (1, Hq, T, D)
        out, lse = fused_attention(q.unsqueeze(0), new_keys, new_values, scale, True, square_kernel)
        parts.append((out.squeeze(0), lse.squeeze(0)))
    if len(parts) == 1:
        return parts[0][0]
    return merge_by_log_sum_exp(parts, q.dtype)


def flash_window(window: int | None) -> tuple[int, int]:
    """FlashAttention's window_size for a sliding window W (None: none): W - 1 keys left of each query's own, none
    right; (-1, -1) is its unbounded window."""
    return (-1, -1) if window is None else (window - 1, 0)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """FlashAttention 2: bottom-right causal masking, grouped-query heads and sliding windows are native."""
    out = optional.flash_attn_func(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        softmax_scale=scale,
        causal=True,
        window_size=flash_window(window),
    )  # (1, T, Hq, D)
    return out[0].transpose(0, 1)


@torch.library.custom_op("triforce::flash_decode", mutates_args=())
def flash_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor, scale: float, window: int = -1
) -> torch.Tensor:
    """FlashAttention's decoding kernel (flash_attn_with_kvcache) over a cache layer's whole buffers.

    q (Hq, T, D); keys, values (Hkv, S, D) with the T new keys already written at slots [seen - T, seen); seen
    (1,) int32 on the device; window: a sliding window over slots of consecutive positions (the full cache's), -1:
    none.
    The kernel reads the buffers in place: it takes any strides whose last one is 1 (flash-attn's mha_fwd_kvcache
    checks only that), so the head-major (Hkv, S, D) layout every cache keeps is read through a (1, S, Hkv, D) view,
    no copy; the causal mask is bottom-right aligned, as the caches need.
    A custom op, so that torch.compile keeps it as one call inside a captured graph: the flash-attn function
    itself is not traceable.
    """
    out = optional.flash_attn_with_kvcache(
        q.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        cache_seqlens=seen,
        softmax_scale=scale,
        causal=True,
        window_size=flash_window(None if window < 0 else window),
    )  # (1, T, Hq, D)
    return out[0].transpose(0, 1).contiguous()


@flash_decode.register_fake
def _(q, keys, values, seen, scale, window=-1):
    return q.new_empty(q.shape)  # contiguous, as flash_decode returns it whatever q's strides


def step_attention_bias(
    start: torch.Tensor,
    num_queries: int,
    num_slots: int,
    group: int,
    window: int | None = None,
    first_slot: torch.Tensor | None = None,
) -> torch.Tensor:
    """The additive float32 mask of a fixed-shape step (attention_in_cache): 0 where query row g*T + t may read slot
    s, -inf where not; query t reads slots [0, start + t], above start + t - window with a window, from first_slot on
    with one.

    Args:
        start: (1,) int32 on the device, the slot of the first new key.
        num_queries: T.
        num_slots: S, the buffers' slots.
        group: G, the query heads per KV head.
        window: a sliding window over slots of consecutive positions, or None.
        first_slot: (..., 1) int32 on the device, the first slot read (per layer: SlotCache.first_slots_at), or None.

    Returns:
        (..., G*T, S) float32, the leading dims first_slot's.
    """
    last_visible = start.long() + torch.arange(num_queries, device=start.device)[:, None]  # (T, 1)
    slots = torch.arange(num_slots, device=start.device)  # (S,)
    hidden = slots > last_visible  # (T, S)
    if window is not None:
        hidden |= slots <= last_visible - window
    if first_slot is not None:
        hidden = hidden | (slots < first_slot.long()[..., None])  # (..., T, S)
    bias = torch.where(hidden, float("-inf"), 0.0)
    return bias.unsqueeze(-3).expand(*bias.shape[:-2], group, num_queries, num_slots).flatten(-3, -2)


def slot_splits(num_slots: int) -> int:
    """P, the parts attention_in_cache splits S slots into for the value product: the most that divide S evenly
    with at least SPLIT_SLOTS slots each (1 for fewer than 2 * SPLIT_SLOTS, or for an S with no such divisor)."""
    for parts in range(num_slots // SPLIT_SLOTS, 1, -1):
        if num_slots % parts == 0:
            return parts
    return 1


def attention_in_cache(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    backend: str,
    window: int | None = None,
    first_slot: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a fixed-shape step over a cache layer's whole buffers keys, values (Hkv, S, D), holding the T
    new keys and values at slots [start, start + T), start (1,) int32 on the device: query t (q: (Hq, T, D)) reads
    slots [0, start + t]. Nothing depends on a host-side length, so the step compiles once for every position.
    Output (Hq, T, D), laid out as (T, Hq, D) (the output projection's input, no copy).

    window: a sliding window over slots of consecutive positions (the full cache's): query t reads only slots above
    start + t - window. first_slot: (1,) int32 on the device, the first slot any query reads (a draft cache's
    windowed layer, SlotCache.first_slots); 'flash' cannot take it, and runs the masked path instead. bias: the
    step's step_attention_bias for these (G*T, S), built once for every layer (cache.StaticStep); None: built here.

    'flash' reads through flash_decode, which stops at slot start + T. Any other backend computes grouped-query
    attention over the whole buffers: float32 scores (float32_bmm for 16-bit inputs, the scale applied to them,
    not to 16-bit queries) with the bias added in the same op for float32 ones (baddbmm), softmax in float32, the
    weights rounded to the values' dtype for their product, as FlashAttention does. That product is split over
    the slots (split-K): P = slot_splits(S) parts of S/P slots, (Hkv*P, G*T, S/P) @ (Hkv*P, S/P, D), then a sum
    over the parts, so that a GPU runs Hkv*P products in parallel where Hkv (8 for Llama-3-8B) leave most of it
    idle; the weights take their split layout in the copy that rounds them.

    Those backends read all S slots, whatever the position: the graph's shapes are fixed and the position lives on
    the device, so reading only a length bucket would put a host-side bucket into the graph, one more compiled
    graph (and CUDA graph) per bucket for every padded length and cache kind. The cost is the unused slots: a full
    cache holds prompt + max_new_tokens + headroom (decoding.sizing.CacheSpec.capacities), so at most the new
    tokens' share is read in vain, small for the long prompts TriForce serves; the drafts' caches are as long as
    their budget and window. A full cache kept from a longer earlier prompt (Engine._allocate reuses it) is read to
    its whole capacity.
    """
    num_q_heads, num_queries, head_dim = q.shape
    if backend == "flash" and first_slot is None:
        return flash_decode(q, keys, values, start + num_queries, scale, -1 if window is None else window)
    num_kv_heads, num_slots = keys.shape[:2]
    group = num_q_heads // num_kv_heads
    rows = group * num_queries
    if bias is None:
        bias = step_attention_bias(start, num_queries, num_slots, group, window, first_slot)
    qg = q.reshape(num_kv_heads, rows, head_dim)  # (Hkv, G*T, D)
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=scale)  # (Hkv, G*T, S)
    else:
        scores = torch.add(bias, float32_bmm(qg, keys.transpose(1, 2)), alpha=scale)
    parts = slot_splits(num_slots)
    split = num_slots // parts
    weights = scores.softmax(dim=-1).view(num_kv_heads, rows, parts, split).transpose(1, 2)  # (Hkv, P, G*T, S/P)
    if weights.dtype == values.dtype:
        weights = weights.contiguous()  # a copy where P > 1
    else:
        weights = weights.to(values.dtype, memory_format=torch.contiguous_format)  # rounded and split in one copy
    partial = torch.bmm(
        weights.view(num_kv_heads * parts, rows, split), values.reshape(num_kv_heads * parts, split, head_dim)
    )  # (Hkv*P, G*T, D)
    partial = partial.view(num_kv_heads, parts, group, num_queries, head_dim).permute(3, 0, 2, 4, 1)
    out = partial.sum(dim=-1)  # (T, Hkv, G, D), contiguous
    return out.view(num_queries, num_q_heads, head_dim).transpose(0, 1)


class AttentionBackend(StrEnum):
    """The kernel families attention() computes with (attention_backend picks one for a device and dtype)."""

    FLASH = "flash"  # FlashAttention: CUDA and a 16-bit dtype, where flash-attn is installed
    SDPA = "sdpa"  # torch ops, anywhere (torch_attention)
    CPU = "cpu"  # the CPU kernels below


ATTENTION_BACKENDS = tuple(backend.value for backend in AttentionBackend)


def attention_backend(
    device: torch.device, dtype: torch.dtype, requested: str = "auto", flash_installed: bool | None = None
) -> str:
    """The kernel family attention() uses for tensors on device in dtype: 'flash' (FlashAttention, CUDA and a 16-bit
    dtype, where flash-attn is installed), 'sdpa' (torch ops, anywhere: torch_attention) or 'cpu' (the CPU kernels
    below). 'auto' picks the fastest that runs; a requested one that cannot run is a ValueError saying why.
    flash_installed: whether flash-attn is there, where the caller knows; None: whether it imported here.
    """
    if flash_installed is None:
        flash_installed = optional.flash_attn_func is not None
    flash_runs = device.type == "cuda" and flash_installed and dtype in (torch.float16, torch.bfloat16)
    if requested == "auto":
        return "flash" if flash_runs else "sdpa" if device.type == "cuda" else "cpu"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{requested}' (choose from auto, {', '.join(ATTENTION_BACKENDS)})")
    if requested == "flash" and not flash_runs:
        raise ValueError("flash attention needs a CUDA GPU, float16 or bfloat16, and the flash-attn package")
    if requested == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu attention kernels run on the CPU, not on {device.type}")
    return requested


def windowed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int,
    backend: str,
) -> torch.Tensor:
    """Attention of a sliding-window layer whose view reaches before some query's window (L > window): query t
    reads keys j with L - T + t - window < j <= L - T + t, where attention() cannot pass the window to
    cache_attention.

    'flash' masks the window itself. Otherwise the keys before the first query's window are cut off: one query
    then reads the rest as attention() would; several queries, each with its own lower bound, read at most
    window + T - 1 keys with the band mask (window_mask): on the CPU up to FEW_QUERIES of them through
    grouped_attention, else SDPA. The 'sdpa' backend reads WINDOW_QUERY_BLOCK queries at a time, each block against
    the view up to its last query's own key, so that the math kernel's scores are bounded by the block rather than
    the chunk.

    Args:
        q: (Hq, T, D) queries.
        k, v: (Hkv, L, D) keys and values of consecutive positions, the last T the queries' own.
        scale: the factor on the scores.
        window: the layer's sliding window W.
        backend: attention_backend's choice.

    Returns:
        (Hq, T, D) in q's dtype.
    """
    num_queries, num_keys = q.shape[1], k.shape[1]
    if backend == "flash":
        return flash_attention(q, k, v, scale, window)
    if backend == "sdpa" and num_queries > WINDOW_QUERY_BLOCK:
        blocks = []
        for start in range(0, num_queries, WINDOW_QUERY_BLOCK):
            stop = min(start + WINDOW_QUERY_BLOCK, num_queries)
            seen = num_keys - num_queries + stop  # the view up to the block's last query's own key
            blocks.append(attention(q[:, start:stop], k[:, :seen], v[:, :seen], scale, backend, window))
        return torch.cat(blocks, dim=1)  # (Hq, T, D)
    first = max(0, num_keys - num_queries - window + 1)  # the first key the first query reads
    k, v = k[:, first:], v[:, first:]
    if num_queries == 1:
        return attention(q, k, v, scale, backend)
    if backend == "cpu" and num_queries <= FEW_QUERIES:
        return grouped_attention(q, k, v, scale, window)  # a verification step's fast path, banded
    mask = window_mask(num_queries, k.shape[1], window, q.device)
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0]


def window_mask(num_queries: int, num_keys: int, reach: int, device: torch.device) -> torch.Tensor:
    """Boolean (T, L) mask, True where query t may read key j: L - T + t - reach < j <= L - T + t (the bottom-right
    causal mask of new_token_mask, each query reading its last ``reach`` keys at most)."""
    offset = num_keys - num_queries
    rows = torch.arange(num_queries, device=device)[:, None]
    cols = torch.arange(num_keys, device=device)[None, :]
    return (cols <= rows + offset) & (cols > rows + offset - reach)


def runs_cache_attention(backend: str | None, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention() on backend (None: the fastest for q's device and dtype) computes queries like q against
    keys like k (their dtypes and device: any tensors of them) with cache_attention: the 'cpu' backend and float32
    queries against float16 keys, where the extension is loaded (cache_attention_available)."""
    return (backend or attention_backend(q.device, q.dtype)) == "cpu" and cache_attention_available(q, k)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    backend: str | None = None,
    window: int | None = None,
    origin: int = 0,
    segment: int = POSITION_SEGMENT,
) -> torch.Tensor:
    """Dispatch to a kernel of backend (attention_backend; None: the fastest for q's device and dtype), and within
    the CPU kernels to the fastest for the number of queries.

    window: the sliding window of the layer, over a view of consecutive positions; None: every key. origin: the
    absolute position of view index 0 (the full cache's first held position, 0 for the other caches), to which
    cache_attention aligns its blocks of keys; segment: the keys of its segments (segment_keys).

    On the CPU, float32 queries against float16 keys and values (a CPU cache) run cache_attention, windowed layers
    included (the window goes to the kernel, which keeps its blocks aligned): one kernel and one order of arithmetic
    for prefill chunks, verification and decoding. Other dtypes keep grouped_attention for up to FEW_QUERIES
    queries, where it beat or tied SDPA at every context length measured (SDPA won at 16), and SDPA beyond. See
    docs/performance.md for the timings.
    """
    if runs_cache_attention(backend, q, k):
        return cache_attention(q, k, v, scale, origin, window, segment)
    backend = backend or attention_backend(q.device, q.dtype)
    if k.dtype != q.dtype:  # a float16 CPU cache read by another kernel: widened, layer by layer
        k, v = k.to(q.dtype), v.to(q.dtype)
    if window is not None and k.shape[1] > window:
        return windowed_attention(q, k, v, scale, window, backend)
    if backend == "flash":
        return flash_attention(q, k, v, scale)
    if backend == "sdpa":
        return torch_attention(q, k, v, scale)
    if q.shape[1] <= FEW_QUERIES:
        return grouped_attention(q, k, v, scale)
    return sdpa_attention(q, k, v, scale)
