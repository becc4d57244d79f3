"""The CPU extension (`torch.ops.triforce_cpu`): GGUF block products (csrc/gguf_blocks.cpp) and attention of
prefill chunks (csrc/flash_attention.cpp).

Built from source with torch.utils.cpp_extension the first time (seconds; it needs a C++ compiler and ninja) into a
folder the caller names, with OpenMP so that at::parallel_for runs on torch's own threads. Its kernels pick their
AVX-512, AVX2 or plain bodies by what the CPU has.
"""

import platform
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("gguf_blocks.cpp", "flash_attention.cpp"))
EXTENSION = "triforce_cpu"


class KernelUnavailable(RuntimeError):
    """The extension cannot be built or loaded here (no C++ compiler, or not an x86 CPU)."""


_failure: list[str] = []  # why the build failed in this process, so that it is not tried again


def native_loaded() -> bool:
    return hasattr(torch.ops.triforce_cpu, "blocks_linear")


def load_native(build_folder: Path) -> None:
    """Build (the first time) and load the extension; KernelUnavailable with the reason where it cannot be. A
    failure is remembered for the process: every model load asks, and a failing compile takes seconds."""
    if native_loaded():
        return
    if _failure:
        raise KernelUnavailable(_failure[0])
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _failure.append("the CPU kernels are written for x86 CPUs")
        raise KernelUnavailable(_failure[0])
    from torch.utils import cpp_extension

    build_folder.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=EXTENSION,
            sources=[str(source) for source in SOURCES],
            build_directory=str(build_folder),
            extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"],  # at::parallel_for runs on torch's OpenMP
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        _failure.append(f"cannot build the CPU kernels ({reason}); a C++ compiler and ninja are needed")
        raise KernelUnavailable(_failure[0]) from None


def cpu_isa() -> str:
    """The body the GGUF kernels run: 'avx512', 'avx2' or 'scalar'."""
    return torch.ops.triforce_cpu.isa()
