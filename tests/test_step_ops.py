"""The CPU step ops (kernels.step, csrc/step_ops.cpp): RMSNorm, RoPE, SiLU(gate) * up and a decoder layer's two
halves in one call each.

Each body the CPU can run must give torch's result to float32 rounding, and a row's result must be the same bits
in a batch of any size, wherever the batch starts, on 1 thread or 2 (the numeric contract, issue 46). A model with
tiled or GGUF linears on the CPU runs its eager forwards through them, with a handful of dispatches per layer.
"""

from collections import Counter

import pytest
import torch
from helpers import ROWS, assert_rows_alone, make_model, tiled
from test_gguf_weights import K_QUANT_SHAPES, gguf_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache
from triforce_cli.cache.base import SlotCache
from triforce_cli.kernels import pack_tiles, pad_bias
from triforce_cli.kernels.gguf import LANES, PackedBlocks
from triforce_cli.kernels.linear import tiled_linear
from triforce_cli.kernels.step import (
    Projection,
    attention_input,
    layer_output,
    output_logits,
    rms_norm,
    rms_norm_reference,
    rotary_heads,
    rotary_heads_reference,
    silu_mul,
    silu_mul_reference,
)

from triforce_cli.runtime.half_weights import use_half_weights
from triforce_cli.runtime.model import DecoderLayer, ModuleChanges, Transformer
from triforce_cli.runtime.native import kernel_error

KERNEL_ERROR = kernel_error()

pytestmark = pytest.mark.skipif(KERNEL_ERROR is not None, reason=f"no CPU kernels here: {KERNEL_ERROR}")

EPS = 1e-5


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("hidden", [8, 20, 64, 100, 576])  # under a vector, tails of 16 and 8 lanes, whole vectors
def test_rms_norm_is_torchs_to_float32_rounding(body, hidden):
    x = torch.randn(7, hidden, generator=generator(hidden)) * 3
    weight = torch.randn(hidden, generator=generator(hidden + 1))
    torch.testing.assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("hidden", [20, 576])
def test_a_row_of_rms_norm_is_the_same_bits_in_any_batch(body, hidden):
    x = torch.randn(ROWS, hidden, generator=generator(hidden)) * 3
    weight = torch.randn(hidden, generator=generator(hidden + 1))
    assert_rows_alone(lambda rows: rms_norm(rows, weight, EPS), x, seed=hidden)


@pytest.mark.parametrize("width", [6, 26, 1536])  # gate and up of 3, 13 and 768: tails of 16 and 8 lanes
def test_the_gated_product_is_torchs_to_float32_rounding(body, width):
    gate_up = torch.randn(9, 2 * width, generator=generator(width)) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamped ends
    torch.testing.assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), rtol=2e-6, atol=1e-6)


def test_a_row_of_the_gated_product_is_the_same_bits_in_any_batch(body):
    gate_up = torch.randn(ROWS, 2 * 1000, generator=generator(3)) * 4
    assert_rows_alone(silu_mul, gate_up, seed=3)


ROTARY_SHAPES = [(15, 12, 9, 64), (8, 6, 4, 8), (4, 3, 2, 128)]  # (H, rotated, q heads, D)


