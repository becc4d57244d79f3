"""The full KV cache offloaded to host memory (offload/): the same tokens as on the device, and the copies in an
order a GPU can overlap, checked with a queue that defers every copy until something waits for it, and counted
(CountingQueue): the prefill, layer by layer, moves each layer's keys and values across once."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from helpers import load_tiny, make_model, random_prompt, save_word_checkpoint, small_config
from triforce_cli.cache import FullCache, RetrievalCache
from triforce_cli.kernels import chunk_summaries, gather_chunks, half_weights_available, summary_scores, top_chunks
from triforce_cli.offload import HostQueue, offload_kv
from triforce_cli.offload.kv import TAIL_POSITIONS

from triforce_cli.decoding import cache_pool, sizing
from triforce_cli.decoding.config import MODES, EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.forms import StepMode
from triforce_cli.runtime.loading import BuildOptions

PROMPT = 64


class DeferredQueue(HostQueue):
    """A copy stream that runs its copies, in order, only when a wait or settle needs them: what a GPU's side
    stream does at its own pace. Compute runs at once. A read of a slot before waiting for its copy, or a copy
    whose source changed before it ran, gives different numbers."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.issued = 0
        self.done = 0
        self.settles = 0  # waits of the host for the copy stream
        self.log: list[tuple] = []

    def record(self, stream: str):
        return (stream, self.issued)

    def wait(self, stream: str, event) -> None:
        self.log.append(("wait", stream, event))
        if stream == "compute" and event[0] == "copy":
            self._run(event[1])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", dst.data_ptr(), src.data_ptr()))
        self.pending.append((dst, src))
        self.issued += 1

    def settle(self) -> None:
        self.settles += 1
        self._run(self.issued)

    def _run(self, until: int) -> None:
        while self.done < until:
            dst, src = self.pending[self.done - (self.issued - len(self.pending))]
            dst.copy_(src)
            self.done += 1
        self.pending = self.pending[len(self.pending) - (self.issued - self.done) :]


class CountingQueue(DeferredQueue):
    """A DeferredQueue that also keeps, for every copy, the storages it writes and reads and its bytes."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[int, int, int]] = []  # (destination storage, source storage, bytes)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append((dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(), dst.nbytes))
        super().copy(dst, src)

    def moved(self, full: FullCache) -> tuple[int, int, int]:
        """Bytes copied from full's host storage to the device, bytes copied back to it, and how many copies back."""
        host = {full.keys.untyped_storage().data_ptr(), full.values.untyped_storage().data_ptr()}
        fetched = sum(size for dst, src, size in self.copies if src in host and dst not in host)
        back = [size for dst, src, size in self.copies if dst in host and src not in host]
        return fetched, sum(back), len(back)


def counting_queues(monkeypatch) -> list[CountingQueue]:
    """The copy queues the offloaded KV cache makes from now on (offload.kv.queue_for), each a CountingQueue, in
    the order it makes them."""
    queues = []
    monkeypatch.setattr(
        "triforce_cli.offload.kv.queue_for", lambda device: queues.append(CountingQueue()) or queues[-1]
    )
    return queues


def tiny_model():
    return make_model(seed=5, vocab_size=64, num_layers=4, initializer_range=0.3, tie_word_embeddings=False)


def loaded_model():
    return tiny_model().loaded


def streamed_model(resident_layers: int, weights: str = "dense"):
    """loaded_model()'s weights loaded as for --offload kv+weights: the layers from resident_layers on streamed."""
    options = BuildOptions(torch.device("cpu"), weights=weights, offload_weights=True, resident_layers=resident_layers)
    return load_tiny(tiny_model(), options)


