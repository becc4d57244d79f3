"""A decoder layer's ops on the CPU's float32 activations in the extension (csrc/step_ops.cpp): RMSNorm, RoPE,
SiLU(gate) * up, a layer's two halves around the cache write in one call each (attention_input, layer_output), and
a whole layer over a float16 cache's storage in one call (cached_layer: the two halves, the cache write and
cache_attention), every layer of a model in one call (cached_layers, over a LayerStack built once per model), the
output layer in one call (output_logits: the final norm, the product, the logits spread over the vocabulary), and a
whole eager step from token ids to logits in one call (cached_step).

A decode step of a float32 model with tiled or GGUF linears (runtime/model.py's DecoderLayer) then makes a few calls
per layer, where torch's ops made dozens, each with its fixed cost: the norms' pow/mean/rsqrt/multiplies, RoPE's
products and sum, the slices, the SiLU and its product, the residual adds. Each op computes a row in one order of
arithmetic whatever rows come with it and however many threads run, as the products and the attention kernel do,
so a position keeps the same bits in a decode step, a verification and a prefill chunk. The bits may differ from
torch's (its norm's and SiLU's vectorised reductions and exp): every position of the path is computed by these.

A projection is handed over as its operands (Projection): for each part (one, but for GGUF blocks of different kinds
side by side) three tensors, GGUF blocks (q, d and m or None: views of a kernels.gguf.PackedBlocks's records) or
tiles (tiles, None, bias or None: kernels.linear.pack_tiles, pad_bias), and the part's own output features.

The ops that take a LayerStack or an OutputHead are called with __torch_function__ turned off for tensor subclasses
(plain_call): torch looks for that attribute on every argument of an op call, and on a ScriptObject the lookup fails
by raising and clearing an AttributeError, ~40 us a ScriptObject, twice a decode step; no argument of these ops is a
tensor subclass.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Projection:
    """A linear's operands for the step ops: operands, three per part; features, each part's outputs."""

    operands: list[torch.Tensor | None]
    features: list[int]

    @staticmethod
    def side_by_side(parts: "list[Projection]") -> "Projection":
        """One projection computing parts' outputs side by side."""
        return Projection([t for part in parts for t in part.operands], [n for part in parts for n in part.features])


# the context the ScriptObject-taking ops are called in (module docstring)
plain_call = torch._C.DisableTorchFunctionSubclass