@pytest.mark.parametrize(("heads", "rotated", "q_heads", "dim"), ROTARY_SHAPES)
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "qk-norm"])
def test_rotary_heads_are_the_models_rotation(body, heads, rotated, q_heads, dim, normed):
    g = generator(dim)
    qkv = torch.randn(11, heads * dim, generator=g)
    rotation = torch.randn(11, 2, 2, dim // 2, generator=g)
    norms = (torch.randn(dim, generator=g), torch.randn(dim, generator=g)) if normed else (None, None)
    out = rotary_heads(qkv, rotation, heads, rotated, q_heads, *norms, EPS)
    expected = rotary_heads_reference(qkv, rotation, heads, rotated, q_heads, *norms, EPS)
    assert out.shape == (heads, 11, dim) and out.is_contiguous()
    if normed:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, expected)  # two rounded products and their sum, as the model's rotate


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "qk-norm"])
def test_a_row_of_rotary_heads_is_the_same_bits_in_any_batch(body, normed):
    heads, rotated, q_heads, dim = ROTARY_SHAPES[0]
    g = generator(5)
    qkv = torch.randn(ROWS, heads * dim, generator=g)
    rotation = torch.randn(ROWS, 2, 2, dim // 2, generator=g)
    norms = (torch.randn(dim, generator=g), torch.randn(dim, generator=g)) if normed else (None, None)
    rows = torch.cat([qkv, rotation.flatten(1)], dim=1)  # one tensor, so that a batch is one slice of it

    def rotated_rows(batch: torch.Tensor) -> torch.Tensor:
        at = batch[:, : heads * dim], batch[:, heads * dim :].reshape(-1, 2, 2, dim // 2)
        return rotary_heads(*at, heads, rotated, q_heads, *norms, EPS).transpose(0, 1)  # (T, H, D)

    assert_rows_alone(rotated_rows, rows, seed=6)


def tiles_projection(out_features: int, in_features: int, seed: int, dtype=torch.float32, bias=False) -> Projection:
    g = generator(seed)
    tiles = pack_tiles(torch.randn(out_features, in_features, generator=g) / in_features**0.5, dtype)
    padded = pad_bias(torch.randn(out_features, generator=g) if bias else None, tiles)
    return Projection([tiles, None, padded], [out_features])


def blocks_projection(out_features: int, in_features: int, seed: int) -> Projection:
    """Random 4-bit blocks with minimums (as Q4_1 holds them): out_features a multiple of 16."""
    g = generator(seed)
    tiles, blocks = out_features // LANES, in_features // 32
    q = torch.randint(0, 256, (tiles, blocks, 256), generator=g, dtype=torch.uint8)
    d = torch.rand(tiles, blocks, LANES, generator=g) * 0.02
    records = torch.cat([q, d.view(torch.uint8), (-8 * d).view(torch.uint8)], dim=-1)
    return Projection(PackedBlocks(records, True, 1, True, out_features).operands(), [out_features])


def reference_projection(x: torch.Tensor, projection: Projection) -> torch.Tensor:
    """The parts' products by the extension's own ops (kernels.tiled_linear, the blocks_linear op)."""
    outs = []
    for part, features in enumerate(projection.features):
        first, second, third = projection.operands[3 * part : 3 * part + 3]
        if second is not None:  # GGUF blocks: views of their records
            outs.append(torch.ops.triforce_cpu.blocks_linear(x, first, second, third)[:, :features])
        else:
            outs.append(tiled_linear(x, first, third, features))
    return torch.cat(outs, dim=-1)


LAYER = {"hidden": 64, "q_heads": 4, "kv_heads": 2, "dim": 16, "intermediate": 96}


def layer_projections(kind: str) -> dict[str, Projection]:
    """A layer's projections: float32 tiles with biases; float16 tiles; GGUF blocks; or parts side by side (tiles
    whose features are no multiple of 16, and blocks)."""
    c, hq, hkv, d, i = (LAYER[key] for key in ("hidden", "q_heads", "kv_heads", "dim", "intermediate"))
    shapes = {"qkv": ((hq + 2 * hkv) * d, c), "o_proj": (c, hq * d), "gate_up": (2 * i, c), "down": (c, i)}
    projections = {}
    for seed, (name, (n, k)) in enumerate(shapes.items()):
        if kind == "float32":
            projections[name] = tiles_projection(n, k, seed, bias=True)
        elif kind == "float16":
            projections[name] = tiles_projection(n, k, seed, torch.float16)
        elif kind == "blocks":
            projections[name] = blocks_projection(n, k, seed)
        else:
            parts = [tiles_projection(n - 40, k, seed), blocks_projection(32, k, seed), tiles_projection(8, k, seed)]
            projections[name] = Projection.side_by_side(parts)
    return projections


def layer_inputs(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = generator(seed)
    x = torch.randn(rows, LAYER["hidden"], generator=g)
    rotation = torch.randn(rows, 2, 2, LAYER["dim"] // 2, generator=g)
    attended = torch.randn(LAYER["q_heads"], rows, LAYER["dim"], generator=g)
    return x, rotation, attended


def norm_weights(seed: int) -> tuple[torch.Tensor, ...]:
    g = generator(seed)
    return (
        torch.randn(LAYER["hidden"], generator=g),
        torch.randn(LAYER["dim"], generator=g),
        torch.randn(LAYER["dim"], generator=g),
    )


@pytest.mark.parametrize("kind", ["float32", "float16", "blocks", "parts"])
def test_a_layers_halves_are_their_ops_one_after_the_other(body, kind):
    """attention_input and layer_output compute what the ops they chain compute, bit for bit."""
    projections = layer_projections(kind)
    norm, q_norm, k_norm = norm_weights(1)
    x, rotation, attended = layer_inputs(9, seed=2)
    hq, hkv = LAYER["q_heads"], LAYER["kv_heads"]
    for norms in ((None, None), (q_norm, k_norm)):
        q, k, v = attention_input(x, norm, EPS, projections["qkv"], rotation, hq, hkv, *norms)
        projected = reference_projection(rms_norm(x, norm, EPS), projections["qkv"])
        heads = rotary_heads(projected, rotation, hq + 2 * hkv, hq + hkv, hq, *norms, EPS)
        assert torch.equal(torch.cat([q, k, v]), heads)
    out = layer_output(x, attended, projections["o_proj"], norm, EPS, projections["gate_up"], projections["down"])
    mixed = x + reference_projection(attended.transpose(0, 1).reshape(9, -1), projections["o_proj"])
    gated = silu_mul(reference_projection(rms_norm(mixed, norm, EPS), projections["gate_up"]))
    assert torch.equal(out, mixed + reference_projection(gated, projections["down"]))


@pytest.mark.parametrize("kind", ["float32", "blocks", "parts"])
def test_a_row_of_a_layers_halves_is_the_same_bits_in_any_batch(body, kind):
    projections = layer_projections(kind)
    norm, q_norm, k_norm = norm_weights(3)
    x, rotation, attended = layer_inputs(ROWS, seed=4)
    hq, hkv, d = LAYER["q_heads"], LAYER["kv_heads"], LAYER["dim"]
    c = x.shape[1]
    packed = torch.cat([x, rotation.flatten(1), attended.transpose(0, 1).flatten(1)], dim=1)  # (T, ...) one tensor

    def first_half(batch: torch.Tensor) -> torch.Tensor:
        at = batch[:, :c], batch[:, c : c + 2 * d].reshape(-1, 2, 2, d // 2)
        q, k, v = attention_input(at[0], norm, EPS, projections["qkv"], at[1], hq, hkv, q_norm, k_norm)
        return torch.cat([q, k, v]).transpose(0, 1)  # (T, H, D)

    def second_half(batch: torch.Tensor) -> torch.Tensor:
        heads = batch[:, c + 2 * d :].reshape(-1, hq, d).transpose(0, 1)  # (Hq, T, D)
        return layer_output(batch[:, :c], heads, projections["o_proj"], norm, EPS, projections["gate_up"],
                            projections["down"])  # fmt: skip

    assert_rows_alone(first_half, packed, seed=5)
    assert_rows_alone(second_half, packed, seed=6)


def test_a_wrong_input_is_one_clear_error():
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(7), EPS)
    with pytest.raises(RuntimeError, match="even"):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="rotation"):
        rotary_heads(torch.randn(2, 32), torch.randn(2, 2, 2, 3), 4, 2, 1)
    with pytest.raises(RuntimeError, match="three operands"):
        layer_output(torch.randn(1, 64), torch.randn(4, 1, 16), Projection([], [64]), torch.randn(64), EPS,
                     Projection([], [64]), Projection([], [64]))  # fmt: skip
    blocks = blocks_projection(64, 64, seed=1)
    without_scales = Projection([blocks.operands[0], None, blocks.operands[2]], [64])
    with pytest.raises(RuntimeError, match="GGUF blocks: q, d and m or None"):
        layer_output(torch.randn(1, 64), torch.randn(4, 1, 16), without_scales, torch.randn(64), EPS,
                     blocks, blocks)  # fmt: skip


class Dispatches(TorchDispatchMode):
    """Counts every op dispatched to torch (a custom op is one, whatever it calls inside)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def step_dispatches(num_layers: int, hook_layer: int | None = None) -> Counter:
    """The dispatches of one 1-token eager step of a tiny tiled model (a float32 model on the CPU as the loader
    builds it) after a 10-token prefill, on a float16 full cache; hook_layer: a layer given a forward pre-hook."""
    model = tiled(make_model(seed=4, num_layers=num_layers).loaded).model
    if hook_layer is not None:
        model.model.layers[hook_layer].register_forward_pre_hook(lambda module, args: None)
    cfg = model.config
    cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, torch.float16)
    tokens = torch.arange(11) % cfg.vocab_size
    with torch.inference_mode():
        model(tokens[:10], 0, cache)
        last = tokens[10:]
        with Dispatches() as counted:
            model(last, 10, cache)
    return counted.ops


def test_a_decode_step_makes_one_dispatch_from_ids_to_logits():
    """The embedding, every layer and the output layer in one call, cached_step, and no other op but the view of the
    step's rotation, where a layer in one call each (cached_layer) made one per layer, its halves, the cache's write
    and views and the attention 13, and torch's ops 38; a layer with a hook (a streamed layer's weights arrive in
    one) sends the step back to a call per layer."""
    two, four = step_dispatches(2), step_dispatches(4)
    assert four == two == Counter({"triforce_cpu.cached_step": 1, "aten.slice": 1})  # the rotation table's view
    hooked = step_dispatches(4, hook_layer=1)
    assert hooked["triforce_cpu.cached_step"] == 0 and hooked["triforce_cpu.cached_layer"] == 4


def test_a_hook_registered_after_a_step_in_one_call_sends_the_next_back_to_its_layer():
    """The one call's operands are kept from step to step (Transformer.one_call): a forward hook registered on a
    layer after a step in one call runs in the next step, which calls the layers one by one and gives the same
    logits; once the hook is removed, the step after is one call again."""
    model = tiled(make_model(seed=4, num_layers=3).loaded).model
    cfg = model.config
    cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 32, torch.float16)
    tokens = torch.arange(14) % cfg.vocab_size
    seen = []
    with torch.inference_mode():
        model(tokens[:10], 0, cache)
        with Dispatches() as one_call:
            expected = model(tokens[10:11], 10, cache)
        cache.rollback(10)
        handle = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(module))
        with Dispatches() as hooked:
            logits = model(tokens[10:11], 10, cache)
        handle.remove()
        with Dispatches() as again:
            model(tokens[11:12], 11, cache)
    assert one_call.ops["triforce_cpu.cached_step"] == 1 and seen == [model.model.layers[1]]
    assert hooked.ops["triforce_cpu.cached_step"] == 0 and hooked.ops["triforce_cpu.cached_layer"] == 3
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert again.ops["triforce_cpu.cached_step"] == 1 and len(seen) == 1


def test_the_step_ops_give_the_models_logits(monkeypatch):
    """A tiled model's forwards through the step ops and through torch's ops agree to float32 rounding; replacing a
    linear by one outside the extension's products sends its layer back to torch's ops."""
    model = tiled(make_model(seed=5, num_layers=2, tie_word_embeddings=False).loaded).model
    cfg = model.config
    tokens = torch.arange(40) % cfg.vocab_size

    def logits() -> torch.Tensor:
        cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 48, torch.float16)
        with torch.inference_mode():
            return torch.cat([model(tokens[:30], 0, cache, decoding=False), model(tokens[30:33], 30, cache),
                              model(tokens[33:34], 33, cache)])  # fmt: skip

    layer = model.model.layers[0]
    assert layer.step_operands() is not None
    fused = logits()
    with monkeypatch.context() as patched:
        patched.setattr(DecoderLayer, "step_operands", lambda self: None)
        ModuleChanges.note()  # a patched method is no change torch's registration hooks see
        with Dispatches() as calls:
            torch.testing.assert_close(fused, logits(), rtol=1e-5, atol=1e-5)
        assert calls.ops["triforce_cpu.cached_step"] == calls.ops["triforce_cpu.cached_layer"] == 0
    ModuleChanges.note()
    with Dispatches() as calls:
        assert torch.equal(logits(), fused)
    assert calls.ops["triforce_cpu.cached_step"] == 3  # one a forward, the operands read once
    layer.mlp.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
    assert layer.step_operands() is None and model.model.layers[1].step_operands() is not None
    with Dispatches() as calls:  # the assignment is seen: no layer runs the one call with the old operands
        assert not torch.allclose(logits(), fused)
    assert calls.ops["triforce_cpu.cached_step"] == calls.ops["triforce_cpu.cached_layers"] == 0
    assert calls.ops["triforce_cpu.cached_layer"] == 3


PATHS = ("one call", "layers in one call", "a call per layer", "through update")


def cache_writes(model, path: str, monkeypatch) -> tuple[list[torch.Tensor], Counter]:
    """Every output of a script of forwards over a full, a retrieval and a StreamingLLM cache (prefill chunks,
    verifications, rollbacks, single steps, the StreamingLLM window evicting), then each cache's keys and values
    and the full cache's kept queries, and the dispatches made. path, one of PATHS: from ids to logits in one call
    (cached_step); the layers in one call between the embedding's and the output layer's own (cached_layers); a call
    per layer (cached_layer over KVCache.eager_write); every layer writing through the cache's update() (no
    KVCache.eager_write), as the layer's three calls around it do."""
    cfg = model.config
    with monkeypatch.context() as patched, Dispatches() as calls:
        if path != "one call":
            patched.setattr(Transformer, "step_embedding", lambda self: None)
        if path == "a call per layer":
            patched.setattr(Transformer, "stacked_layers", lambda self, x, step: None)
        if path == "through update":
            patched.setattr(FullCache, "eager_write", lambda self: None)
            patched.setattr(SlotCache, "eager_write", lambda self: None)
        ModuleChanges.note()  # a patched method is no change torch's registration hooks see
        full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float16)
        streaming = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 8, 4, torch.float16)
        tokens = torch.arange(60) * 7 % cfg.vocab_size
        outputs = []
        with torch.inference_mode():
            outputs.append(model(tokens[:36], 0, full, decoding=False))
            outputs.append(model(tokens[36:39], 36, full))
            full.rollback(37)
            outputs.append(model(tokens[37:38], 37, full))
            retrieval = RetrievalCache(full, 16, 4, 8)
            retrieval.select_chunks()
            outputs.append(model(tokens[38:41], 38, retrieval))
            retrieval.rollback(39)
            outputs.append(model(tokens[39:40], 39, retrieval))
            for start in range(0, 24, 4):
                outputs.append(model(tokens[start : start + 4], start, streaming))
            streaming.rollback(22)
            outputs.append(model(tokens[22:23], 22, streaming, num_logits=1))
    ModuleChanges.note()
    caches = (full, retrieval, streaming)
    return outputs + [cache.keys for cache in caches] + [cache.values for cache in caches] + full.queries, calls.ops