def config(mode: str, sampling: SamplingConfig, **changes) -> EngineConfig:
    """Prefill chunks of 24 tokens: a 64-token prompt is three forwards, the last shorter, or three per layer."""
    return small_config(mode=mode, sampling=sampling, gamma_policy="fixed", **{"prefill_block": 24, **changes})


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
@pytest.mark.parametrize("on_chip_layers", [0, 1, 4])
def test_offloaded_generation_gives_the_tokens_of_the_device_cache(sampling, on_chip_layers, monkeypatch):
    """Some layers streamed, or (all 4 on chip) none: then nothing is offloaded, the cache is the device's."""
    monkeypatch.setattr("triforce_cli.offload.kv.queue_for", lambda device: DeferredQueue())
    model = loaded_model()
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(model, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(model, config(mode, sampling, offload="kv", on_chip_layers=on_chip_layers))
        assert engine.generate(prompt).token_ids == expected, mode
        assert (engine._caches.full.stream is None) == (on_chip_layers == model.model.config.num_layers)


def test_on_chip_layers_are_refused_without_an_offloaded_cache():
    """Layers kept on the device mean something only where the rest of the cache is offloaded."""
    with pytest.raises(ConfigError, match="`on_chip_layers` keeps layers of an offloaded KV cache on the device"):
        EngineConfig(on_chip_layers=2)
    for offload in ("kv", "kv+weights"):
        assert EngineConfig(offload=offload, on_chip_layers=2).on_chip_layers == 2


def test_offload_with_every_layer_on_chip_keeps_nothing_in_host_memory_and_runs_fixed_shape_steps():
    """--offload kv whose on-chip layers are all of them offloads nothing: the plan holds no host bytes and the same
    device bytes as no offload, and the full cache is made static, so its steps are recorded as graphs."""
    model = tiny_model().loaded
    model.model.use_steps(StepMode.GRAPHS)
    plain = Engine(model, config("triforce", SamplingConfig(temperature=0)))
    every = Engine(model, config("triforce", SamplingConfig(temperature=0), offload="kv", on_chip_layers=4))
    assert every.memory_plan(PROMPT) == plain.memory_plan(PROMPT)
    prompt = random_prompt(PROMPT, 64, seed=3)
    assert every.generate(prompt).token_ids == plain.generate(prompt).token_ids
    full = every._caches.full
    assert full.stream is None and full.write_start is not None
    assert model.model.step_graphs.holds(full, 1)


def test_each_offloaded_layer_is_fetched_once_per_forward_and_waited_for_before_it_is_read():
    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    queue = DeferredQueue()
    stream = offload_kv(full, torch.device("cpu"), on_chip_layers=1, queue=queue)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    prompt = torch.tensor(random_prompt(PROMPT, 64, seed=4))
    torch.testing.assert_close(model(prompt, 0, full), model(prompt, 0, reference))
    full.settle()  # the prompt in the host storage: each later forward fetches it from there
    layer_of = {full.keys[layer, head].data_ptr(): layer for layer in range(cfg.num_layers) for head in range(2)}
    slot_of = {stream.ring_keys[slot, head].data_ptr(): slot for slot in range(2) for head in range(2)}
    for start in (PROMPT, PROMPT + 3):
        queue.log.clear()
        tokens = torch.tensor([1, 2, 3])
        torch.testing.assert_close(model(tokens, start, full), model(tokens, start, reference))
        fetched = [
            (layer_of[entry[2]], slot_of[entry[1]])
            for entry in queue.log
            if entry[0] == "copy" and entry[2] in layer_of and entry[1] in slot_of
        ]  # one copy per KV head and layer
        assert fetched == [(1, 0), (1, 0), (2, 1), (2, 1), (3, 0), (3, 0)]  # layers 1-3 once, the slots in turn
        # a deferred copy runs only when waited for: the logits above equal the reference's only if every layer
        # waited for its own copy before reading its slot, and no copy read a source changed after it was queued
    full.settle()
    held = slice(0, PROMPT + 6)
    torch.testing.assert_close(full.keys[:, :, held], reference.keys[:, :, held])
    tail = 2 * 128 * full.keys[:, :, 0].nbytes  # keys and values of every layer at min(TAIL_POSITIONS, 128) positions
    assert stream.device_bytes == (1 + 2) * 2 * full.keys[0].nbytes + tail


def storages(*tensors: torch.Tensor) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in tensors}


@pytest.mark.parametrize("on_chip_layers", [0, 1, 4])
def test_a_step_copies_nothing_back_to_the_host_until_a_reader_settles(on_chip_layers, monkeypatch):
    """Steps of 3 tokens after a 64-token prompt: no copy writes the host storage and the host waits for nothing
    (no .item(), .tolist() or synchronisation), with every layer on the chip or some streamed; settle() then writes
    the steps' positions back in one copy per tensor, into the stream's pinned buffer, which the host scatters into
    the storage. The numbers are the device cache's."""
    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    queue = CountingQueue()
    stream = offload_kv(full, torch.device("cpu"), on_chip_layers=on_chip_layers, queue=queue)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    prompt = torch.tensor(random_prompt(PROMPT, 64, seed=4))
    torch.testing.assert_close(model(prompt, 0, full), model(prompt, 0, reference))
    full.settle()
    queue.copies.clear()
    settles = queue.settles
    host = storages(full.keys, full.values)
    with monkeypatch.context() as step:
        for name in ("item", "tolist"):
            step.setattr(torch.Tensor, name, lambda *args, name=name: pytest.fail(f"a step called .{name}()"))
        step.setattr(torch.cuda, "synchronize", lambda *args: pytest.fail("a step synchronised the device"))
        for start in (PROMPT, PROMPT + 3, PROMPT + 6):
            tokens = torch.tensor([1, 2, 3])
            torch.testing.assert_close(model(tokens, start, full), model(tokens, start, reference))
    assert [copy for copy in queue.copies if copy[0] in host] == [] and queue.settles == settles
    queue.copies.clear()
    full.settle()
    back = [(dst, size) for dst, src, size in queue.copies]
    positions = 3 * 3 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # bytes of 9 positions, every layer
    assert back == [(storages(stream.flushed).pop(), positions)] * 2  # the keys, the values
    held = slice(0, PROMPT + 9)
    assert torch.equal(full.keys[:, :, held], reference.keys[:, :, held])
    assert torch.equal(full.values[:, :, held], reference.values[:, :, held])


