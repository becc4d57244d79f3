"""Half weights: every weight matrix rounded to float16 and read as such, all arithmetic in float32.

A decode step on the CPU reads every weight once, so float16 weights halve most of its bytes; the tiled product
widens them to float32 as it reads them (tiled_weights.py, kernels.tiled_linear). The norms stay float32. The
embedding table is rounded too, so that a tied output layer and the input embedding hold the same values and the
transformers peers of `triforce bench` can run on exactly these weights (round_to_half).
"""

import torch
from torch import nn

from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.tiled_weights import TiledLinear, use_tiled_weights


class HalfLinear(TiledLinear):
    """A linear whose weight lives in float16 tiles, its bias float32. x (..., K) float32 -> (..., N)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, torch.float16)


@torch.no_grad()
def round_to_half(model: nn.Module) -> None:
    """Round every linear and embedding weight of a float32 model to float16 values, in place."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.copy_(module.weight.half())


def use_half_weights(model: Transformer) -> int:
    """Round the embeddings and replace every linear by a HalfLinear (a tied embedding then reads the output
    layer's tiles: tiled_weights.use_tiled_weights); return how many linears were replaced."""
    round_to_half(model)
    return use_tiled_weights(model, HalfLinear)