def assert_every_path_writes_the_same_bits(model, monkeypatch) -> None:
    """cache_writes' outputs and caches are the same bits on every path of PATHS, each path the one it names."""
    writes = {path: cache_writes(model, path, monkeypatch) for path in PATHS}
    ops = {path: calls for path, (_, calls) in writes.items()}
    assert ops["one call"]["triforce_cpu.cached_step"] > 0 and ops["one call"]["triforce_cpu.cached_layers"] == 0
    assert ops["layers in one call"]["triforce_cpu.cached_layers"] > 0
    assert ops["layers in one call"]["triforce_cpu.cached_step"] == 0
    assert ops["a call per layer"]["triforce_cpu.cached_layer"] > 0
    assert ops["a call per layer"]["triforce_cpu.cached_layers"] == 0
    updates = ops["through update"]
    assert updates["triforce_cpu.cached_layer"] == updates["triforce_cpu.cached_layers"] == 0
    reference, _ = writes["through update"]
    for path in PATHS[:-1]:
        for new, old in zip(writes[path][0], reference, strict=True):
            assert torch.equal(new, old), path


@pytest.mark.parametrize("weights", ["float32", "half"])
def test_a_layer_in_one_call_writes_what_the_caches_update_writes(monkeypatch, weights, body):
    """A model of float32 or float16 tiles runs each step from ids to logits in one call (cached_step), its layers
    on rows allocated once a step, the products straight into them; or its layers in one call (cached_layers), or in
    one call each (cached_layer over KVCache.eager_write): the same logits, and the same bits in the full, retrieval
    and StreamingLLM caches and the full cache's queries, as the layer's three calls around the caches' update(), in
    every kernel body; an untied float32 embedding (a plain table) and a tied one (the output layer's tiles)."""
    tiny = make_model(seed=6, num_layers=2, tie_word_embeddings=weights == "half")
    if weights == "half":
        use_half_weights(tiny.model)
    model = tiled(tiny.loaded).model
    assert_every_path_writes_the_same_bits(model, monkeypatch)
    assert model._stack.direct_layers() == model.config.num_layers


