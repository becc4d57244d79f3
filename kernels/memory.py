"""CPU buffers on transparent huge pages: the weights and KV caches a decode step streams from memory.

A decode step reads every weight and every cached key and value once, so its speed is the rate memory is read at.
On 4 KiB pages each page is a fresh start for the CPU's hardware prefetchers and a fresh translation; on 2 MiB pages
a stream runs on unbroken. A sum over 256 MiB of float32 read 27-28 GB/s on 4 KiB pages and 34-35 GB/s on 2 MiB ones
on the 2-core AMD EPYC of docs/performance.md ("Huge pages").

Linux backs a range of anonymous memory with huge pages when the range asks for them (madvise(MADV_HUGEPAGE); the
kernel's transparent-huge-page mode "madvise", a common default) or always (mode "always"), and only as its pages
are first touched. So a buffer here is a fresh mapping a little larger than asked, advised before anything writes
it, and the tensor starts at its first 2 MiB boundary. Elsewhere (another OS, huge pages off) the same calls return plain
buffers: the values are the same either way, only the speed of reading them differs.
"""

import math
import mmap
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ALIGNMENT = 64  # bytes: where each tensor of a shared buffer starts (a cache line)


@cache
def huge_pages_available() -> bool:
    """Whether this machine gives anonymous memory huge pages where asked: Linux with the transparent-huge-page mode
    "always" or "madvise" (not "never", not absent)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_page_bytes(num_bytes: int) -> torch.Tensor:
    """An uninitialised CPU uint8 tensor of num_bytes that starts on a huge-page boundary, its pages advised to be
    huge where the machine has them (huge_pages_available) and num_bytes fills at least one; else a plain one (also
    under a fake-tensor mode, which has no memory to place: tests count a load's bytes that way).

    The memory is a private anonymous mapping of its own, never touched before: memory malloc hands back may have
    been written already, as 4 KiB pages, which advice does not change. It is unmapped when the last tensor viewing
    it goes.
    """
    if num_bytes < HUGE_PAGE or not huge_pages_available() or is_fake(torch.empty(0)):
        return torch.empty(num_bytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    mapping.madvise(mmap.MADV_HUGEPAGE)  # the 2 MiB-aligned parts of it, as they are first touched
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + num_bytes]


def huge_page_zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on huge pages on the CPU (huge_page_bytes)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    return huge_page_bytes(num_bytes).view(dtype).view(tuple(shape)).zero_()


def onto_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of CPU tensors side by side in one buffer on huge pages (huge_page_bytes), each from a
    64-byte boundary: the same values, for tensors too small to fill a huge page alone (a layer's weights)."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end = math.ceil((end + tensor.nbytes) / ALIGNMENT) * ALIGNMENT
    buffer = huge_page_bytes(end)
    copies = []
    for tensor, at in zip(tensors, offsets, strict=True):
        copy = buffer[at : at + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
    return copies
