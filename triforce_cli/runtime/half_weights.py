"""Half weights: every weight matrix rounded to float16 and read as such, all arithmetic in float32.

A decode step on the CPU reads every weight once, so float16 weights halve most of its bytes; fbgemm's GEMM
widens them to float32 as it reads them (kernels.linear). The norms stay float32. The embedding table is
rounded too, so that a tied output layer and the input embedding hold the same values and the transformers
peers of `triforce bench` can run on exactly these weights (round_to_half).
"""

import torch
from torch import nn

from triforce_cli.kernels import half_weight_linear, pack_half_weight, unpack_half_weight


class HalfLinear(nn.Module):
    """A linear whose weight (and bias) live packed for half_weight_linear. x (T, K) float32 -> (T, N)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_half_weight(linear.weight, linear.bias)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed float16 weight (and float32 bias), which are no parameter of the module."""
        bias = self.out_features * 4 if unpack_half_weight(self.packed)[1] is not None else 0
        return self.in_features * self.out_features * 2 + bias

    @property
    def weight(self) -> torch.Tensor:
        """The float32 (N, K) weight, with the float16-rounded values this layer computes with."""
        return unpack_half_weight(self.packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return half_weight_linear(x, self.packed)


@torch.no_grad()
def round_to_half(model: nn.Module) -> None:
    """Round every linear and embedding weight of a float32 model to float16 values, in place."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.copy_(module.weight.half())


def use_half_weights(model: nn.Module) -> int:
    """Round the embeddings and replace every linear by a HalfLinear; return how many were replaced."""
    round_to_half(model)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in linears:
        model.set_submodule(name, HalfLinear(module))
    return len(linears)
