"""The CUDA caching allocator's configuration for a run, set before torch first allocates on a GPU.

A run holds a few long-lived tensors of very different sizes (weights, caches sized to the prompt, an offloaded
cache's staging ring) beside short-lived ones that change size with the phase (prefill blocks of thousands of
tokens, then decode steps of a few). With the allocator's fixed segments the freed prefill blocks stay reserved in
pieces that later requests cannot use: measured on an H200 held to 24 GiB, an offloaded 128K run failed for
112 MiB with 0.5 GiB reserved but unallocated. Expandable segments map memory into one growing range per stream
instead, so that freed pieces merge (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf).
A configuration the user set is left as it is.
"""

import os

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the older name first; torch reads either
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def expandable_cuda_segments() -> None:
    """Have torch's CUDA allocator use expandable segments unless the user configured it (either variable set).
    torch reads the variable when it first allocates on a GPU: the command calls this first thing."""
    if not any(name in os.environ for name in ALLOCATOR_VARIABLES):
        os.environ[ALLOCATOR_VARIABLES[0]] = EXPANDABLE_SEGMENTS