@pytest.mark.parametrize("shapes", [{}, K_QUANT_SHAPES], ids=["classic", "k-quants"])
def test_layers_on_rows_write_what_a_call_per_layer_writes(monkeypatch, shapes, body):
    """A model of GGUF blocks runs every layer on rows allocated once a step (the products and the attention
    straight into them, keys and values rounded straight into the cache), from ids to logits in one call: the same
    logits and the same bits in the full, retrieval and StreamingLLM caches and the kept queries as its layers in one
    call, a call per layer and the layer's three calls around the caches' update(), over prefill chunks,
    verifications, rollbacks and eviction, in every kernel body."""
    _, _, packed = gguf_tiny_model(7, num_layers=3, **shapes)
    model = packed.model
    assert_every_path_writes_the_same_bits(model, monkeypatch)
    assert model._stack.direct_layers() == model.config.num_layers


@pytest.mark.parametrize("table", ["float32", "float32 tied", "half tied", "gguf", "gguf tied"])
def test_the_one_calls_embedding_rows_are_the_modules(table):
    """A step's embedding looked up in the extension (kernels.step.cached_step's embedding_rows): the module's rows,
    the same bits, for a float32 table, a tied output layer's float32 or float16 tiles and GGUF blocks; an id outside
    the table is one clear error."""
    if table.startswith("gguf"):
        model = gguf_tiny_model(12, tie=table.endswith("tied"), vocab_size=48)[2].model
    else:
        tiny = make_model(seed=12, vocab_size=48, tie_word_embeddings=table.endswith("tied"))
        if table.startswith("half"):
            use_half_weights(tiny.model)
        model = tiled(tiny.loaded).model
    ids = torch.tensor([47, 0, 16, 15, 31, 5])
    operands = model.step_embedding()
    assert torch.equal(torch.ops.triforce_cpu.embedding_rows(operands, ids), model.model.embed_tokens(ids))
    with pytest.raises(RuntimeError, match="ids: rows 0 to 4[78] of the"):
        torch.ops.triforce_cpu.embedding_rows(operands, torch.tensor([3, 48 if "gguf" in table else 64]))


