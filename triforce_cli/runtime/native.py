"""The CPU extension (kernels.native), built into the cache folder once per machine and torch version."""

from functools import cache
from pathlib import Path

import torch

from triforce_cli.kernels.native import KernelUnavailable, library_name, load_native, native_loaded
from triforce_cli.runtime.store import cache_root


def kernel_folder() -> Path:
    return cache_root() / "kernels" / f"torch-{torch.__version__}"


def ensure_kernels() -> None:
    """Build or load the extension (KernelUnavailable where it cannot be)."""
    load_native(kernel_folder())


def kernel_error() -> str | None:
    """Why the extension cannot be had here, or None once it is loaded."""
    try:
        ensure_kernels()
    except KernelUnavailable as err:
        return str(err)
    return None


@cache
def _library_built() -> str:
    return library_name()


def kernel_build() -> str | None:
    """The loaded extension's build (its library's name: a hash of its sources, flags, torch and Python), or None
    where it is not loaded: what a saved state computed by its kernels names, so that other kernels never read it."""
    return _library_built() if native_loaded() else None
