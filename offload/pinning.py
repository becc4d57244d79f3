"""Page-locked host memory of exactly the bytes a tensor holds, counted while it lasts.

``tensor.pin_memory()`` and ``torch.zeros(..., pin_memory=True)`` take their memory from PyTorch's caching host
allocator, which rounds each block up to a power of two: a 17 GB KV cache would lock 32 GB that the system can never
swap. ``pin_exactly`` instead page-locks a tensor's own ordinary memory in place with the CUDA runtime's
``cudaHostRegister`` (as torch.distributed's checkpoint stager does for its staging buffers) and unregisters it when
the tensor's storage is freed. Without CUDA, or for a fake tensor (which has no memory), nothing is locked but the
bytes are counted all the same, so tests on a CPU-only machine can check that what is pinned is what the memory
plan says.
"""

import weakref

import torch

_pinned: dict[int, tuple[int, int]] = {}  # id of each storage pin_exactly holds locked -> (offset, bytes) locked


def pinned_bytes() -> int:
    """Bytes pin_exactly holds page-locked now (counted, not locked, where CUDA is not there)."""
    return sum(size for _, size in _pinned.values())


def _release(key: int, pointer: int | None) -> None:
    """Forget a freed storage's pinned bytes, unregistering its memory where it was registered."""
    _pinned.pop(key, None)
    if pointer is not None:
        torch.cuda.cudart().cudaHostUnregister(pointer)


def pin_exactly(tensor: torch.Tensor) -> torch.Tensor:
    """Page-lock tensor's memory in place, exactly its bytes, until its storage is freed.

    Args:
        tensor: a contiguous host tensor, memory the process allocated, not a mapped file. It may be a view of a
            larger storage (a cache on huge pages starts inside a mapping a huge page longer than it,
            kernels.memory.huge_page_bytes): only its own bytes are locked.
    Returns:
        tensor itself, its memory now pinned (a second call on bytes already pinned changes nothing).
    Raises:
        ValueError: where tensor is not in host memory, is not contiguous, or reaches outside the bytes already
            pinned in its storage.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"only host memory can be pinned, not memory on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("only a contiguous tensor can be pinned exactly: its bytes would not be one range")
    storage = tensor.untyped_storage()
    start, size = tensor.storage_offset() * tensor.element_size(), tensor.nbytes  # bytes into the storage
    key = id(storage)  # storages keep one Python object while they live, so the id names one storage
    if key in _pinned:
        held_start, held_size = _pinned[key]
        if held_start <= start and start + size <= held_start + held_size:
            return tensor
        raise ValueError(
            f"bytes {start}-{start + size} of a storage whose bytes {held_start}-"
            f"{held_start + held_size} are pinned already"
        )
    pointer = None
    holds_memory = storage.device.type == "cpu"  # not a fake tensor's (tests/memory_accounting.py), which has none
    if torch.cuda.is_available() and holds_memory and size > 0:
        pointer = storage.data_ptr() + start
        # flags 1: cudaHostRegisterPortable, pinned for every CUDA context of the process, not just the current one
        error = torch.cuda.cudart().cudaHostRegister(pointer, size, 1)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(error)}")
    _pinned[key] = (start, size)
    # atexit=False: at interpreter exit the CUDA context may be gone, and the process's memory goes with it anyway
    weakref.finalize(storage, _release, key, pointer).atexit = False
    return tensor
