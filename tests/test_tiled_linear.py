"""The tiled product (kernels.tiled_linear) and the row-wise ops of the CPU forward compute each row's result in one
order of arithmetic: row i of a batch of n is the same bits as row i alone, whatever n, where the batch starts and
how many threads run (issue 46's numeric contract); and the tiled product is a float32 product of the weights."""

import pytest
import torch
import torch.nn.functional as F
from helpers import ROWS, assert_rows_alone, load_tiny, make_model
from torch import nn
from triforce_cli.kernels import (
    linear_reference,
    pack_tiles,
    pad_bias,
    tiled_linear,
    tiled_linear_reference,
    unpack_tiles,
)

from triforce_cli.runtime.half_weights import HalfLinear
from triforce_cli.runtime.loading import BuildOptions
from triforce_cli.runtime.model import RMSNorm, rotate
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.tiled_weights import TiledLinear

needs_kernels = pytest.mark.skipif(kernel_error() is not None, reason=str(kernel_error()))


def weight_and_bias(out_features: int, in_features: int, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    return weight, torch.randn(out_features, generator=g) if with_bias else None


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_a_row_of_the_tiled_product_is_the_same_bits_in_any_batch(body, dtype, with_bias):
    """40 outputs: two whole tiles and a part; 200 inputs: the k loop crosses a panel's depth."""
    weight, bias = weight_and_bias(40, 200, with_bias, seed=3)
    tiles = pack_tiles(weight, dtype)
    padded = pad_bias(bias, tiles)
    x = torch.randn(ROWS, 200, generator=torch.Generator().manual_seed(4))
    assert_rows_alone(lambda rows: tiled_linear(rows, tiles, padded, 40), x, seed=5)


@needs_kernels
def test_every_body_gives_the_same_bits(body):
    """One order of arithmetic for every body: each equals the plain C++ one (every step one rounding)."""
    weight, bias = weight_and_bias(72, 150, True, seed=6)
    x = torch.randn(20, 150, generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float32, torch.float16):
        tiles, padded = pack_tiles(weight, dtype), pad_bias(bias, pack_tiles(weight, dtype))
        out = tiled_linear(x, tiles, padded, 72)
        torch.ops.triforce_cpu.use_isa("scalar")
        try:
            assert torch.equal(out, tiled_linear(x, tiles, padded, 72)), dtype
        finally:
            torch.ops.triforce_cpu.use_isa(body)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 64, 257])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_the_tiled_product_is_a_float32_product(body, rows, with_bias):
    weight, bias = weight_and_bias(100, 300, with_bias, seed=rows)
    x = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows + 1))
    expected = linear_reference(x, weight, bias)
    tiles = pack_tiles(weight, torch.float32)
    out = tiled_linear(x, tiles, pad_bias(bias, tiles), 100)
    assert out.shape == (rows, 100) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    half = pack_tiles(weight, torch.float16)
    out = tiled_linear(x, half, pad_bias(bias, half), 100)
    torch.testing.assert_close(out, tiled_linear_reference(x, half, pad_bias(bias, half), 100), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, expected, atol=1e-5, rtol=1e-5)  # the weights were rounded to float16


def test_tiles_hold_the_weight():
    weight = torch.randn(37, 5)
    tiles = pack_tiles(weight, torch.float32)
    assert tiles.shape == (3, 5, 16) and torch.equal(tiles[2, :, 5:], torch.zeros(5, 11))  # rows past N are zeros
    assert torch.equal(unpack_tiles(tiles, 37), weight)
    assert torch.equal(unpack_tiles(pack_tiles(weight, torch.float16), 37), weight.half().float())
    assert torch.equal(pad_bias(torch.ones(37), tiles), torch.cat([torch.ones(37), torch.zeros(11)]))


@needs_kernels
@pytest.mark.parametrize("tiled", [TiledLinear, HalfLinear])
def test_a_tiled_linear_computes_with_torch_where_autograd_records(tiled):
    linear = nn.Linear(24, 20)
    module = tiled(linear)
    x = torch.randn(3, 2, 24)
    with torch.no_grad():
        out = module(x)
    assert out.shape == (3, 2, 20)
    expected = F.linear(x, module.weight, linear.bias)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(module(x), expected)  # with grad enabled: torch's product of the same values


@needs_kernels
def test_a_float32_model_on_the_cpu_is_loaded_with_tiled_linears():
    tiny = make_model(seed=8, tie_word_embeddings=False)
    loaded = load_tiny(tiny, BuildOptions(torch.device("cpu")))
    dense = {name: m for name, m in tiny.model.named_modules() if isinstance(m, nn.Linear)}
    modules = dict(loaded.model.named_modules())
    assert len(dense) == 4 * 2 + 1  # fused qkv, o, fused gate-up, down; lm_head
    for name, linear in dense.items():
        assert type(modules[name]) is TiledLinear and torch.equal(modules[name].weight, linear.weight), name
    bfloat16 = load_tiny(tiny, BuildOptions(torch.device("cpu"), torch.bfloat16))  # the GPU proxy keeps its dtype
    assert not any(isinstance(m, TiledLinear) for m in bfloat16.model.modules())


# --- the row-wise ops of the forward ------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_a_row_of_rms_norm_is_the_same_bits_in_any_batch(hidden):
    """F.rms_norm reduces each row alone below torch's reduction grain (32768 elements), past which two threads
    may split a single row's sum."""
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(ROWS, hidden, generator=torch.Generator().manual_seed(hidden)) * 3
    with torch.inference_mode():
        assert_rows_alone(norm, x, seed=hidden)


@pytest.mark.parametrize("heads, head_dim", [(9, 64), (3, 128)])
def test_a_row_of_the_rotary_rotation_is_the_same_bits_in_any_batch(heads, head_dim):
    """Rows of rotate's input: positions; the query and key heads are a view of the fused projection's output."""
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(ROWS, heads + 2, head_dim, generator=g)  # (T, H + Hv, D), as Attention reads it
    rotation = torch.randn(ROWS, 2, 2, head_dim // 2, generator=g)
    rows = torch.cat([qkv.flatten(1), rotation.flatten(1)], dim=1)  # one tensor, so that a batch is one slice of it

    def rotate_rows(batch: torch.Tensor) -> torch.Tensor:
        heads_of = batch[:, : qkv[0].numel()].view(-1, heads + 2, head_dim).transpose(0, 1)[:heads]  # (H, T, D)
        return rotate(heads_of, batch[:, qkv[0].numel() :].view(-1, 2, 2, head_dim // 2)).transpose(0, 1)

    with torch.inference_mode():
        assert_rows_alone(rotate_rows, rows, seed=heads)


def test_a_row_of_the_gated_product_and_the_residual_is_the_same_bits_in_any_batch():
    """The MLP's silu(gate) * up of the fused gate-up output, and a residual sum."""
    width = 1536
    rows = torch.randn(ROWS, 3 * width, generator=torch.Generator().manual_seed(9))  # gate, up, residual

    def gated(batch: torch.Tensor) -> torch.Tensor:
        gate, up = batch[:, : 2 * width].chunk(2, dim=-1)
        return F.silu(gate) * up + batch[:, 2 * width :]

    with torch.inference_mode():
        assert_rows_alone(gated, rows, seed=10)