def module_logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    """The logits of the last hidden states x as the output layer's modules compute them (Transformer.output without
    output_logits): the final norm, the output projection, the logits spread over the vocabulary."""
    logits = model.lm_head(model.final_norm(x)).float()
    if model.output_ids is None:
        return logits
    full = logits.new_full((logits.shape[0], model.config.vocab_size), float("-inf"))
    return full.index_copy_(1, model.output_ids, logits)


RESTRICTED = torch.tensor([40, 3, 17, 0, 33, 8, 21, 47, 12, 5, 29, 44, 1, 36, 25, 10])  # 16 of 48 tokens


def output_model(weights: str, restricted: bool = False) -> Transformer:
    """A tiny model of 48 tokens as the loader builds it with float32 or float16 tiles or GGUF blocks; restricted:
    its output restricted to RESTRICTED first, as a drafter's is (restrict_output)."""
    if weights == "gguf":
        return gguf_tiny_model(8, vocab_size=48)[2].model
    tiny = make_model(seed=8, vocab_size=48, tie_word_embeddings=False)
    if restricted:
        tiny.model.restrict_output(RESTRICTED)
    if weights == "half":
        use_half_weights(tiny.model)
    return tiled(tiny.loaded).model


@pytest.mark.parametrize(
    ("weights", "restricted"), [("float32", False), ("half", False), ("gguf", False), ("float32", True), ("half", True)]
)
def test_the_output_layer_in_one_call_gives_its_modules_bits(weights, restricted, body):
    """The final norm, the output projection and the spreading of a restricted output over the vocabulary in one
    call (output_logits): the modules' bits for float32 and float16 tiles and GGUF blocks, in one dispatch; with
    autograd on, the modules compute (to float32 rounding)."""
    model = output_model(weights, restricted)
    x = torch.randn(5, model.config.hidden_size, generator=generator(9)) * 2
    with torch.inference_mode():
        model.output(x)  # reads the head (GGUF blocks' views)
        with Dispatches() as calls:
            logits = model.output(x)
        assert calls.ops["triforce_cpu.output_logits"] == 1 and sum(calls.ops.values()) == 1
        assert torch.equal(logits, module_logits(model, x))
    assert logits.isinf().sum() == (5 * (48 - 16) if restricted else 0)
    with torch.enable_grad(), Dispatches() as calls:  # the tiles' autograd path: torch's product
        torch.testing.assert_close(model.output(x), logits, rtol=1e-5, atol=1e-5)
    assert calls.ops["triforce_cpu.output_logits"] == 0


