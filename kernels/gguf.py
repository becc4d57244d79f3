"""Weights kept as GGUF blocks and multiplied as such on the CPU: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the K-quants
Q4_K, Q5_K, Q6_K.

Every one of these types stores, for each group of 32 (Q6_K: 16) consecutive weights of a row, integers q and a
float32 scale d (and for some a minimum m), so that the weight is d * q + m as gguf-py's dequantization computes it:
- Q4_0: d * (q - 8), q in [0, 15] (m = -8 d, exact); Q4_1: d * q + m; Q4_K: (d * sc) * q - dmin * mn for its 8
  groups of 32 in a 256-weight super-block, the 6-bit sc and mn unpacked and their products taken in float32 (exact:
  an 11-bit mantissa times a 6-bit integer), so that d = d * sc and m = -(dmin * mn) per group;
- Q8_0: d * q, q in [-128, 127]; Q5_0: d * (q - 16), q (5 bits) - 16 in [-16, 15]; Q5_1: d * q + m, q in [0, 31];
  Q5_K: (d * sc) * q - dmin * mn as Q4_K with 5-bit q; Q6_K: (d * sc) * (q - 32) with an int8 sc per 16 weights.
unpack_blocks turns a tensor's bytes into those q, d and m; pack_blocks lays them out in tiles of 16 rows for the
C++ kernel (csrc/gguf_blocks.cpp): q's of 4 bits two to a byte, others (5, 6 and 8 bits) one int8 each, d and m in
float32, each block of a tile one record of whole cache lines holding its q's, then its d's, then its m's, so that a
product reads one stream of memory (three streams, q's, d's and m's apart, ran a decode step's products at about
three quarters of the rate on the 2-core EPYC the figures in docs/performance.md come from). The kernel sums
d * sum(q x) + m * sum(x) per group, in one order of arithmetic for every number of activation rows and threads: a
row's output has the same bits in a decode step, a verification and a prefill chunk.
The activations stay float32, so the product differs from the product with the dequantized weights only by float32
rounding.

Bytes per weight in memory: 0.75 for the 4-bit types (a file's Q4_K is 0.5625), 1.125 for Q8_0 and Q5_0, 1.25 for
Q5_1, Q5_K and Q6_K; float32 is 4. Other types (Q2_K, Q3_K, the IQ types) are dequantized by the loader.

The kernel is part of the CPU extension (kernels.native), and picks its AVX-512, AVX2 or plain body by what the CPU
has (kernels.native.cpu_isa).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

BLOCK = 32  # weights per block of the packed layout
LANES = 16  # rows per tile of the packed layout


@dataclass(frozen=True)
class BlockKind:
    """A GGUF block type: its bytes and weights per block in the file, and its packed form."""

    file_bytes: int
    file_weights: int  # 32, or 256 for a K-quant super-block
    four_bit: bool  # packed two q's a byte, else one int8 each
    minimums: bool  # w = d * q + m, else d * q
    group: int  # consecutive weights sharing one d (and m): 32, or 16 (Q6_K)

    def bytes_per_weight(self) -> float:
        """Bytes per weight of the packed form (q, d and m)."""
        return (0.5 if self.four_bit else 1.0) + 4 * (1 + self.minimums) / self.group


BLOCK_TYPES = {
    "Q4_0": BlockKind(18, 32, True, True, 32),
    "Q4_1": BlockKind(20, 32, True, True, 32),
    "Q8_0": BlockKind(34, 32, False, False, 32),
    "Q5_0": BlockKind(22, 32, False, False, 32),
    "Q5_1": BlockKind(24, 32, False, True, 32),
    "Q4_K": BlockKind(144, 256, True, True, 32),
    "Q5_K": BlockKind(176, 256, False, True, 32),
    "Q6_K": BlockKind(210, 256, False, False, 16),
}
BLOCK_KINDS = tuple(BLOCK_TYPES)


@dataclass(frozen=True)
class PackedBlocks:
    """A weight (N, K) as tiles of 16 rows, N padded to a multiple of 16 with zero rows (out_features is the
    weight's own N). records: (N/16, K/32, R) uint8, the record of block b of a tile being its q's (Q bytes), its
    scales d (float32 (groups, 16): one or two a block for each of the tile's rows) and, with minimums, m (float32
    (16,)), R = Q + 64 (groups + minimums) bytes. q's layout (csrc/gguf_blocks.cpp): 4-bit, Q = 256: byte
    64 g + 4 lane + i = q[lane, 4 g + i] | q[lane, 16 + 4 g + i] << 4; 8-bit, Q = 512: byte 16 j + lane = q[lane, j]
    as int8."""

    records: torch.Tensor
    four_bit: bool
    groups: int  # scales a block: 1, or 2 (one per 16 weights)
    minimums: bool
    out_features: int

    @property
    def q_bytes(self) -> int:
        return BLOCK * LANES // (2 if self.four_bit else 1)

    @property
    def record_bytes(self) -> int:
        """R: a record's q's, d's and m's."""
        return self.q_bytes + 4 * LANES * (self.groups + self.minimums)

    @property
    def q(self) -> torch.Tensor:
        """(N/16, K/32, Q) uint8: the records' q's, a view."""
        return self.records[..., : self.q_bytes]

    @property
    def d(self) -> torch.Tensor:
        """(N/16, K/32, 16 groups) float32: the records' scales, a view."""
        start = self.q_bytes
        return self.records[..., start : start + 4 * LANES * self.groups].view(torch.float32)

    @property
    def m(self) -> torch.Tensor | None:
        """(N/16, K/32, 16) float32: the records' minimums, a view; None without."""
        if not self.minimums:
            return None
        start = self.q_bytes + 4 * LANES * self.groups
        return self.records[..., start : start + 4 * LANES].view(torch.float32)

    @property
    def in_features(self) -> int:
        return self.records.shape[1] * BLOCK

    @property
    def group(self) -> int:
        """Weights per scale: 32, or 16."""
        return BLOCK // self.groups

    @property
    def form(self) -> tuple[bool, bool, int]:
        """(4-bit, has minimums, group): parts of one form can be stacked into one set of tiles."""
        return self.four_bit, self.minimums, self.group

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    @cached_property
    def _views(self) -> list[torch.Tensor | None]:
        return [self.q, self.d, self.m]

    def operands(self) -> list[torch.Tensor | None]:
        """q, d and m (or None): the three views the extension's ops take (it reads the records through them), made
        once (with the caches cold after a step, making them cost twice the lookup of an embedding's row)."""
        return self._views


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32: (B,)."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """(B, n) bytes -> (B, 2n) 4-bit values: for each run of `span` bytes, their low nibbles, then their high ones."""
    runs = qs.reshape(qs.shape[0], -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0xF).reshape(qs.shape[0], -1)


def _bits(packed: np.ndarray, width: int, count: int) -> np.ndarray:
    """(B, n) unsigned ints -> (B, count * n): the `width`-bit fields 0, 1, ... of every int, field by field."""
    shifts = np.arange(0, width * count, width, dtype=packed.dtype).reshape(1, count, 1)
    return ((packed[:, None, :] >> shifts) & ((1 << width) - 1)).reshape(packed.shape[0], -1)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> the 8 groups' 6-bit scales and minimums, each (B, 8) float32."""
    low, high, mixed = (scales[:, i : i + 4] for i in (0, 4, 8))
    sc = np.concatenate([low & 0x3F, (mixed & 0xF) | ((low >> 2) & 0x30)], axis=1)
    mn = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def unpack_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's bytes (..., blocks * file bytes) uint8 -> q (B, W) int16, d (B, W/G) float32 and m (as d, or
    None) for its B blocks of W weights in groups of G, such that the weights are d * q + m (each group's d and m
    broadcast over its G q's), rounded as gguf-py's dequantize rounds them."""
    kind_of = BLOCK_TYPES[kind]
    blocks = raw.reshape(-1, kind_of.file_bytes)
    d = _half(blocks, 0)[:, None]
    if kind in ("Q4_0", "Q4_1"):
        q = _nibbles(blocks[:, 2 + 2 * (kind == "Q4_1") :], 16).astype(np.int16)
        return q, d, (_half(blocks, 2)[:, None] if kind == "Q4_1" else -8 * d)
    if kind == "Q8_0":
        return blocks[:, 2:].view(np.int8).astype(np.int16), d, None
    if kind in ("Q5_0", "Q5_1"):
        start = 2 + 2 * (kind == "Q5_1")
        high = _bits(np.ascontiguousarray(blocks[:, start : start + 4]).view(np.uint32), 1, 32)  # (B, 32)
        q = (_nibbles(blocks[:, start + 4 :], 16) | (high << 4)).astype(np.int16)
        return (q, d, _half(blocks, 2)[:, None]) if kind == "Q5_1" else (q - 16, d, None)
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[:, 4:16])
        q = _nibbles(blocks[:, 16 + 32 * (kind == "Q5_K") :], 32).astype(np.int16)
        if kind == "Q5_K":
            q |= _bits(blocks[:, 16:48], 1, 8) << 4
        return q, d * sc, -(_half(blocks, 2)[:, None] * mn)
    if kind == "Q6_K":
        q = _nibbles(blocks[:, :128], 64).astype(np.int16) | (_bits(blocks[:, 128:192].reshape(-1, 32), 2, 4)
                                                                 .reshape(len(blocks), -1) << 4)  # fmt: skip
        return q - 32, _half(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32), None
    raise ValueError(f"GGUF type {kind} is not kept packed")


def _tiled(values: torch.Tensor, rows: int) -> torch.Tensor:
    """(N, K/32, W) per-row values -> (N/16, K/32, W, 16): rows padded to whole tiles, each tile's 16 rows last."""
    padded = torch.nn.functional.pad(values, (0, 0, 0, 0, 0, -rows % LANES))
    tiles = padded.reshape(-1, LANES, *padded.shape[1:])  # (N/16, 16, K/32, W)
    return tiles.movedim(1, -1).contiguous()


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """(N/16, K/32, ...) tensor -> (N/16, K/32, bytes) uint8, its bytes in order."""
    return values.contiguous().view(torch.uint8).reshape(*values.shape[:2], -1)


def pack_blocks(raw: torch.Tensor, kind: str) -> PackedBlocks:
    """A GGUF tensor's bytes, (N, K/W * file bytes) uint8 rows, as PackedBlocks."""
    rows = raw.shape[0]
    kind_of = BLOCK_TYPES[kind]
    q, d, m = (None if t is None else torch.from_numpy(t) for t in unpack_blocks(raw.numpy(), kind))
    q = q.reshape(rows, -1, BLOCK)  # (N, K/32, 32)
    groups = BLOCK // kind_of.group
    if kind_of.four_bit:
        pairs = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)  # byte j: weights j and j + 16 of its block
        tiles = _tiled(pairs, rows)  # (N/16, K/32, 16 j, 16 lane)
        q_part = tiles.reshape(*tiles.shape[:2], 4, 4, LANES).transpose(-1, -2)  # (.., 4 g, 16 lane, 4 i)
    else:
        q_part = _tiled(q.to(torch.int8), rows)  # (N/16, K/32, 32 j, 16 lane)
    parts = [q_part, _tiled(d.reshape(rows, -1, groups), rows)]  # d: (N/16, K/32, groups, 16)
    if m is not None:
        parts.append(_tiled(m.reshape(rows, -1, 1), rows))
    records = torch.cat([_bytes(part) for part in parts], dim=-1)
    return PackedBlocks(records, kind_of.four_bit, groups, m is not None, rows)


