"""The `this-cpu` machine of `triforce plan`: its figures measured on the spot, in one to three seconds (the first
time on a machine, after the CPU extension's build, which any command that runs a model makes once).

- bandwidth: the best of a few copies of a COPY_BYTES tensor (each reads and writes it once);
- read bandwidth (for the floors of `triforce bench --forward-costs`, plan.rates): the best of a few sums over a
  COPY_BYTES tensor, which read it once and write nothing;
- FLOP/s: the best of a few float32 matrix products of MATMUL_SIZE (what the CPU computes in, half weights too);
- peak FLOP/s: the best of a few runs of independent float32 FMA chains on every thread (peak_flops), the most
  any kernel can compute, where the extension is loaded;
- the fixed cost per decoder layer: a decode step of this tool's own model, tiny enough that its arithmetic and
  bytes are negligible, over its layers (Python, dispatch, threads meeting and the small kernels every layer runs),
  in the form decoding takes on this CPU: weights in the extension's tiles and a float16 KV cache, so that the
  layers run as one call into the extension (runtime.model's stacked layers), or torch's ops where the extension
  cannot be built;
- memory: the machine's RAM. Host and device are one, so the 'PCIe' of an offloaded cache is the memory itself.

The `this-gpu` machine: the current CUDA device measured the same way, its work timed between synchronisations:

- bandwidth: the best of a few device-to-device copies of GPU_COPY_BYTES;
- FLOP/s: the best of a few bfloat16 matrix products of GPU_MATMUL_SIZE (tensor cores);
- PCIe: the best of a few copies of PINNED_BYTES from page-locked host memory to the device;
- the fixed cost per decoder layer: presets.CUDA_GRAPH_LAYER_OVERHEAD_S, as the decode steps replay as CUDA graphs;
- memory: the device's memory within the share this process may use (torch.cuda.set_per_process_memory_fraction).
"""

import os
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig

from triforce_cli.cache import FullCache, kv_dtype
from triforce_cli.errors import ConfigError
from triforce_cli.kernels.memory import huge_page_bytes
from triforce_cli.plan.model import Hardware
from triforce_cli.plan.presets import CUDA_GRAPH_LAYER_OVERHEAD_S, THIS_GPU
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.tiled_weights import tiled_weights_apply, use_tiled_weights

COPY_BYTES = 256 * 2**20
MATMUL_SIZE = 2048
PEAK_ROUNDS = 1 << 21  # of 12 FMA chains a thread: 0.8 GFLOP of AVX-512 ones, about 8 ms on a Zen 4 core
REPEATS = 3
PROBE_LAYERS = 24  # the tiny model timed for the per-layer cost: deep enough that a step's own costs spread thin
PROBE_STEPS = 40  # decode steps of it; the first half warms up
GPU_COPY_BYTES = 2**30
GPU_MATMUL_SIZE = 8192
PINNED_BYTES = 256 * 2**20
CPU = torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on device (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(work, repeats: int = REPEATS, device: torch.device = CPU) -> float:
    """The shortest of `repeats` timings of work() on device, after one untimed run, each from an idle device to
    the end of the work it queued."""
    work()
    timings = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        work()
        synchronize(device)
        timings.append(time.perf_counter() - started)
    return min(timings)


def copy_bandwidth(device: torch.device = CPU, num_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of device's memory: a large copy reads and writes every byte once."""
    source = torch.ones(num_bytes // 4, device=device)
    target = torch.empty_like(source)
    return 2 * num_bytes / best_seconds(lambda: target.copy_(source), device=device)


def read_probe(num_bytes: int) -> Callable[[], object]:
    """A read of num_bytes of the CPU's memory: a sum over a float32 tensor reads every byte once and writes none;
    the tensor on huge pages where the machine has them, as the weights and caches are (kernels.memory)."""
    return huge_page_bytes(num_bytes // 4 * 4).view(torch.float32).fill_(1).sum


def read_bandwidth(num_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of reading the CPU's memory (read_probe), the best of a few."""
    return num_bytes / best_seconds(read_probe(num_bytes))


def peak_flops(rounds: int = PEAK_ROUNDS) -> float | None:
    """The float32 FLOP/s of independent FMA chains on every torch thread, no memory read (csrc/peak_rate.h): the
    most arithmetic this CPU's vector units do, the best of a few; None where the extension cannot be built here."""
    if kernel_error() is not None:
        return None
    return max(torch.ops.triforce_cpu.peak_flops(rounds) for _ in range(REPEATS))


def matmul_flops(device: torch.device = CPU, dtype: torch.dtype = torch.float32, size: int = MATMUL_SIZE) -> float:
    """FLOP/s of a square matrix product of size in dtype on device."""
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    return 2 * size**3 / best_seconds(lambda: a @ b, device=device)


def host_to_device_bandwidth(device: torch.device, num_bytes: int = PINNED_BYTES) -> float:
    """Bytes/s of a copy from page-locked host memory to device (where pinning is possible: a CUDA build)."""
    source = torch.ones(num_bytes // 4, pin_memory=True)
    target = torch.empty_like(source, device=device)
    return num_bytes / best_seconds(lambda: target.copy_(source, non_blocking=True), device=device)


def probe_model() -> Transformer:
    """The tiny model whose decode steps price a layer, its linears in the extension's tiles where it is here."""
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
    if kernel_error() is None and tiled_weights_apply(CPU, torch.float32):
        use_tiled_weights(model)
    return model


def layer_overhead_seconds() -> float:
    """Median seconds of one decode step of a tiny model of this runtime (probe_model), on the KV cache decoding
    keeps on this CPU, per layer."""
    model = probe_model()
    cache = FullCache(PROBE_LAYERS, 2, 16, PROBE_STEPS, kv_dtype(CPU, torch.float32))
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


def measure_this_gpu() -> Hardware:
    """The current CUDA device's figures, measured now (see the module docstring); a ConfigError without one."""
    if not torch.cuda.is_available():
        raise ConfigError(
            f"`hardware` {THIS_GPU} measures a CUDA GPU and this machine has none: use this-cpu or a preset"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    return Hardware(
        name=THIS_GPU,
        memory_bytes=int(total * torch.cuda.get_per_process_memory_fraction(device)),
        bandwidth=copy_bandwidth(device, GPU_COPY_BYTES),
        pcie=host_to_device_bandwidth(device),
        flops=matmul_flops(device, torch.bfloat16, GPU_MATMUL_SIZE),
        layer_overhead_s=CUDA_GRAPH_LAYER_OVERHEAD_S,
        cuda_graphs=True,
        measured=True,
    )