def test_a_write_longer_than_the_tail_goes_back_at_once_and_a_full_tail_is_flushed_first():
    """A tail of 4 positions: the 64-token prompt's forward writes each layer back as it ends (one copy per KV head
    and tensor), a 3-token step waits in the tail, and the next one, which would overflow it, first flushes it (one
    copy per tensor into the pinned buffer). The numbers are the device cache's throughout."""
    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    queue = CountingQueue()
    stream = offload_kv(full, torch.device("cpu"), on_chip_layers=1, queue=queue, tail_positions=4)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32)
    host, flushed = storages(full.keys, full.values), storages(stream.flushed)
    written = []  # per forward: (copies into the storage, copies into the flush buffer)
    for start, tokens in ((0, random_prompt(PROMPT, 64, seed=4)), (PROMPT, [1, 2, 3]), (PROMPT + 3, [4, 5, 6])):
        queue.copies.clear()
        tokens = torch.tensor(tokens)
        torch.testing.assert_close(model(tokens, start, full), model(tokens, start, reference))
        written.append(
            (sum(dst in host for dst, _, _ in queue.copies), sum(dst in flushed for dst, _, _ in queue.copies))
        )
    assert written == [(2 * cfg.num_layers * cfg.num_kv_heads, 0), (0, 0), (0, 2)]
    full.settle()
    held = slice(0, PROMPT + 6)
    assert torch.equal(full.keys[:, :, held], reference.keys[:, :, held])
    assert torch.equal(full.values[:, :, held], reference.values[:, :, held])


def kv_bytes(full: FullCache, positions: int) -> int:
    """Bytes of the keys and values of every layer at that many positions."""
    num_layers, num_kv_heads, _, head_dim = full.keys.shape
    return 2 * num_layers * num_kv_heads * positions * head_dim * full.keys.element_size()