def dequantize(packed: PackedBlocks) -> torch.Tensor:
    """The float32 weight (N, K) the blocks hold: d * q + m, rounded as gguf-py's dequantization and the kernel's
    rebuilt tiles round it."""
    tiles, blocks = packed.records.shape[:2]
    if packed.four_bit:
        pairs = packed.q.reshape(tiles, blocks, 4, LANES, 4).transpose(-1, -2).reshape(tiles, blocks, 16, LANES)
        q = torch.cat((pairs & 0xF, pairs >> 4), dim=2)  # (N/16, K/32, 32 j, 16 lane): weights j, then j + 16
    else:
        q = packed.q.view(torch.int8).reshape(tiles, blocks, BLOCK, LANES)
    rows = tiles * LANES
    weight = q.permute(0, 3, 1, 2).reshape(rows, blocks, packed.groups, packed.group).float()
    weight = weight * packed.d.reshape(tiles, blocks, packed.groups, LANES).permute(0, 3, 1, 2).reshape(
        rows, blocks, packed.groups, 1
    )
    if packed.m is not None:
        weight = weight + packed.m.permute(0, 2, 1).reshape(rows, blocks, 1, 1)
    return weight.reshape(rows, -1)[: packed.out_features]


def blocks_rows(packed: PackedBlocks, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids (R,) of the weight dequantize gives, (R, K) float32, the same bits, rebuilt by the extension
    (kernels.native.load_native first): one call where dequantizing rows takes a dozen torch ops."""
    return torch.ops.triforce_cpu.blocks_rows(*packed.operands(), ids)


def blocks_linear(x: torch.Tensor, packed: PackedBlocks) -> torch.Tensor:
    """x (T, K) float32 @ W.T -> (T, N) by the block kernel (kernels.native.load_native first)."""
    out = torch.ops.triforce_cpu.blocks_linear(x, *packed.operands())
    return out if out.shape[1] == packed.out_features else out[:, : packed.out_features]
