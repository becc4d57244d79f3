"""Tiled weights: the linears of a float32 model on the CPU computed from weights laid out once in tiles of 16
output rows (kernels.tiled_linear), float32 or float16, in one order of arithmetic per output element.

A row's outputs are then the same bits whatever rows come with it (a 1-token decode step, a verification of a few
drafts, a 256-row prefill chunk) and however many threads run: the keys, values and logits of a position do not
depend on how it was computed. torch's products pick their blocking, and with it the order of the sums, by the
number of rows. The layout is made at load (loading.transform_model), as the model's weight form is; the modules
compute with torch's product wherever the kernel does not apply (autograd, another device or dtype), from the
same values.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from triforce_cli.kernels import pack_tiles, pad_bias, tiled_linear, tiled_linear_available, unpack_tiles
from triforce_cli.kernels.linear import LANES
from triforce_cli.kernels.step import Projection
from triforce_cli.runtime.model import ModuleChanges, Transformer


def inference() -> bool:
    """Whether the tiled product may run: no autograd to record, and the CPU extension loaded."""
    return not torch.is_grad_enabled() and tiled_linear_available()


class TiledLinear(nn.Module):
    """A linear whose weight lives in tiles (kernels.pack_tiles) of dtype, float32 or float16 (rounded), its bias
    float32. x (..., K) float32 -> (..., N)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("tiles", pack_tiles(linear.weight, dtype))  # (N/16, K, 16)
        self.register_buffer("bias", pad_bias(linear.bias, self.tiles))  # (N/16 * 16,) or None

    @property
    def weight(self) -> torch.Tensor:
        """The float32 (N, K) weight, with the values this layer computes with."""
        return unpack_tiles(self.tiles, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.tiles.device.type == "cpu" and inference():
            rows = x.reshape(-1, self.in_features)  # (T, K)
            out = tiled_linear(rows, self.tiles, self.bias, self.out_features)  # (T, N)
            return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)
        bias = None if self.bias is None else self.bias[: self.out_features].to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def projection(self) -> Projection | None:
        """The tiles and bias as the CPU step ops take them (kernels.step), None off the CPU."""
        if self.tiles.device.type != "cpu":
            return None
        return Projection([self.tiles, None, self.bias], [self.out_features])


def tiled_weights_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of dtype on device computes its linears from tiles: float32 on the CPU, where the CPU
    extension is loaded."""
    return device.type == "cpu" and dtype == torch.float32 and tiled_linear_available()


class TiledEmbedding(nn.Module):
    """A token embedding read from a tied output layer's tiles (the same tensor: one copy of the table serves both):
    ids (T,) -> (T, C) float32, the values the output layer computes with."""

    def __init__(self, output: TiledLinear):
        super().__init__()
        self.num_embeddings = output.out_features
        self.register_buffer("tiles", output.tiles)  # (V/16, C, 16)

    @property
    def weight(self) -> torch.Tensor:
        return unpack_tiles(self.tiles, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tiles[ids // LANES, :, ids % LANES].float()  # (T, C)

    def step_operands(self) -> list[torch.Tensor | None] | None:
        """The tiles as kernels.step.cached_step looks rows up in them, None off the CPU."""
        return [self.tiles, None, None] if self.tiles.device.type == "cpu" else None

    def _apply(self, fn, recurse=True):
        ModuleChanges.note()  # the tiles moved: a model's embedding read for its one-call step is stale
        return super()._apply(fn, recurse)


def use_tiled_weights(model: Transformer, tiled: Callable[[nn.Linear], TiledLinear] = TiledLinear) -> int:
    """Replace every nn.Linear of model by tiled(it) (float32 tiles by default), and a tied embedding by a
    TiledEmbedding of the output layer; return how many linears were replaced."""
    embedding = model.model.embed_tokens
    tied = isinstance(model.lm_head, nn.Linear) and model.lm_head.weight is getattr(embedding, "weight", None)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, module in linears:
        model.set_submodule(name, tiled(module))
    if tied:
        model.model.embed_tokens = TiledEmbedding(model.lm_head)
    return len(linears)
