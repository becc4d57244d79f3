"""Weights kept as GGUF blocks (Q4_0, Q4_1, Q8_0) and multiplied as such on the CPU.

A GGUF block stores 32 consecutive weights of one row as w = d * q + m: float16 d (and m, for Q4_1), 4-bit q in
[0, 15] (Q4_1; Q4_0 is w = d * (q - 8), so m = -8 d) or 8-bit q in [-128, 127] (Q8_0, m = 0). pack_blocks
widens d and m to float32 (exact) and lays the blocks out in tiles of 16 rows for the C++ kernel
(csrc/gguf_blocks.cpp). For a few rows it sums d * sum(q x) + m * sum(x) per block; for many (a prefill chunk) it
rebuilds every weight as d * q + m in float32, exactly as dequantize does, and multiplies those. Either way the
activations stay float32, so a product with packed blocks differs from the product with the dequantized weights
only by float32 rounding. A 4-bit weight costs 0.75 bytes this way, an 8-bit one 1.125: about a
fifth (a quarter) of float32.

The kernel is part of the CPU extension (kernels.native), and picks its AVX-512, AVX2 or plain body by what the CPU
has (kernels.native.cpu_isa).
"""

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block
LANES = 16  # rows per tile of the packed layout
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # a block in the file: float16 d, [float16 m], the q's
BLOCK_KINDS = tuple(BLOCK_BYTES)


@dataclass
class PackedBlocks:
    """A weight (N, K) as tiled blocks. q: (N/16, K/32, 16, 16) uint8 (4-bit, two weights a byte) or
    (N/16, K/32, 32, 16) int8; d, m: (N/16, K/32, 16) float32; m is None for Q8_0. N is padded to a multiple of
    16 with zero rows; out_features is the weight's own N."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    out_features: int

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)


def _tiled(values: torch.Tensor, rows: int) -> torch.Tensor:
    """(N, K/32, ...) per-row values -> (N/16, K/32, ..., 16): rows padded to whole tiles, each tile's 16 rows last."""
    padded = torch.nn.functional.pad(values, (0, 0) * (values.dim() - 1) + (0, -rows % LANES))
    tiles = padded.reshape(-1, LANES, *padded.shape[1:])  # (N/16, 16, K/32, ...)
    return tiles.movedim(1, -1).contiguous()


def pack_blocks(raw: torch.Tensor, kind: str) -> PackedBlocks:
    """A GGUF tensor's bytes, (N, K/32 * block bytes) uint8 rows, as PackedBlocks."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[kind])  # (N, K/32, block bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # (N, K/32)
    if kind == "Q8_0":
        q = _tiled(blocks[..., 2:].contiguous().view(torch.int8), rows)  # (N/16, K/32, 32, 16)
        return PackedBlocks(q, _tiled(d, rows), None, rows)
    if kind == "Q4_1":
        m, nibbles = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float(), blocks[..., 4:]
    else:
        m, nibbles = -8 * d, blocks[..., 2:]
    return PackedBlocks(_tiled(nibbles, rows), _tiled(d, rows), _tiled(m, rows), rows)


def _row_values(packed: PackedBlocks, rows: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The q's as (R, K/32, 32) float32 and d, m as (R, K/32, 1) of the given rows (None: all N), padding dropped."""
    if rows is None:
        q = packed.q.movedim(-1, 1).reshape(-1, *packed.q.shape[1:3])[: packed.out_features]  # (N, K/32, 16|32)
        scales = [t.movedim(-1, 1).reshape(-1, t.shape[1])[: packed.out_features] for t in (packed.d, packed.m)
                  if t is not None]  # fmt: skip
    else:
        tiles, lanes = rows // LANES, rows % LANES
        q = packed.q[tiles, :, :, lanes]  # (R, K/32, 16|32)
        scales = [t[tiles, :, lanes] for t in (packed.d, packed.m) if t is not None]
    if packed.m is not None:
        q = torch.cat((q & 0xF, q >> 4), dim=-1)  # weights j, then j + 16 of each block
    return q.float(), *(s[..., None] for s in scales)


def dequantize(packed: PackedBlocks, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight (N, K) the blocks hold, or its rows (R,) -> (R, K): d * q + m, rounded as gguf-py's
    dequantization and the kernel's rebuilt tiles round it."""
    q, *scales = _row_values(packed, rows)
    weight = q * scales[0]
    if packed.m is not None:
        weight = weight + scales[1]
    return weight.reshape(weight.shape[0], -1)


def blocks_linear(x: torch.Tensor, packed: PackedBlocks) -> torch.Tensor:
    """x (T, K) float32 @ W.T -> (T, N) by the block kernel (kernels.native.load_native first)."""
    out = torch.ops.triforce_cpu.blocks_linear(x, packed.q, packed.d, packed.m)
    return out if out.shape[1] == packed.out_features else out[:, : packed.out_features]
