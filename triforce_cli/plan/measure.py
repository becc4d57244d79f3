"""The `this-cpu` machine of `triforce plan`: its figures measured on the spot, in one to three seconds.

- bandwidth: the best of a few copies of a COPY_BYTES tensor (each reads and writes it once);
- FLOP/s: the best of a few float32 matrix products of MATMUL_SIZE (what the CPU computes in, half weights too);
- the fixed cost per decoder layer: a decode step of this tool's own model, tiny enough that its arithmetic and
  bytes are negligible, over its layers (Python, dispatch and the small kernels every layer runs);
- memory: the machine's RAM. Host and device are one, so the 'PCIe' of an offloaded cache is the memory itself.
"""

import os
import statistics
import time

import torch
from transformers import LlamaConfig

from triforce_cli.cache import FullCache
from triforce_cli.plan.model import Hardware
from triforce_cli.runtime.model import Transformer

COPY_BYTES = 256 * 2**20
MATMUL_SIZE = 2048
REPEATS = 3
PROBE_LAYERS = 8  # the tiny model timed for the per-layer cost
PROBE_STEPS = 40  # decode steps of it; the first half warms up


def best_seconds(work, repeats: int = REPEATS) -> float:
    """The shortest of `repeats` timings of work(), after one untimed run."""
    work()
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        timings.append(time.perf_counter() - started)
    return min(timings)


def copy_bandwidth() -> float:
    """Bytes/s of memory: a large copy reads and writes every byte once."""
    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    return 2 * COPY_BYTES / best_seconds(lambda: target.copy_(source))


def matmul_flops() -> float:
    """float32 FLOP/s of a square matrix product."""
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    return 2 * MATMUL_SIZE**3 / best_seconds(lambda: a @ b)


def layer_overhead_seconds() -> float:
    """Median seconds of one eager decode step of a tiny model of this runtime, per layer."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=PROBE_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=PROBE_STEPS,
    )
    model = Transformer.from_hf_config(config).eval()
    cache = FullCache(PROBE_LAYERS, 2, 16, PROBE_STEPS, torch.float32)
    tokens = torch.zeros(1, dtype=torch.long)
    timings = []
    for position in range(PROBE_STEPS):
        started = time.perf_counter()
        model(tokens, position, cache, num_logits=1)
        timings.append(time.perf_counter() - started)
    return statistics.median(timings[PROBE_STEPS // 2 :]) / PROBE_LAYERS


def measure_this_cpu() -> Hardware:
    """This machine's figures, measured now (see the module docstring)."""
    bandwidth = copy_bandwidth()
    return Hardware(
        name="this-cpu",
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        bandwidth=bandwidth,
        pcie=bandwidth,
        flops=matmul_flops(),
        layer_overhead_s=layer_overhead_seconds(),
        measured=True,
        gpu=False,
    )
