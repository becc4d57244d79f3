"""A decode step's sampling on the CPU in one call a row: the distribution decoding.sampling.probabilities shapes
(temperature, top-k, min-p, top-p) and the draw decoding.sampling.sample makes from it, by the CPU extension
(csrc/sampling.cpp). The torch ops they replace take about half a millisecond a row over a 49,152-token vocabulary,
most of it per-op overhead; the extension takes tens of microseconds. decoding.sampling keeps the torch ops as the
reference (and for CUDA, and for logits that need their gradient).
"""

import torch


def sampling_kernels_available(x: torch.Tensor) -> bool:
    """Whether the extension's sampling takes x: float32 on the CPU, no gradient wanted, the extension loaded
    (kernels.native)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (x.requires_grad and torch.is_grad_enabled())
        and hasattr(torch.ops.triforce_cpu, "sampling_probabilities")
    )


def sampling_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int, min_p: float, top_p: float
) -> torch.Tensor:
    """The sampling distribution (N, V) float32 of logits (N, V) at temperature > 0: scaled, cut to the top_k best
    (0: all), softmax, tokens below min_p times the likeliest dropped (0: none), then the top_p nucleus (1: all),
    each row alone (csrc/sampling.cpp)."""
    return torch.ops.triforce_cpu.sampling_probabilities(logits, temperature, top_k, min_p, top_p)


def sample_rows(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (N, V) float32 -> (N,) int64: the first whose running float64 sum of probs exceeds
    uniform (N,) float64 times the row's sum (csrc/sampling.cpp)."""
    return torch.ops.triforce_cpu.sample_rows(probs, uniform)
