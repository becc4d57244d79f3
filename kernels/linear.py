"""Linear layers for the few rows of a decode or verification step on the CPU.

For x (T, K) with a handful of rows, torch's CPU `linear` runs a matrix-vector product (T = 1) or a small-M GEMM
that reads the weight (N, K) well below the memory bandwidth. Computing the transposed product weight @ x.T
(N, T), with at least two columns, streams the weight at close to full speed: several times faster for 2 or 3
rows, and faster for 1 row padded to 2 (see docs/performance.md).

Half weights: fbgemm's float16 GEMM (torch's `quantized::linear_dynamic_fp16`) keeps the weight as float16,
widens it to float32 as it reads it and accumulates in float32, so only the weights' rounding to float16 differs
from a float32 product. It reads half the bytes, and takes less than half the float32 products' time, for a few
rows as for hundreds (see docs/performance.md).
"""

import torch
import torch.nn.functional as F

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
    """Whether this torch build has the fbgemm backend that half_weight_linear needs (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_half_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """weight (N, K) rounded to float16 and packed for half_weight_linear; the bias stays float32."""
    return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), bias)


def unpack_half_weight(packed: torch.ScriptObject) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 weight (N, K), with float16-rounded values, and the bias of a packed weight."""
    return torch.ops.quantized.linear_unpack_fp16(packed)


def half_weight_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight.half().float(), bias)


def half_weight_linear(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """x (T, K) float32 -> (T, N): the product with a packed float16 weight, accumulated in float32."""
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)
