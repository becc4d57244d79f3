"""The CPU extension (kernels.native), built into the cache folder once per machine and torch version."""

from pathlib import Path

import torch

from triforce_cli.kernels.native import KernelUnavailable, load_native
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
