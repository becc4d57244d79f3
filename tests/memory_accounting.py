"""Memory accounting without the memory: run the real code on fake tensors and count what each device would hold.

``FakeTensorMode`` (torch._subclasses.fake_tensor) gives tensors their shapes, dtypes and devices but no data, 'cuda'
tensors included on a machine without CUDA (name the device with its index, ``torch.device("cuda", 0)``: for an
unindexed one torch asks the CUDA runtime which device is current). ``MemoryLedger``, a TorchDispatchMode above it,
sees every op's outputs: an output whose storage is none of the op's inputs' is an allocation, counted against its
tensor's device while the storage lives (a weakref finalizer takes it off when the storage is freed), and each
device's peak is kept. So a Llama-3.1-8B load, a 128K-token KV cache or a prefill can be measured on a laptop, with
the code that runs on the GPU.

    with fake_memory() as ledger:
        state = fake_state(checkpoint_shapes(hf_config), torch.bfloat16)  # the host's copy of a checkpoint
        ledger.reset_peaks()
        model = model_from_state(state, hf_config, options, checkpoint)
        ledger.peak(DEVICE), ledger.live(DEVICE), ledger.live("cpu")

Page-locked host memory is counted by offload.pinned_bytes, which works without CUDA too; the weight and KV streams
need a queue without CUDA streams (offload.HostQueue: monkeypatch offload.weights.queue_for and offload.kv.queue_for).

Limits: only what ops create while the ledger is active counts (not tensors made before it, nor real tensors the
fake mode converts); a storage resized in place keeps the size it was created with; CUDA's caching allocator and
its rounding are not modelled (the bytes are those the tensors ask for). On a CPU-only torch build, fake 'cuda'
tensors pass factories, ``.to``, views and arithmetic, which go straight to the dispatcher, but Python bindings
that first set a CUDA device guard (tensor indexing ``t[...]``, ``copy_``, ``.contiguous()`` of a strided tensor)
raise "PyTorch is not linked with support for cuda devices", and some ops on them abort the process: code that
computes on the device (a prefill writing a cache by index) needs torch built with CUDA, a GPU or not.
"""

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, PretrainedConfig

DEVICE = torch.device("cuda", 0)  # the fake GPU


class MemoryLedger(TorchDispatchMode):
    """Live and peak bytes per device ('cpu', 'cuda:0', ...) of the storages ops allocate while it is active."""

    def __init__(self):
        super().__init__()
        self.live_bytes: Counter[str] = Counter()
        self.peak_bytes: Counter[str] = Counter()
        self._counted: set[int] = set()  # ids of the live storages counted (a live storage keeps its Python object)

    def live(self, device: torch.device | str) -> int:
        """Bytes allocated on device and not freed yet."""
        return self.live_bytes[str(device)]

    def peak(self, device: torch.device | str) -> int:
        """The most bytes live on device at once since the ledger started or reset_peaks."""
        return self.peak_bytes[str(device)]

    def reset_peaks(self) -> None:
        """Start each device's peak again from what is live now."""
        self.peak_bytes = Counter(self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in inputs:
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._counted:
            return
        device, nbytes = str(tensor.device), storage.nbytes()
        self._counted.add(key)
        self.live_bytes[device] += nbytes
        self.peak_bytes[device] = max(self.peak_bytes[device], self.live_bytes[device])
        weakref.finalize(storage, self._free, key, device, nbytes)

    def _free(self, key: int, device: str, nbytes: int) -> None:
        self._counted.discard(key)
        self.live_bytes[device] -= nbytes


@contextmanager
def fake_memory() -> Iterator[MemoryLedger]:
    """Run the block on fake tensors (real tensors it meets become fake), counting their memory in the ledger
    yielded."""
    with FakeTensorMode(allow_non_fake_inputs=True), MemoryLedger() as ledger:
        yield ledger


def checkpoint_shapes(hf_config: PretrainedConfig) -> dict[str, torch.Size]:
    """The shape of each tensor a Hugging Face checkpoint of this config holds, by name (from transformers' own
    model of it, built on the meta device: no memory)."""
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tensor.shape for name, tensor in reference.state_dict().items()}
    if hf_config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # one tensor, which the checkpoint stores once, as the embedding
    return shapes


def fake_state(shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A checkpoint's state as the loader reads it into host memory, fake: call it inside fake_memory."""
    return {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
