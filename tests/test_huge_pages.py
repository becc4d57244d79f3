"""Weights and KV caches on huge pages (kernels/memory.py, runtime.loading.keep_on_huge_pages): where they start,
that they are advised to take huge pages, and that moving a model there changes no bit of what it computes."""

import pytest
import torch
from helpers import make_model
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache
from triforce_cli.kernels.memory import (
    ALIGNMENT,
    HUGE_PAGE,
    huge_page_bytes,
    huge_page_zeros,
    huge_pages_available,
    onto_huge_pages,
)

from triforce_cli.runtime import loading
from triforce_cli.runtime.loading import keep_on_huge_pages, tensor_places

needs_huge_pages = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this machine")


def advised_for_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether every mapping that holds tensor's memory was advised to take huge pages (its VmFlags in
    /proc/self/smaps hold "hg", set by madvise(MADV_HUGEPAGE)): what this process asks for. Whether the kernel then
    finds free 2 MiB pages depends on the machine's memory at that moment, so the tests do not ask it."""
    begin, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    flags, overlap = [], False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                overlap = low < end and high > begin
            elif overlap and fields[0] == "VmFlags:":
                flags.append("hg" in fields[1:])
    return bool(flags) and all(flags)


@needs_huge_pages
def test_a_buffer_of_huge_pages_starts_on_one_and_is_advised_to_take_them():
    zeros = huge_page_zeros((3, 1024, 1024), torch.float32)  # 12 MiB
    assert zeros.shape == (3, 1024, 1024) and zeros.dtype == torch.float32
    assert zeros.data_ptr() % HUGE_PAGE == 0
    assert not zeros.any()
    assert advised_for_huge_pages(zeros)
    assert not advised_for_huge_pages(torch.zeros(3, 1024, 1024))


@needs_huge_pages
def test_weights_copied_side_by_side_are_advised_to_take_huge_pages():
    copies = onto_huge_pages([torch.ones(1 << 20) for _ in range(5)])  # 20 MiB of 4 MiB tensors
    assert all(bool((copy == 1).all()) and advised_for_huge_pages(copy) for copy in copies)


def test_a_buffer_under_a_huge_page_is_a_plain_one():
    small = huge_page_bytes(HUGE_PAGE - 1)
    assert small.numel() == HUGE_PAGE - 1 and small.untyped_storage().nbytes() == HUGE_PAGE - 1


def test_huge_page_zeros_off_the_cpu_are_torch_zeros():
    zeros = huge_page_zeros((2, 3), torch.float16, "meta")
    assert zeros.device.type == "meta" and zeros.shape == (2, 3) and zeros.dtype == torch.float16


def test_copies_side_by_side_hold_the_same_values_each_on_a_cache_line():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),
        torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        torch.randn(4, 4, generator=g).half(),
        torch.tensor(2.5),
    ]
    copies = onto_huge_pages(tensors)
    storage = copies[0].untyped_storage().data_ptr()
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape
        assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
        assert copy.data_ptr() % ALIGNMENT == 0
        assert copy.untyped_storage().data_ptr() == storage  # one buffer


@pytest.mark.parametrize("group", [1, 4096, 16 << 20])
def test_a_model_on_huge_pages_computes_the_same_bits(group, monkeypatch):
    """keep_on_huge_pages in groups of one tensor, a few, or all: the logits equal the model's before the move bit
    for bit, every weight is a new copy, a Parameter stays one, and the tied embedding stays one tensor."""
    monkeypatch.setattr(loading, "HUGE_PAGE_GROUP", group)
    monkeypatch.setattr(loading, "huge_pages_available", lambda: True)
    model = make_model(seed=3, tie_word_embeddings=True).model
    ids = torch.tensor([1, 5, 9, 2, 7])
    cache = FullCache(model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, 16, torch.float32)
    with torch.inference_mode():
        before = model(ids, 0, cache)
    cache.reset()
    old = {id(getattr(*places[0])): getattr(*places[0]) for places in tensor_places(model)}
    keep_on_huge_pages(model)
    with torch.inference_mode():
        after = model(ids, 0, cache)
    assert torch.equal(before, after)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for places in tensor_places(model):
        tensor = getattr(*places[0])
        assert id(tensor) not in old
        assert all(getattr(module, name) is tensor for module, name in places)
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert (len(storages) == 1) == (group == 16 << 20)


def test_a_view_of_a_larger_storage_stays_where_it_is(monkeypatch):
    monkeypatch.setattr(loading, "huge_pages_available", lambda: True)
    model = make_model(seed=3).model
    whole = torch.arange(10.0)
    model.register_buffer("part", whole[2:5])
    keep_on_huge_pages(model)
    assert model.part.data_ptr() == whole[2:].data_ptr()


@needs_huge_pages
def test_the_caches_keys_and_values_start_on_huge_pages():
    full = FullCache(2, 2, 64, 8192, torch.float16)  # 2 MiB per buffer
    retrieval = RetrievalCache(full, 4096, 64, 4096)
    streaming = StreamingCache(2, 2, 64, 4, 8188, 4, torch.float16)
    for cache in (full, retrieval, streaming):
        for buffer in (cache.keys, cache.values):
            assert buffer.data_ptr() % HUGE_PAGE == 0 and not buffer.any()