def step_ops_available() -> bool:
    """Whether the extension holding these ops is loaded (kernels.native.load_native)."""
    return hasattr(torch.ops.triforce_cpu, "layer_output")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x (T, C) float32 divided by its root mean square (plus eps under the root), times weight (C,)."""
    return torch.ops.triforce_cpu.rms_norm(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (T, 2I) float32, each row [gate | up] -> SiLU(gate) * up (T, I)."""
    return torch.ops.triforce_cpu.silu_mul(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_heads(
    qkv: torch.Tensor,
    rotation: torch.Tensor,
    heads: int,
    rotated: int,
    q_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """The heads of qkv laid out head-major, the first rotated ones by RoPE.

    Args:
        qkv: (T, H * D) float32, each row the heads side by side (queries, keys, values).
        rotation: (T, 2, 2, D/2) float32, [[cos, -sin], [sin, cos]] per row (Transformer.rotary).
        heads: H.
        rotated: the first heads to rotate (queries and keys).
        q_heads: the first of them normalised by q_norm, the rest of the rotated ones by k_norm (Qwen3), if given.
        q_norm, k_norm: (D,) RMSNorm weights, or None (both or neither).
        eps: the norms' epsilon.
    Returns:
        (H, T, D) float32, contiguous.
    """
    return torch.ops.triforce_cpu.rotary_heads(qkv, rotation, heads, rotated, q_heads, q_norm, k_norm, eps)


def rotary_heads_reference(
    qkv: torch.Tensor,
    rotation: torch.Tensor,
    heads: int,
    rotated: int,
    q_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor:
    """Plain torch: the rotation as runtime/model.py's rotate computes it, half i = sum over j of x_j * R[i][j]."""
    split = qkv.view(qkv.shape[0], heads, -1).transpose(0, 1)  # (H, T, D)
    front = split[:rotated]
    if q_norm is not None:
        front = torch.cat(
            [rms_norm_reference(front[:q_heads], q_norm, eps), rms_norm_reference(front[q_heads:], k_norm, eps)]
        )
    halves = front.unflatten(-1, (1, 2, front.shape[-1] // 2))  # (rotated, T, 1, 2, D/2)
    turned = (halves * rotation).sum(dim=-2).flatten(-2)  # (rotated, T, D)
    return torch.cat([turned, split[rotated:]])


def attention_input(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: Projection,
    rotation: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's first half: x (T, C) float32 normed (norm_weight, eps), projected (qkv: queries, keys, values
    stacked), queries and keys rotated by rotation (T, 2, 2, D/2), each head normed first where q_norm and k_norm
    (Qwen3) are given.

    Returns:
        q (Hq, T, D), k and v (Hkv, T, D), float32, each contiguous.
    """
    return torch.ops.triforce_cpu.attention_input(
        x, norm_weight, eps, qkv.operands, qkv.features, rotation, q_heads, kv_heads, q_norm, k_norm
    )


def layer_output(
    x: torch.Tensor,
    attended: torch.Tensor,
    o_proj: Projection,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: Projection,
    down: Projection,
) -> torch.Tensor:
    """A layer's second half: h = x + o_proj(attended as (T, Hq * D)), then h + down(SiLU(gate) * up) for gate, up
    = gate_up(RMSNorm(h)) (norm_weight, eps).

    Args:
        x: (T, C) float32, the layer's input.
        attended: (Hq, T, D) float32, the attention output.
    Returns:
        (T, C) float32.
    """
    return torch.ops.triforce_cpu.layer_output(
        x,
        attended,
        o_proj.operands,
        o_proj.features,
        norm_weight,
        eps,
        gate_up.operands,
        gate_up.features,
        down.operands,
        down.features,
    )


def cached_layer(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: Projection,
    rotation: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    write_slot: int,
    view_start: int,
    scale: float,
    origin: int,
    window: int | None,
    segment: int,
    o_proj: Projection,
    post_norm: torch.Tensor,
    post_eps: float,
    gate_up: Projection,
    down: Projection,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole decoder layer over a float16 cache in one call: attention_input, the new keys and values written to
    layer's slots [write_slot, write_slot + T) of keys and values (rounded to float16 as an indexed write into the
    cache rounds them), cache_attention of the queries over the slots [view_start, write_slot + T), layer_output.
    Each step is the op it replaces, so the outputs and the cache hold the same bits as those ops' calls.

    Args:
        x: (T, C) float32, the layer's input.
        keys, values: (layers, Hkv, S, D) float16, the cache's storage, written in place.
        origin: the position of view index view_start (KVCache.origin).
        window: the layer's sliding window over slots of consecutive positions, or None.
        segment: cache_attention's keys per segment (kernels.attention.segment_keys).
        The rest: attention_input's and layer_output's.
    Returns:
        The layer's output (T, C) and its queries (Hq, T, D), float32.
    """
    return torch.ops.triforce_cpu.cached_layer(
        x, norm_weight, eps, qkv.operands, qkv.features, rotation, q_heads, kv_heads, q_norm, k_norm,
        keys, values, layer, write_slot, view_start, scale, origin, window or 0, segment,
        o_proj.operands, o_proj.features, post_norm, post_eps, gate_up.operands, gate_up.features,
        down.operands, down.features,
    )  # fmt: skip


def layer_stack() -> torch.ScriptObject:
    """An empty stack of layers for cached_layers; stack_layer adds each in turn."""
    return torch.classes.triforce_cpu.LayerStack()


def stack_layer(
    stack: torch.ScriptObject,
    *,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: Projection,
    q_heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    layer: int,
    scale: float,
    window: int | None,
    o_proj: Projection,
    post_norm: torch.Tensor,
    post_eps: float,
    gate_up: Projection,
    down: Projection,
) -> None:
    """Add a layer to stack: cached_layer's operands but for a step's own (x, rotation, the cache and its slots);
    layer: its index in the cache's storage; window: its sliding window, where a step's views hold consecutive
    positions."""
    stack.add(
        norm_weight, eps, qkv.operands, qkv.features, q_heads, kv_heads, q_norm, k_norm, layer, scale, window or 0,
        o_proj.operands, o_proj.features, post_norm, post_eps, gate_up.operands, gate_up.features, down.operands,
        down.features,
    )  # fmt: skip


class StackWrite(NamedTuple):
    """What cached_layers and cached_step read and write of a cache, for a forward of T tokens.

    keys, values: (layers, Hkv, S, D) float16, the cache's storage, written in place at slots [write_slot,
    write_slot + T); view_starts: each layer's first slot read, by its index in the storage; origin: the position of
    a view's first slot (KVCache.origin); windowed: whether the layers' sliding windows apply (views of consecutive
    positions); segment: cache_attention's keys per segment (kernels.attention.segment_keys); keep_queries: whether to
    return the layers' queries."""

    keys: torch.Tensor
    values: torch.Tensor
    write_slot: int
    view_starts: list[int]
    origin: int
    windowed: bool
    segment: int
    keep_queries: bool


def cached_layers(
    stack: torch.ScriptObject, x: torch.Tensor, rotation: torch.Tensor, write: StackWrite
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of stack in turn in one call, each as cached_layer computes it (the same bits, the same cache
    writes), so that a step crosses into the extension once rather than once a layer.

    Args:
        x: (T, C) float32, the first layer's input.
        rotation: (T, 2, 2, D/2) float32, the tokens' rotations.
        write: the cache's storage and slots.
    Returns:
        The last layer's output (T, C), and with write.keep_queries each layer's queries (Hq, T, D) in the stack's
        order.
    """
    with plain_call():
        return torch.ops.triforce_cpu.cached_layers(stack, x, rotation, *write)


def output_head(
    norm_weight: torch.Tensor, eps: float, projection: Projection, output_ids: torch.Tensor | None, vocab_size: int
) -> torch.ScriptObject:
    """A model's output layer for output_logits: its final RMSNorm (norm_weight (C,) float32, eps), its projection,
    and where that computes some tokens' logits only, their ids (V',) int64; vocab_size: V."""
    return torch.classes.triforce_cpu.OutputHead(
        norm_weight, eps, projection.operands, projection.features, output_ids, vocab_size
    )


def output_logits(head: torch.ScriptObject, x: torch.Tensor) -> torch.Tensor:
    """The logits (T, V) float32 of the last hidden states x (T, C): head's RMSNorm, its projection, -inf for every
    token it does not compute; the bits of rms_norm, the projection's product and an index_copy_ into -inf, in one
    call."""
    with plain_call():
        return torch.ops.triforce_cpu.output_logits(head, x)


def cached_step(
    stack: torch.ScriptObject,
    embedding: list[torch.Tensor | None],
    head: torch.ScriptObject,
    ids: torch.Tensor,
    rotation: torch.Tensor,
    write: StackWrite,
    num_logits: int,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An eager step from token ids to logits in one call: the embedding's rows of ids (T,), cached_layers over
    them, output_logits of the last num_logits rows; the same bits as the three.

    Args:
        embedding: the token table as three operands: GGUF blocks (q, d, m or None), tiles (N/16, C, 16) float32 or
            float16 with None, None (a tied output layer's), or a float32 table (V, C) with None, None.
        head: output_head's.
        rotation, write: cached_layers'.
    Returns:
        The logits (num_logits, V) float32, and with write.keep_queries each layer's queries (Hq, T, D).
    """
    with plain_call():
        return torch.ops.triforce_cpu.cached_step(stack, embedding, head, ids, rotation, *write, num_logits)


def register_fake_kernels() -> None:
    """Shapes and allocations of the step ops on fake tensors (torch's FakeTensorMode, as the memory tests use it):
    each allocates its outputs and, for the two halves, the intermediates csrc/step_ops.cpp holds, at the same time
    as it holds them. Called once the extension is loaded (kernels.native.load_native)."""
    lib = torch.library

    @lib.register_fake("triforce_cpu::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @lib.register_fake("triforce_cpu::silu_mul")
    def _(gate_up):
        return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))

    @lib.register_fake("triforce_cpu::rotary_heads")
    def _(qkv, rotation, heads, rotated, q_heads, q_norm, k_norm, eps):
        return qkv.new_empty((heads, qkv.shape[0], qkv.shape[1] // heads))

    def fake_attention_input(x, qkv_features, q_heads, kv_heads):
        rows, width = x.shape[0], sum(qkv_features)
        normed = torch.empty_like(x)
        projected = x.new_empty((rows, width))  # (T, (Hq + 2 Hkv) D), beside the normed rows
        del normed
        dim = width // (q_heads + 2 * kv_heads)
        heads = [x.new_empty((count, rows, dim)) for count in (q_heads, kv_heads, kv_heads)]
        del projected
        return tuple(heads)

    def fake_layer_output(x, attended, gate_up_features):
        rows = x.shape[0]
        heads = x.new_empty((rows, attended.shape[0] * attended.shape[2]))
        mixed = torch.empty_like(x)
        del heads
        normed = torch.empty_like(x)
        gates = x.new_empty((rows, sum(gate_up_features)))
        del normed
        activated = x.new_empty((rows, sum(gate_up_features) // 2))
        del gates
        out = torch.empty_like(x)
        del activated, mixed
        return out

    @lib.register_fake("triforce_cpu::attention_input")
    def _(x, norm_weight, eps, qkv, qkv_features, rotation, q_heads, kv_heads, q_norm, k_norm):
        return fake_attention_input(x, qkv_features, q_heads, kv_heads)

    @lib.register_fake("triforce_cpu::layer_output")
    def _(x, attended, o_proj, o_features, norm_weight, eps, gate_up, gate_up_features, down, down_features):
        return fake_layer_output(x, attended, gate_up_features)

    @lib.register_fake("triforce_cpu::cached_layer")
    def _(
        x, norm_weight, eps, qkv, qkv_features, rotation, q_heads, kv_heads, q_norm, k_norm, keys, values, layer,
        write_slot, view_start, scale, origin, window, segment, o_proj, o_features, post_norm, post_eps, gate_up,
        gate_up_features, down, down_features,
    ):  # fmt: skip
        heads = fake_attention_input(x, qkv_features, q_heads, kv_heads)  # queries, keys, values
        attended = heads[0].new_empty(heads[0].shape)  # cache_attention's output, while the heads live
        out = fake_layer_output(x, attended, gate_up_features)
        return out, heads[0]
