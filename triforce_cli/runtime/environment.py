"""What this machine offers the tool, and what a run would choose on it: `triforce info`, and the machine record
of `triforce bench --out`."""

import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from triforce_cli.errors import TriforceError
from triforce_cli.kernels import attention_backend, half_weights_available
from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER, embedded_gguf_path
from triforce_cli.runtime.forms import STEP_REASONS, StepMode, resolve_steps, resolve_weights
from triforce_cli.runtime.store import cache_limit, cache_root, entries, models_folder, prompts_folder

CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FEATURES it has (from /proc/cpuinfo where there is one). The name
    carries the CPU's family and model numbers where cpuinfo gives them: a virtual machine's name ("AMD EPYC") may
    stand for several generations, whose measurements differ."""
    model, flags, numbers = platform.processor() or platform.machine(), set(), {}
    try:
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name == "model name":
                model = value.strip()
            elif name == "flags":
                flags = set(value.split())
            elif name in ("cpu family", "model") and name not in numbers:
                numbers[name] = value.strip()
            elif not name and numbers:
                break  # the first processor's block is read: every core of a VM reports the same
    except OSError:
        pass
    if len(numbers) == 2:
        model = f"{model} (family {numbers['cpu family']}, model {numbers['model']})"
    return model, [feature for feature in CPU_FEATURES if feature in flags]


def physical_cores() -> int:
    """The physical cores this process may run on: its CPU affinity with hyperthread siblings counted once (each
    core's thread_siblings_list in sysfs), else the CPUs it may run on."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))


@dataclass(frozen=True)
class CpuSample:
    """The machine's busy CPU time and this process's own at one moment, to tell how much other programs used."""

    wall: float  # seconds, monotonic
    busy: float | None  # CPU-seconds every CPU spent busy since boot (/proc/stat), None where the system does not say
    own: float  # CPU-seconds of this process, all its threads


def cpu_sample() -> CpuSample:
    busy = None
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
        guest = sum(fields[8:10])  # counted inside user and nice already
        busy = (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")  # steal counts: another guest had the CPU
    except (OSError, ValueError, IndexError):
        pass
    times = os.times()
    return CpuSample(time.monotonic(), busy, times.user + times.system)


def others_share(before: CpuSample, after: CpuSample) -> float | None:
    """The share of the machine's CPU time (0 to 1) that other programs used between two samples, or None where
    the system does not say."""
    wall = after.wall - before.wall
    if before.busy is None or after.busy is None or wall <= 0:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to threads inside the block (None: left as they are), restored after it."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def load_average() -> float | None:
    """The one-minute load average, or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def machine_description() -> dict:
    """The CPU, threads and versions a measurement ran with."""
    cpu, features = cpu_description()
    return {
        "platform": platform.platform(),
        "processor": cpu,
        "cpu_features": features,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


# What a GPU needs beyond the tensors a plan lists (assumptions, not measurements): the CUDA context, cuBLAS's
# workspace and the kernels loaded, about 0.5 GiB with torch and lazily loaded modules; and, held to 5% of the card,
# the caching allocator's rounding and fragmentation, CUDA graph pools, float32 logits and prefill activations.
# The planner itemises graph pools and the layer-wise prefill's hidden states (plan.model.memory_items) and keeps a
# smaller share for the rest (plan.model.PLANNED_SLACK_SHARE); the engine's memory check, which does not, keeps this.
CUDA_CONTEXT_BYTES = 1 << 29
CUDA_SLACK_SHARE = 0.05


def device_reserve(total_bytes: int) -> int:
    """Bytes of a GPU of total_bytes that a process whose CUDA context exists already leaves free beside its
    tensors: CUDA_SLACK_SHARE of the card."""
    return int(CUDA_SLACK_SHARE * total_bytes)


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated for tensors on device: on a GPU the driver's free memory plus what torch's
    caching allocator holds unused, within the share of the card this process may use
    (torch.cuda.set_per_process_memory_fraction), less device_reserve of that share; the host's MemAvailable (None
    where the system does not say)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        allowed = int(total * torch.cuda.get_per_process_memory_fraction(device))
        unused = min(free + reserved, allowed) - torch.cuda.memory_allocated(device)
        return max(0, unused - device_reserve(allowed))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_choices(device: torch.device) -> dict:
    """What a run on device picks with every setting left at auto, and why."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention = attention_backend(device, dtype)
    steps = resolve_steps(None, device, "auto")
    compiled = steps != StepMode.EAGER
    weights = resolve_weights("auto", dtype, device, attention, compiled)
    gguf_weights = resolve_weights("auto", dtype, device, attention, compiled, gguf_source=True)
    reasons = {
        "flash": "flash-attn is installed and the device is CUDA",
        "sdpa": "CUDA without flash-attn (pip install -e '.[flash]')",
        "cpu": "the CPU kernels: grouped attention for few queries; for many, chunk attention (AVX-512) or SDPA",
    }
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "attention": attention,
        "attention_reason": reasons[attention],
        "weights": weights if gguf_weights == weights else f"{gguf_weights} (GGUF files), else {weights}",
        "steps": steps,
        "steps_reason": STEP_REASONS[device.type],
    }


def describe_environment() -> dict:
    """Devices, memory, versions, the choices a run would make on each device, the embedded model and the cache."""
    cuda = [
        {
            "index": i,
            "name": torch.cuda.get_device_name(i),
            "memory_bytes": torch.cuda.get_device_properties(i).total_memory,
        }
        for i in range(torch.cuda.device_count())
    ]
    devices = [torch.device("cuda", 0)] if cuda else []
    devices.append(torch.device("cpu"))
    cpu, features = cpu_description()
    try:
        embedded = str(embedded_gguf_path())
    except TriforceError as err:
        embedded = f"not installed: {err}"
    cached = [e for folder in (models_folder(), prompts_folder()) for e in entries(folder)]
    runs = [run_choices(device) for device in devices]
    return {
        **runs[0],
        "runs": runs,
        "cpu": {"model": cpu, "features": features, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None,
        "cuda": cuda,
        "versions": {
            "triforce-cli": package_version("triforce-cli"),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": package_version("transformers"),
            "flash-attn": package_version("flash-attn"),
            "llama-cpp-python": package_version("llama-cpp-python"),
        },
        "half_weights_available": half_weights_available(),
        "embedded_model": embedded,
        "embedded_drafter": str(EMBEDDED_DRAFTER) if (EMBEDDED_DRAFTER / "config.json").is_file() else None,
        "cache_folder": str(cache_root()),
        "cache_bytes": sum(e.size for e in cached),
        "cache_limit_bytes": cache_limit(),
    }
