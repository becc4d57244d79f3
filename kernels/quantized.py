"""Weight products straight from GGUF Q4_1 blocks: the same weight values, about 6x fewer bytes per step.

A Q4_1 block holds 32 consecutive weights of one row as w = d * q + m, with fp16 d and m and 4-bit q in
[0, 15] (low nibbles: weights 0-15, high nibbles: weights 16-31). torch's CPU int4 kernel computes with
w = (q - 8) * scale + zero per group of 32, so scale = d and zero = m + 8 d represent the very same values.
``dequantize_q4_1`` is the plain reference.
"""

import torch

Q4_1_GROUP = 32
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
INT4_OFFSET = 8


def unpack_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw (N, K/32*20) uint8 -> q (N, K) int32 in [0, 15], d (N, K/32) and m (N, K/32) float32."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, Q4_1_BLOCK_BYTES)  # (N, K/32, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    nibbles = blocks[..., 4:].to(torch.int32)  # (N, K/32, 16)
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1)  # (N, K/32, 32)
    return q.reshape(rows, -1), d, m


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Reference: the float32 (N, K) weights a Q4_1 tensor stores."""
    q, d, m = unpack_q4_1(raw)
    groups = q.reshape(q.shape[0], -1, Q4_1_GROUP).float()
    return (groups * d[..., None] + m[..., None]).reshape(q.shape)


def pack_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 blocks -> (packed int4 weights, scales_and_zeros (K/32, N, 2)) for int4_linear."""
    q, d, m = unpack_q4_1(raw)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales_and_zeros = torch.stack((d, m + INT4_OFFSET * d), dim=-1).transpose(0, 1).contiguous()  # (K/32, N, 2)
    return packed, scales_and_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x (T, K) float32 @ W^T for the packed (N, K) weights -> (T, N)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, Q4_1_GROUP, scales_and_zeros)
