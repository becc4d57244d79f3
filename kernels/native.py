"""The CPU extension (`torch.ops.triforce_cpu`): GGUF block products (csrc/gguf_blocks.cpp), dense products of
float32 or float16 weight tiles in one order of arithmetic per output (csrc/dense_linear.cpp), attention of
float32 queries against a float16 KV cache (csrc/cache_attention.cpp), a decoder layer's other ops with its two
halves in one call each (csrc/step_ops.cpp), a step's sampling (csrc/sampling.cpp), the retrieval cache's chunks
copied in one call (csrc/gather_chunks.cpp), and the CPU's float32 FMA peak
(csrc/peak_rate.h).

Built from source with torch.utils.cpp_extension the first time (seconds; it needs a C++ compiler and ninja) into a
folder the caller names, with OpenMP so that at::parallel_for runs on torch's own threads. Its kernels pick their
AVX-512, AVX2 or plain bodies by what the CPU has.

Several processes may build at once and any of them may be killed midway. cpp_extension builds in place under a lock
file that it waits on with no time limit, so a build killed while holding it would leave every later run waiting
forever. So each build runs in a workspace folder of its own, and the finished library takes its place in the folder
in one rename, under a name that hashes everything it is built from; a run that finds it loads it without building.
Two first builds at once both finish (the second rename replaces an identical file); a killed one leaves only its
workspace, which no run reads and a later build removes once it is a day old.
"""

import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from triforce_cli.kernels.step import register_fake_kernels

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "gguf_blocks.cpp",
        "dense_linear.cpp",
        "cache_attention.cpp",
        "step_ops.cpp",
        "sampling.cpp",
        "gather_chunks.cpp",
    )
)
HEADERS = tuple(
    CSRC / name for name in ("isa.h", "vector_exp.h", "cache_attention_body.h", "step_kernels.h", "peak_rate.h")
)  # included by SOURCES
EXTENSION = "triforce_cpu"
CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")  # at::parallel_for runs on torch's OpenMP
LDFLAGS = ("-fopenmp",)
WORKSPACE_PREFIX = "build-"  # a build in progress, or one killed midway
STALE_WORKSPACE_SECONDS = 24 * 3600  # no build takes this long: a workspace this old was left by a killed one


class KernelUnavailable(RuntimeError):
    """The extension cannot be built or loaded here (no C++ compiler, or not an x86 CPU)."""


_failure: list[str] = []  # why the build failed in this process, so that it is not tried again


def native_loaded() -> bool:
    return hasattr(torch.ops.triforce_cpu, "blocks_linear")


def library_name() -> str:
    """The built library's file name: a hash of the sources and headers, the flags, torch, Python, the machine and
    the compiler asked for, so that a library built from anything else is never loaded."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    built_with = (CFLAGS, LDFLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine())
    digest.update(repr((*built_with, os.environ.get("CXX", ""))).encode())
    return f"{EXTENSION}-{digest.hexdigest()[:16]}.so"


def load_native(build_folder: Path) -> None:
    """Load the extension from build_folder, building it there the first time; KernelUnavailable with the reason
    where it cannot be. A failure is remembered for the process: every model load asks, and a failing compile takes
    seconds."""
    if native_loaded():
        return
    if _failure:
        raise KernelUnavailable(_failure[0])
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _failure.append("the CPU kernels are written for x86 CPUs")
        raise KernelUnavailable(_failure[0])
    library = build_folder / library_name()
    built = library.is_file()
    try:
        if built:
            torch.ops.load_library(str(library))
        else:
            _build(library)
    except (RuntimeError, OSError, ImportError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if built:
            _failure.append(f"cannot load the CPU kernels from {library} ({reason}); remove it to build them again")
        else:
            _failure.append(f"cannot build the CPU kernels ({reason}); a C++ compiler and ninja are needed")
        raise KernelUnavailable(_failure[0]) from None
    register_fake_kernels()


def _build(library: Path) -> None:
    """Build and load the extension in a workspace of this process's own, then rename the library to its place."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_workspaces(library.parent)
    workspace = tempfile.mkdtemp(prefix=WORKSPACE_PREFIX, dir=library.parent)
    try:
        built = cpp_extension.load(
            name=EXTENSION,
            sources=[str(source) for source in SOURCES],
            build_directory=workspace,
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            is_python_module=False,
            verbose=False,
        )
        os.replace(built, library)  # loaded already: the mapping outlives the name
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _remove_stale_workspaces(folder: Path) -> None:
    """Remove the workspaces of builds killed midway; one younger than a day may be another process's build."""
    for workspace in folder.glob(f"{WORKSPACE_PREFIX}*"):
        try:
            if time.time() - workspace.stat().st_mtime > STALE_WORKSPACE_SECONDS:
                shutil.rmtree(workspace, ignore_errors=True)
        except OSError:  # removed meanwhile
            continue


def cpu_isa() -> str:
    """The body the GGUF kernels run: 'avx512', 'avx2' or 'scalar'."""
    return torch.ops.triforce_cpu.isa()