@pytest.mark.parametrize("on_chip_layers", [0, 1])
def test_an_offloaded_prefill_moves_each_layer_across_once_and_gives_the_device_caches_numbers(
    on_chip_layers, monkeypatch
):
    """A 128-token prompt in 8 chunks of 16, 4 layers: nothing of the prompt is fetched from the host (every layer
    holds its keys and values on the device while all its chunks run), and each layer's keys and values go back once,
    in one copy per layer, tensor and KV head. Chunk by chunk, every chunk fetched the prefix of every offloaded
    layer (114,688 bytes here with no layer on chip) and copied each chunk back apart (64 copies per layer). The
    keys, values, queries and logits are the device cache's, bit for bit (the same forwards, in another order)."""
    queues = counting_queues(monkeypatch)
    model, prompt, chunk = loaded_model(), random_prompt(128, 64, seed=6), 16
    greedy = SamplingConfig(temperature=0)
    expected = Engine(model, config("triforce", greedy, prefill_block=chunk)).prefill(prompt)
    engine = Engine(model, config("triforce", greedy, prefill_block=chunk, offload="kv", on_chip_layers=on_chip_layers))
    progress, chunk_seconds = [], []
    state = engine.prefill(prompt, lambda name, done, total: progress.append((done, total)), chunk_seconds.append)
    full = engine._caches.full
    fetched, back, copies_back = queues[0].moved(full)
    num_layers, num_kv_heads = full.keys.shape[:2]
    assert (fetched, back, copies_back) == (0, kv_bytes(full, 128), num_layers * 2 * num_kv_heads)
    assert back == 32_768  # 128 positions of float16 keys and values (cache.kv_dtype on the CPU)
    assert torch.equal(state.last_logits, expected.last_logits)
    assert torch.equal(state.keys, expected.keys) and torch.equal(state.values, expected.values)
    assert torch.equal(state.last_queries, expected.last_queries)
    assert progress == [(128 * layers // num_layers, 128) for layers in range(1, num_layers + 1)]
    assert len(chunk_seconds) == 128 // chunk


def test_a_prefill_short_of_device_memory_runs_in_segments_each_fetching_the_ones_before_it_once(monkeypatch):
    """Room for the hidden states of 32 tokens: four segments of two chunks, each later one fetching the prompt
    before it once per layer (0 + 32 + 64 + 96 positions), and the same numbers as the device cache's."""
    import triforce_cli.decoding.prefill as prefill_module

    queues = counting_queues(monkeypatch)
    model, prompt, chunk = loaded_model(), random_prompt(128, 64, seed=6), 16
    greedy = SamplingConfig(temperature=0)
    expected = Engine(model, config("triforce", greedy, prefill_block=chunk)).prefill(prompt)
    engine = Engine(model, config("triforce", greedy, prefill_block=chunk, offload="kv"))
    full = engine._allocate(len(prompt)).full
    room = 2 * model.model.prefill_layerwise_bytes(32)  # the prefill takes half the free memory
    monkeypatch.setattr(prefill_module, "available_memory", lambda device: room)
    progress = []
    state = engine.prefill(prompt, lambda name, done, total: progress.append(done))
    fetched, back, copies_back = queues[0].moved(full)
    assert (fetched, back) == (kv_bytes(full, 0 + 32 + 64 + 96), kv_bytes(full, 128))
    assert copies_back == 4 * full.keys.shape[0] * 2 * full.keys.shape[1]
    assert torch.equal(state.last_logits, expected.last_logits) and torch.equal(state.keys, expected.keys)
    assert progress == sorted(progress) and progress[-1] == 128 and len(progress) == 4 * full.keys.shape[0]


@pytest.mark.parametrize("score", ["mean", "bound"])
@pytest.mark.parametrize("on_chip_layers", [0, 1])
def test_an_offloaded_prefill_summarises_its_chunks_on_the_device(score, on_chip_layers, monkeypatch):
    """Each layer's chunk summaries are computed from its keys on the device (its ring slot or on-chip buffers) as
    the layer-wise prefill ends the layer, so the first selection averages no keys; the summaries are those of the
    host keys and of the device cache, bit for bit here, where the same arithmetic runs on the same numbers (on a
    GPU the device's own reductions round them)."""
    model, prompt, chunk = loaded_model(), random_prompt(128, 64, seed=6), 16
    greedy = SamplingConfig(temperature=0)
    expected = Engine(model, config("triforce", greedy, prefill_block=chunk, chunk_score=score))
    expected.prefill(prompt)
    expected._caches.retrieval.select_chunks()  # summarising the prompt's chunks from the device cache's keys
    summarised = []  # the storage of the keys of every summary computed
    real = chunk_summaries
    monkeypatch.setattr(
        "triforce_cli.cache.retrieval.chunk_summaries",
        lambda keys, *rest: summarised.append(keys.untyped_storage().data_ptr()) or real(keys, *rest),
    )
    offloaded = config("triforce", greedy, prefill_block=chunk, chunk_score=score, offload="kv")
    engine = Engine(model, replace(offloaded, on_chip_layers=on_chip_layers))
    engine.prefill(prompt)
    full, retrieval = engine._caches.full, engine._caches.retrieval
    retrieval.select_chunks()
    stream = full.stream
    assert summarised == [*storages(stream.chip_keys)] * on_chip_layers + [*storages(stream.ring_keys)] * (
        full.keys.shape[0] - on_chip_layers
    )
    complete = 128 // retrieval.chunk_size
    full.settle()
    for layer in range(full.keys.shape[0]):
        from_host = real(full.keys[layer, :, : complete * retrieval.chunk_size], retrieval.chunk_size, score)
        for summary_keys, summary in zip(retrieval.chunk_keys, from_host, strict=True):
            assert torch.equal(summary_keys[layer, :, :complete], summary.to(summary_keys.dtype))
    assert retrieval.num_mean_keys == complete
    on_device = expected._caches.retrieval
    assert torch.equal(retrieval.chunk_keys[:, :, :, :complete], on_device.chunk_keys[:, :, :, :complete])
    assert torch.equal(retrieval.chunk_ids, on_device.chunk_ids)


def test_every_copy_between_host_and_device_reads_or_writes_pinned_host_memory(monkeypatch):
    """A generation offloaded as on a CUDA device, its pinning counted (pin_exactly counts what it would lock where
    CUDA is absent): the storage, the stream's buffer for the tail and the retrieval cache's staging are pinned,
    and every copy of the queue has a pinned host side, or runs from one device buffer to another."""
    monkeypatch.setattr("triforce_cli.offload.kv.pins_for", lambda device: True)
    pinned = set()
    monkeypatch.setattr("triforce_cli.offload.kv.pin_exactly", lambda tensor: pinned.update(storages(tensor)) or tensor)
    queues = counting_queues(monkeypatch)
    engine = Engine(loaded_model(), config("triforce", SamplingConfig(temperature=0), offload="kv", on_chip_layers=1))
    engine.generate(random_prompt(PROMPT, 64, seed=3))
    full, retrieval = engine._caches.full, engine._caches.retrieval
    stream = full.stream
    assert storages(full.keys, full.values, stream.flushed, retrieval.staging) <= pinned
    device = storages(stream.chip_keys, stream.chip_values, stream.ring_keys, stream.ring_values, stream.tail)
    device |= storages(retrieval.keys, retrieval.values)
    copies = queues[0].copies
    assert copies and all(dst in pinned or src in pinned or {dst, src} <= device for dst, src, _ in copies)


def per_layer_selection(retrieval: RetrievalCache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference: the selection layer by layer, as the retrieval cache made it before it served every layer at
    once. Returns the chunk ids (layers, Hkv, keep) and the chosen keys and values (layers, Hkv, budget, D)."""
    full, chunk = retrieval.full, retrieval.chunk_size
    full.settle()
    complete = full.length // chunk
    ids, keys, values = [], [], []
    for layer in range(full.keys.shape[0]):
        query = full.query_at(layer, full.length - 1)
        scores = summary_scores(query, retrieval.chunk_keys[:, layer, :, :complete], retrieval.score)
        ids.append(top_chunks(scores, retrieval.budget // chunk))
        keys.append(gather_chunks(full.keys[layer], ids[-1], chunk))
        values.append(gather_chunks(full.values[layer], ids[-1], chunk))
    return torch.stack(ids), torch.stack(keys), torch.stack(values)


@pytest.mark.parametrize("score", ["mean", "bound"])
@pytest.mark.parametrize("offloaded", [False, True])
@pytest.mark.parametrize("score_block_bytes", [1, None])
def test_selecting_every_layer_at_once_gives_the_per_layer_selection(score, offloaded, score_block_bytes, monkeypatch):
    """The same chunk ids and cache contents as layer by layer (score_block_bytes 1: the scores one layer per op),
    on the device and offloaded, where every layer's chosen chunks and recent positions go up through the queue:
    one contiguous copy per layer, KV head and tensor, each after the copies back it reads. The positions a step
    wrote since are still on the device: sync_recent copies them there, uploading nothing."""
    if score_block_bytes is not None:
        monkeypatch.setattr("triforce_cli.kernels.retrieval.SCORE_BLOCK_BYTES", score_block_bytes)
    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32)
    queue = CountingQueue()
    if offloaded:
        offload_kv(full, torch.device("cpu"), on_chip_layers=1, queue=queue)
    model(torch.tensor(random_prompt(100, 64, seed=7)), 0, full)
    retrieval = RetrievalCache(full, budget=32, chunk_size=8, recent_capacity=32, score=score)
    assert (retrieval.staging is not None) == offloaded
    retrieval.select_chunks()
    ids, keys, values = per_layer_selection(retrieval)
    assert torch.equal(retrieval.chunk_ids, ids)
    assert torch.equal(retrieval.keys[:, :, :32], keys) and torch.equal(retrieval.values[:, :, :32], values)
    model(torch.tensor([1, 2, 3]), 100, full)
    retrieval.sync_recent()
    full.settle()
    recent = slice(32, 32 + 7)  # positions 96-102: 4 of the prompt's last, incomplete chunk and the 3 new
    assert torch.equal(retrieval.keys[:, :, recent], full.keys[:, :, 96:103])
    assert torch.equal(retrieval.values[:, :, recent], full.values[:, :, 96:103])
    targets = {retrieval.keys.untyped_storage().data_ptr(), retrieval.values.untyped_storage().data_ptr()}
    uploads = [size for dst, _, size in queue.copies if dst in targets]
    per_copy = cfg.head_dim * 4  # bytes of one position of one KV head
    expected = [32 * per_copy] * 2 * cfg.num_layers * cfg.num_kv_heads  # the selection, one copy per layer and head
    expected += [4 * per_copy] * 2 * cfg.num_layers * cfg.num_kv_heads  # its recent positions
    assert uploads == (expected if offloaded else [])


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
def test_streamed_weights_give_the_tokens_of_the_resident_model(sampling, monkeypatch):
    """--offload kv+weights: layers 1-3 of 4 stream their weights and KV cache through the deferred queue."""
    monkeypatch.setattr("triforce_cli.offload.kv.queue_for", lambda device: DeferredQueue())
    monkeypatch.setattr("triforce_cli.offload.weights.queue_for", lambda device: DeferredQueue())
    resident, streamed = loaded_model(), streamed_model(resident_layers=1)
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(resident, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(streamed, config(mode, sampling, offload="kv+weights", on_chip_layers=1))
        assert engine.generate(prompt).token_ids == expected, mode
    stream = streamed.model.weight_stream
    assert sorted(stream.host) == [1, 2, 3] and len(stream.slots) == 2
    plan = engine.memory_plan(PROMPT)
    assert plan.bytes_of("streamed weights") == 3 * stream.layer_bytes == stream.host_bytes
    assert plan.bytes_of("weight ring") == 2 * stream.layer_bytes


@pytest.mark.skipif(not half_weights_available(), reason="half weights need fbgemm")
def test_streamed_weights_must_be_dense():
    with pytest.raises(ConfigError, match="kv\\+weights: streamed weights must be dense"):
        streamed_model(resident_layers=1, weights="half")


def test_streamed_weights_run_eager_steps(tmp_path):
    with pytest.raises(ConfigError, match="`offload` kv\\+weights runs eager steps: use `steps` eager"):
        Pipeline.load(
            LoadOptions(target=str(save_word_checkpoint(tmp_path / "words")), device="cpu", steps="compiled"),
            config=EngineConfig(offload="kv+weights"),
        )


def test_streamed_weights_are_chosen_at_load():
    with pytest.raises(ConfigError, match="kv\\+weights needs a target loaded with its weights streamed"):
        Engine(loaded_model(), config("triforce", SamplingConfig(), offload="kv+weights"))


def test_a_restored_prompt_refills_the_on_chip_layers():
    model = loaded_model()
    prompt = random_prompt(PROMPT, 64, seed=3)
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy, offload="kv", on_chip_layers=2))
    saved = []
    expected = engine.generate(prompt, on_prompt_state=saved.append).token_ids
    state: PromptState = saved[0]
    assert (
        Engine(model, config("triforce", greedy, offload="kv", on_chip_layers=2))
        .generate(prompt, prompt_state=state)
        .token_ids
        == expected
    )


def test_the_memory_plan_puts_the_full_cache_in_host_memory():
    model = loaded_model()
    on_device = Engine(model, config("triforce", SamplingConfig())).memory_plan(PROMPT)
    offloaded = Engine(model, config("triforce", SamplingConfig(), offload="kv", on_chip_layers=1)).memory_plan(PROMPT)
    full = on_device.bytes_of("full KV cache")
    staging = offloaded.bytes_of("retrieval staging")  # every layer's chosen chunks, gathered beside the storage
    cfg = model.model.config
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # float16 (cache.kv_dtype on the CPU)
    # the positions not yet written back, on the device and as their pinned twin on the host
    tail = min(TAIL_POSITIONS, full // per_position) * per_position
    assert on_device.host_bytes == 0 and offloaded.host_bytes == full + tail + staging and full > 0
    budget = config("triforce", SamplingConfig()).budget_for(PROMPT)
    assert staging == budget * per_position
    per_layer = full // cfg.num_layers
    assert offloaded.device_bytes == on_device.device_bytes - full + (1 + 2) * per_layer + tail


def test_offloaded_caches_that_cannot_fit_the_host_are_one_clear_error(monkeypatch):
    monkeypatch.setattr(sizing, "available_memory", lambda device: 10_000 if device.type == "cpu" else None)
    engine = Engine(loaded_model(), config("triforce", SamplingConfig(), offload="kv"))
    with pytest.raises(ConfigError, match=r"on cpu, which has 9.8 KiB free"):
        engine.generate(random_prompt(PROMPT, 64, seed=3))


def test_an_unknown_offload_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown offload 'weights'"):
        EngineConfig(offload="weights")


def test_generate_prints_the_memory_plan_and_offloads_on_request(tmp_path):
    from helpers import save_word_checkpoint
    from typer.testing import CliRunner

    from triforce_cli.cli.app import app
    from triforce_cli.cli.console import NOTE_INDENT

    folder = save_word_checkpoint(tmp_path / "words")
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(f"w{i % 31}" for i in range(40)))
    runs = {}
    for offload in ("none", "kv", "kv+weights"):
        args = ["generate", "-p", str(prompt), "--target", str(folder), "--temperature", "0", "--max-new-tokens", "12"]
        on_chip = () if offload == "none" else ("--on-chip-layers", "1")
        result = CliRunner().invoke(app, [*args, "--offload", offload, *on_chip])
        assert result.exit_code == 0, result.output
        runs[offload] = result
    assert runs["kv"].stdout == runs["kv+weights"].stdout == runs["none"].stdout
    notes = {
        offload: result.stderr.replace("\n" + NOTE_INDENT, " ").splitlines()[0] for offload, result in runs.items()
    }
    assert "host" not in notes["none"]  # the memory note, its wrapped lines joined
    assert notes["kv"].startswith("memory: cpu ") and "full KV cache" in notes["kv"].split("host ")[1]
    assert "streamed weights" in notes["kv+weights"].split("host ")[1]  # loaded streamed: layer 1 of 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=2)])
def test_offloaded_generation_on_a_gpu_gives_the_tokens_of_the_device_cache(sampling):
    """Real CUDA streams and events, host storage in pinned memory."""
    model = loaded_model()
    model.model.to("cuda")
    prompt = random_prompt(PROMPT, 64, seed=3)
    for mode in MODES:
        expected = Engine(model, config(mode, sampling)).generate(prompt).token_ids
        engine = Engine(model, config(mode, sampling, offload="kv", on_chip_layers=1))
        assert engine.generate(prompt).token_ids == expected, mode
        assert engine._caches.full.keys.is_pinned() and engine._caches.full.stream.flushed.is_pinned()
        if engine._caches.retrieval is not None:
            assert engine._caches.retrieval.staging.is_pinned()


BUCKET = 16  # positions a fixed-shape step streams are rounded up to a multiple of, in the tests below


def recorded_engine(mode: str, steps: StepMode, monkeypatch, **changes) -> tuple[Engine, list[int]]:
    """An engine of loaded_model() offloading its full cache with one layer on chip, its steps taken as steps say
    ('compiled' by aot_eager), length buckets of BUCKET positions, a tail of 16 positions and deferred copies; and
    its greedy tokens after a 64-token prompt, 40 of them (positions 64-104: three buckets, the tail flushed)."""
    monkeypatch.setattr("triforce_cli.offload.kv.BUCKET_POSITIONS", BUCKET)
    monkeypatch.setattr("triforce_cli.offload.kv.queue_for", lambda device: DeferredQueue())
    monkeypatch.setattr(cache_pool, "offload_kv", partial(offload_kv, tail_positions=16))
    model = loaded_model()
    if steps != StepMode.EAGER:
        model.model.use_steps(steps, backend="aot_eager")
    settings = {"offload": "kv", "on_chip_layers": 1, "max_new_tokens": 40, **changes}
    engine = Engine(model, config(mode, SamplingConfig(temperature=0), **settings))
    return engine, engine.generate(random_prompt(PROMPT, 64, seed=3)).token_ids


@pytest.mark.parametrize(
    ("mode", "steps"), [*((mode, StepMode.GRAPHS) for mode in MODES), ("triforce", StepMode.COMPILED)]
)
def test_recorded_steps_on_an_offloaded_cache_give_the_eager_tokens_across_length_buckets(mode, steps, monkeypatch):
    """Greedy: an offloaded full cache with layers streamed takes fixed-shape steps, recorded per (padded length,
    length bucket), and gives the eager steps' tokens while its length passes from one bucket into the next two
    (the tail flushed on the way)."""
    _, expected = recorded_engine(mode, StepMode.EAGER, monkeypatch)
    engine, tokens = recorded_engine(mode, steps, monkeypatch)
    assert tokens == expected
    full = engine._caches.full
    assert full.stream is not None and full.write_start is not None
    buckets = {slots for _, slots in engine.target.model.step_graphs.recorded(full)}
    assert buckets == {80, 96, 112} or (mode != "autoregressive" and buckets >= {80, 112}), buckets


def test_an_offloaded_cache_records_its_steps_after_the_prefill_and_once_per_bucket(monkeypatch):
    """Autoregressive decoding on an offloaded cache: nothing of the full cache is recorded before the prompt's
    first token (its bucket follows the prompt's length), its one step at the prompt's bucket is recorded before
    the first decode step (the warm-up after the prefill), and one more as the length enters each next bucket."""
    monkeypatch.setattr("triforce_cli.offload.kv.BUCKET_POSITIONS", BUCKET)
    model = loaded_model()
    model.model.use_steps(StepMode.GRAPHS)
    settings = {"offload": "kv", "on_chip_layers": 1, "max_new_tokens": 40}
    engine = Engine(model, config("autoregressive", SamplingConfig(temperature=0), **settings))
    graphs = model.model.step_graphs
    counted = []
    engine.generate(
        random_prompt(PROMPT, 64, seed=3),
        on_tokens=lambda ids, tiers: counted.append(graphs.recorded(engine._caches.full)),
    )
    assert counted[0] == [] and counted[1] == [(1, 80)]
    assert graphs.recorded(engine._caches.full) == [(1, 80), (1, 96), (1, 112)] and graphs.captured == 3


def test_an_offloaded_step_reads_nothing_from_the_host_and_fetches_its_bucket_at_a_fixed_shape():
    """A fixed-shape step of 3 tokens padded to 4 on an offloaded cache (one layer on chip), twice, the second
    after the first's positions went to the tail: no read of a device value on the host (.item(), .tolist()), no
    tensor made from host data, no wait for the copy stream; each streamed layer fetches the same B = 80 positions
    per KV head and tensor from the host storage whatever the length, while the layer before it computes; and the
    logits are the device cache's."""
    from test_gpu_path import ScalarReads, StepOps

    model = loaded_model().model
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32)
    queue = CountingQueue()
    offload_kv(full, torch.device("cpu"), on_chip_layers=1, queue=queue, tail_positions=16, bucket_positions=BUCKET)
    full.make_static(cfg.num_heads, 8, torch.float32)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32)
    prompt = torch.tensor(random_prompt(PROMPT, 64, seed=4))
    model(prompt, 0, full, decoding=False)
    model(prompt, 0, reference, decoding=False)
    host = storages(full.keys, full.values)
    for start in (PROMPT, PROMPT + 3):
        tokens = torch.tensor([1, 2, 3, 0])
        full.prepare(start, 3, padding=1)
        queue.copies.clear()
        queue.log.clear()
        settles = queue.settles
        ops, reads = StepOps(), ScalarReads()
        with torch.no_grad(), ops, reads:
            logits = model.compute_logits(tokens, torch.arange(start, start + 4), full)
        assert ops.from_host == 0 and reads.count == 0 and queue.settles == settles
        fetched = [size for dst, src, size in queue.copies if src in host]
        per_head = 80 * cfg.head_dim * 4
        assert fetched == [per_head] * (2 * cfg.num_kv_heads * (cfg.num_layers - 1))
        # the ring's order inside the step: each streamed layer's fetch (F: one copy per KV head and tensor) is
        # queued once the layer before has its own (A: the compute waits for a copy), before that layer computes
        order = "".join("F" if entry[0] == "copy" else "A" for entry in queue.log if entry[1] != "copy")
        assert order == ("F" * 2 * cfg.num_kv_heads + "A") * (cfg.num_layers - 1)
        torch.testing.assert_close(logits[:3], model(tokens[:3], start, reference))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES)
def test_an_offloaded_cache_captures_its_steps_as_cuda_graphs_with_the_device_caches_tokens(mode, monkeypatch):
    """Greedy, on a GPU: an offloaded cache's steps captured as CUDA graphs (the host-to-device copies and the
    copy stream's events inside the capture, from pinned host memory) across three length buckets give the tokens
    of the device cache's eager steps, and every recording of the full cache is a captured graph."""
    monkeypatch.setattr("triforce_cli.offload.kv.BUCKET_POSITIONS", BUCKET)
    greedy = SamplingConfig(temperature=0)
    eager = loaded_model()
    eager.model.to("cuda")
    expected = Engine(eager, config(mode, greedy, max_new_tokens=40)).generate(random_prompt(PROMPT, 64, seed=3))
    model = loaded_model()
    model.model.to("cuda")
    model.model.use_steps(StepMode.GRAPHS)
    engine = Engine(model, config(mode, greedy, offload="kv", on_chip_layers=1, max_new_tokens=40))
    assert engine.generate(random_prompt(PROMPT, 64, seed=3)).token_ids == expected.token_ids
    full = engine._caches.full
    assert full.keys.is_pinned() and full.write_start.is_cuda
    recordings = model.model.step_graphs._graphs[full]
    assert len({slots for _, slots in recordings}) >= 2
    assert all(recorded.graph is not None for recorded in recordings.values())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_offloaded_step_replays_its_copies_from_the_host():
    """On a GPU: steps of 3 tokens on an offloaded cache (one layer on chip, a tail of 16 positions, buckets of 16)
    replayed from CUDA graphs give the device cache's logits while the tail is flushed into the host storage
    between replays and the length passes into later buckets: every replay copies the storage as it is then."""
    model = loaded_model().model.to("cuda")
    model.use_steps(StepMode.GRAPHS)
    cfg = model.config
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32)
    offload_kv(full, torch.device("cuda"), on_chip_layers=1, tail_positions=16, bucket_positions=BUCKET)
    full.make_static(cfg.num_heads, 8, torch.float32)
    reference = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32, "cuda")
    prompt = torch.tensor(random_prompt(PROMPT, 64, seed=4), device="cuda")
    model(prompt, 0, full, decoding=False)
    model(prompt, 0, reference, decoding=False)
    for start in range(PROMPT, PROMPT + 36, 3):
        tokens = torch.tensor([1, 2, 3], device="cuda") + start % 7
        expected = model(tokens, start, reference, decoding=False)
        torch.testing.assert_close(model(tokens, start, full), expected, rtol=1e-4, atol=1e-4)
    recordings = model.step_graphs._graphs[full]
    assert sorted(recordings) == [(4, 80), (4, 96), (4, 112)]
    assert all(recorded.graph is not None for recorded in recordings.values())