class Watched(torch.Tensor):
    """A tensor subclass that counts the calls of its __torch_function__."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_ops_taking_a_head_or_stack_leave_torch_function_alone():
    """The output layer's one call runs with __torch_function__ off for tensor subclasses (kernels.step.plain_call),
    which keeps torch from probing the head's ScriptObject for that attribute on every call: a subclass argument's
    override is not consulted, and the logits are the plain tensor's bits."""
    model = output_model("half")
    x = torch.randn(3, model.config.hidden_size, generator=generator(11))
    with torch.inference_mode():
        head = model.step_head()
        plain = output_logits(head, x)
        Watched.calls = 0
        watched = output_logits(head, x.as_subclass(Watched))
        consulted = Watched.calls
    assert consulted == 0
    assert torch.equal(watched.as_subclass(torch.Tensor), plain)


def test_an_output_layer_replaced_is_read_anew():
    """restrict_output on a tiled model replaces its output layer by one outside the extension's products: the next
    output is the new layer's, through its modules."""
    model = output_model("float32")
    x = torch.randn(2, model.config.hidden_size, generator=generator(10))
    with torch.inference_mode():
        full = model.output(x)
        model.restrict_output(RESTRICTED)
        with Dispatches() as calls:
            restricted = model.output(x)
    assert calls.ops["triforce_cpu.output_logits"] == 0 and restricted.isinf().sum() == 2 * (48 - 16)
    torch.testing.assert_close(restricted[:, RESTRICTED], full[:, RESTRICTED], rtol=1e-5, atol=1e-5)


def test_an_output_layer_of_padded_tiles_spreads_its_outputs():
    """An output projection whose rows are no multiple of a tile's 16 (its tiles padded) in one call: the
    product's op and the spreading give the modules' bits."""
    tiny = make_model(seed=10, vocab_size=40, tie_word_embeddings=False)
    tiny.model.restrict_output(torch.arange(39, 0, -2))  # 20 tokens: two tiles, the second one's last 12 rows padding
    model = tiled(tiny.loaded).model
    x = torch.randn(3, model.config.hidden_size, generator=generator(11))
    with torch.inference_mode():
        assert not model.step_head().direct()
        assert torch.equal(model.output(x), module_logits(model, x))
