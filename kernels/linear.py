"""Linear layers on the CPU: the tiled product of float32 models, and torch's products elsewhere.

Tiled weights (tiled_linear): a float32 model's weights on the CPU are laid out once, at load, in tiles of 16 output
rows, float32 or float16 (half weights: widened to float32 as they are read, accumulated in float32, so only the
weights' rounding to float16 differs from a float32 product, for half the bytes). The CPU extension computes each
output along k in one fixed order, so a row's outputs are the same bits in a decode step, a verification and a
prefill chunk, on any number of threads; torch's products (MKL's GEMM, fbgemm's) pick their blocking, and with it
the order of the sums, by the number of rows. It streams the weights as fast as the transposed product below for a
few rows and reaches a fraction of MKL's GEMM for a prefill chunk (docs/performance.md).

Untiled weights (linear): for x (T, K) with a handful of rows, torch's CPU `linear` runs a matrix-vector product
(T = 1) or a small-M GEMM that reads the weight (N, K) well below the memory bandwidth. Computing the transposed
product weight @ x.T (N, T), with at least two columns, streams the weight at close to full speed: several times
faster for 2 or 3 rows, and faster for 1 row padded to 2 (see docs/performance.md). Models whose linears are not
tiled (another dtype, CUDA, training, no CPU extension) take it.
"""

import torch
import torch.nn.functional as F

LANES = 16  # output rows in a tile of tiled_linear's weights
FEW_ROWS = 8  # up to this many rows the transposed product is the faster one (measured up to 8; docs/performance.md)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T + bias, as (weight @ x.T).T; one row is padded to two."""
    rows = x.shape[0]
    columns = x.t() if rows > 1 else torch.cat((x, x)).t()  # (K, max(T, 2))
    out = torch.mm(weight, columns)[:, :rows].t().contiguous()  # (T, N)
    return out if bias is None else out + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) -> (..., N): the few-row product on the CPU for 2-D inputs of at most FEW_ROWS rows."""
    if x.dim() == 2 and x.shape[0] <= FEW_ROWS and not x.is_cuda and not torch.is_grad_enabled():
        return few_row_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def half_weights_available() -> bool:
    """Whether half weights run here: an x86 torch build (fbgemm's presence marks one), whose CPU extension computes
    them (tiled_linear)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def tiled_linear_available() -> bool:
    """Whether the CPU extension, with its tiled product, is loaded (kernels.native.load_native)."""
    return hasattr(torch.ops.triforce_cpu, "dense_linear")


def pack_tiles(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight (N, K) as tiled_linear reads it: (ceil(N/16), K, 16) in dtype (float32, or float16: rounded), the rows
    of each tile of 16 last, the rows past N zeros."""
    rows = weight.shape[0]
    padded = F.pad(weight.detach().to(dtype), (0, 0, 0, -rows % LANES))  # (N/16 * 16, K)
    return padded.view(-1, LANES, weight.shape[1]).transpose(1, 2).contiguous()  # (N/16, K, 16)


def unpack_tiles(tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """The float32 weight (N, K) that tiles (N/16, K, 16) hold: pack_tiles' inverse, up to its rounding."""
    return tiles.float().transpose(1, 2).reshape(-1, tiles.shape[1])[:out_features]


def pad_bias(bias: torch.Tensor | None, tiles: torch.Tensor) -> torch.Tensor | None:
    """A float32 bias (N,) padded with zeros to the tiles' N/16 * 16 rows, as tiled_linear takes it."""
    if bias is None:
        return None
    return F.pad(bias.detach().float(), (0, tiles.shape[0] * LANES - bias.shape[0]))


def tiled_linear_reference(
    x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    return F.linear(x, unpack_tiles(tiles, out_features), None if bias is None else bias[:out_features])


def tiled_linear(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x (T, K) float32 -> x @ W.T + bias (T, N) for the weight W (N, K) that tiles (N/16, K, 16) hold (pack_tiles),
    every output the sum along k of one chain of multiply-adds, the bias added last: the same bits for a row whatever
    rows come with it and however many threads run (csrc/dense_linear.cpp).

    Args:
        x: (T, K) float32 on the CPU.
        tiles: (N/16, K, 16) float32 or float16, from pack_tiles.
        bias: (N/16 * 16,) float32, from pad_bias, or None.
        out_features: N.
    Returns:
        (T, N) float32; a view of the first N columns where N is no multiple of 16.
    """
    out = torch.ops.triforce_cpu.dense_linear(x, tiles, bias)  # (T, N/16 * 16)
    return out if out.shape[1] == out_features else out[:, :out_features]
