"""What loading Llama-3.1-8B (and offloading its 128K-token KV cache) puts on a GPU and pins in host memory, counted
without a GPU and without the memory: the real load path on fake tensors (tests/memory_accounting.py)."""

import dataclasses
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import StubTokenizer
from memory_accounting import DEVICE, MemoryLedger, checkpoint_shapes, fake_memory, fake_state
from transformers import LlamaConfig
from triforce_cli.cache import FullCache
from triforce_cli.kernels.memory import HUGE_PAGE, huge_pages_available
from triforce_cli.offload import HostQueue, offload_kv, pin_exactly, pinned_bytes
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.decoding.config import MODES, EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sizing import prefill_activation_bytes
from triforce_cli.plan import MODELS
from triforce_cli.plan.model import GPU_ITEMS, ModelShape
from triforce_cli.plan.presets import LLAMA_3_1_ROPE
from triforce_cli.runtime.forms import StepMode
from triforce_cli.runtime.loading import BuildOptions, Checkpoint, LoadedModel, model_from_state
from triforce_cli.runtime.model import Transformer

LLAMA_31_8B = MODELS["Llama-3.1-8B"].target.llama_config(
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA_3_1_ROPE
)
SHAPES = checkpoint_shapes(LLAMA_31_8B)
NUM_LAYERS = LLAMA_31_8B.num_hidden_layers
DTYPE = torch.bfloat16
INV_FREQ_BYTES = 64 * 4  # the RoPE frequencies: head_dim / 2 float32 values, a buffer beside the weights


def bytes_of(prefix: str = "") -> int:
    """Bytes of the checkpoint's tensors whose names start with prefix, in DTYPE."""
    return sum(shape.numel() for name, shape in SHAPES.items() if name.startswith(prefix)) * DTYPE.itemsize


WEIGHTS = bytes_of()
LAYER = bytes_of("model.layers.0.")  # every decoder layer has the same shapes
OUTSIDE_LAYERS = WEIGHTS - NUM_LAYERS * LAYER  # embedding, final norm, output layer


@pytest.fixture
def host_queues(monkeypatch):
    """Copies ordered by the host's queue: the fake GPU has no CUDA streams."""
    monkeypatch.setattr("triforce_cli.offload.weights.queue_for", lambda device: HostQueue())
    monkeypatch.setattr("triforce_cli.offload.kv.queue_for", lambda device: HostQueue())


def load(ledger: MemoryLedger, options: BuildOptions):
    """model_from_state on a fake Llama-3.1-8B state in host memory, the peaks counted from the state's reading on."""
    state = fake_state(SHAPES, DTYPE)
    assert ledger.live("cpu") == WEIGHTS
    ledger.reset_peaks()
    return model_from_state(state, LLAMA_31_8B, options, Checkpoint("Llama-3.1-8B", Path(), []))


def test_the_ledger_counts_allocations_once_and_frees():
    with fake_memory() as ledger:
        weights = torch.empty(1024, 1024, dtype=DTYPE, device=DEVICE)
        rows = weights.view(2048, 512).narrow(0, 0, 1024)  # a view allocates nothing
        copy = rows.to("cpu")  # half of them
        assert (ledger.live(DEVICE), ledger.live("cpu")) == (2 << 20, 1 << 20)
        del weights
        assert ledger.live(DEVICE) == 2 << 20  # the view keeps the storage
        del rows, copy
        assert (ledger.live(DEVICE), ledger.live("cpu"), ledger.peak(DEVICE)) == (0, 0, 2 << 20)


def test_pinned_bytes_are_a_tensors_own_bytes_counted_once_while_it_lives():
    cache = torch.zeros(3, 1000)
    before = pinned_bytes()
    view = cache[1:]
    assert pin_exactly(view) is view
    assert pinned_bytes() - before == 8_000  # the view's bytes, not its storage's
    pin_exactly(cache[2:])  # within the bytes pinned: nothing more
    assert pinned_bytes() - before == 8_000
    with pytest.raises(ValueError, match=r"bytes 0-12000 of a storage whose bytes 4000-12000 are pinned already"):
        pin_exactly(cache)
    with pytest.raises(ValueError, match="only a contiguous tensor"):
        pin_exactly(torch.zeros(4, 4).t())
    del cache, view
    assert pinned_bytes() == before


def test_a_cache_on_huge_pages_pins_exactly_its_bytes():
    """A full cache of at least a huge page lies inside a mapping a huge page longer than it
    (kernels.memory.huge_page_bytes): offloading it pins the cache's bytes, not the mapping's (an offloaded 128K
    cache was refused as 'not spanning its storage')."""
    full = FullCache(2, 2, 64, 8192, torch.bfloat16)  # 4 MiB of keys
    before = pinned_bytes()
    pin_exactly(full.keys)
    pin_exactly(full.values)
    assert pinned_bytes() - before == 2 * full.keys.nbytes == 8 << 20
    if huge_pages_available():
        assert full.keys.untyped_storage().nbytes() == full.keys.nbytes + HUGE_PAGE  # the case this covers
    del full
    gc.collect()
    assert pinned_bytes() == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pinned_memory_is_page_locked_in_place_for_asynchronous_copies():
    host = torch.arange(3 * 1000, dtype=torch.float32).view(3, 1000)
    address = host.data_ptr()
    assert not host.is_pinned()
    assert pin_exactly(host).is_pinned() and host.data_ptr() == address  # locked where it is, not copied
    on_device = host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), host)


def test_loading_on_the_device_peaks_at_its_weights():
    """gpt-fast's load shape: fused and cast in host memory, each tensor crossing once. Moving the checkpoint to the
    device and fusing it there held every q/k/v and gate/up projection twice: 25 GB for these 16 GB."""
    with fake_memory() as ledger:
        model = load(ledger, BuildOptions(DEVICE, DTYPE))
        resident = ledger.live(DEVICE)
        assert resident == WEIGHTS + INV_FREQ_BYTES
        assert ledger.peak(DEVICE) <= resident + LAYER
        assert ledger.live("cpu") == 0  # the host's copy went as each tensor crossed
        assert model.model.layers[0].self_attn.qkv_proj.weight.device == DEVICE


@pytest.mark.parametrize("resident_layers", [0, 8, NUM_LAYERS])
def test_streamed_layers_stay_in_host_memory_pinned_exactly(resident_layers, host_queues):
    """--offload kv+weights: the device holds the embedding, output layer, resident layers and the two-slot ring
    (one layer more at most during the load); the host holds the streamed layers, page-locked to the byte."""
    streamed = NUM_LAYERS - resident_layers
    ring = min(2, streamed) * LAYER
    pinned_before = pinned_bytes()
    with fake_memory() as ledger:
        model = load(ledger, BuildOptions(DEVICE, DTYPE, offload_weights=True, resident_layers=resident_layers))
        resident = ledger.live(DEVICE)
        assert resident == OUTSIDE_LAYERS + resident_layers * LAYER + ring + INV_FREQ_BYTES
        assert ledger.peak(DEVICE) <= resident + LAYER
        assert ledger.live("cpu") == streamed * LAYER == model.weight_stream.host_bytes
        assert pinned_bytes() - pinned_before == streamed * LAYER  # no power-of-two rounding: 24 layers, 10.5 GB
        assert all(p.device.type == "cpu" for layer in model.weight_stream.streamed_layers for p in layer.parameters())
        del model
        gc.collect()  # the stream's hooks and the model refer to each other
    assert pinned_bytes() == pinned_before  # unpinned as the host copies were freed


def test_sharded_layers_cross_to_the_device_already_sharded(monkeypatch):
    """Rank 0 of 2: each decoder layer's projections reach the device halved; the embedding, the norms and the
    output layer whole."""
    monkeypatch.setattr("triforce_cli.runtime.parallel.world_size", lambda: 2)
    monkeypatch.setattr("triforce_cli.runtime.parallel.rank", lambda: 0)
    norms = 2 * LLAMA_31_8B.hidden_size * DTYPE.itemsize
    shard = (LAYER - norms) // 2 + norms
    with fake_memory() as ledger:
        model = load(ledger, BuildOptions(DEVICE, DTYPE, tensor_parallel=True))
        resident = ledger.live(DEVICE)
        assert resident == OUTSIDE_LAYERS + NUM_LAYERS * shard + INV_FREQ_BYTES
        assert ledger.peak(DEVICE) <= resident + shard
        assert model.config.num_kv_heads == 4


def test_an_offloaded_128k_kv_cache_pins_exactly_its_bytes(host_queues):
    """The full cache of a 128K-token prompt and 256 positions more in bfloat16 is just over 16 GiB: pinned through
    the caching host allocator, it locked a 32 GiB block. The device holds the on-chip layer, the ring and the tail
    of positions not written back yet (every layer's keys and values at 256 positions, 32 MiB), the host the
    tail's pinned twin besides the cache."""
    num_kv_heads, head_dim = LLAMA_31_8B.num_key_value_heads, LLAMA_31_8B.head_dim
    shape = (NUM_LAYERS, num_kv_heads, 131072 + 256, head_dim)
    cache_bytes = 2 * torch.Size(shape).numel() * DTYPE.itemsize
    tail_bytes = 2 * 256 * NUM_LAYERS * num_kv_heads * head_dim * DTYPE.itemsize
    pinned_before = pinned_bytes()
    with fake_memory() as ledger:
        full = FullCache(NUM_LAYERS, num_kv_heads, head_dim, 131072 + 256, DTYPE)
        assert full.keys.shape == shape and ledger.live("cpu") == cache_bytes
        stream = offload_kv(full, DEVICE, on_chip_layers=1)
        assert cache_bytes == (16 << 30) + (32 << 20) and tail_bytes == 32 << 20
        assert pinned_bytes() - pinned_before == cache_bytes + tail_bytes  # not 32 GiB
        assert ledger.live(DEVICE) == stream.device_bytes == (1 + 2) * cache_bytes // NUM_LAYERS + tail_bytes
        del full, stream
    assert pinned_bytes() == pinned_before


PLANNED_DRAFTER = MODELS["Llama-3.1-8B"].drafter  # the drafter the planner sizes for this target


def plan_rows(*args: str) -> list[dict]:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["rows"]


def fake_loaded(ledger: MemoryLedger, name: str, hf_config: LlamaConfig) -> LoadedModel:
    """A checkpoint of hf_config's shape built by the loader on the fake GPU in bfloat16, compiled as on CUDA."""
    state = fake_state(checkpoint_shapes(hf_config), DTYPE)
    model = model_from_state(state, hf_config, BuildOptions(DEVICE, DTYPE), Checkpoint(name, Path(), []))
    model.use_steps(StepMode.GRAPHS)  # what Pipeline.load does on CUDA: the caches' headroom doubles
    return LoadedModel(name, model, StubTokenizer(hf_config.vocab_size), hf_config)


@pytest.mark.parametrize("mode", MODES)
def test_the_planners_memory_is_what_the_engine_allocates_for_llama_8b_at_128k(mode, host_queues, monkeypatch):
    """`triforce plan --model Llama-3.1-8B --hardware rtx-4090 --context 128k`: for each offload setting, the device
    and host bytes it predicts (less what is not a tensor of the weights and caches: plan.model.GPU_ITEMS and the
    prefill activations) are within 5% of what the loader and the engine allocate for that generation, counted on
    fake tensors: the weights of both models, then every cache. Allocating the caches runs no forward: the prefill's
    activations and hidden states are planned apart (test_a_prefill_chunk_peaks_within_its_planned_activations,
    test_the_planned_prefill_hidden_states_are_what_the_layerwise_prefill_holds)."""
    monkeypatch.setattr("triforce_cli.decoding.sizing.available_memory", lambda device: None)  # no real GPU to ask
    rows = {
        (r["mode"], r["offload"]): r
        for r in plan_rows("--model", "Llama-3.1-8B", "--hardware", "rtx-4090", "--context", "128k")
    }
    for offload in ("none", "kv"):
        row = rows[mode, offload]
        planned_apart = (*GPU_ITEMS, "prefill activations")
        reserve = sum(row["memory"][what]["device"] for what in planned_apart if what in row["memory"])
        with fake_memory() as ledger:
            target = fake_loaded(ledger, "Llama-3.1-8B", LLAMA_31_8B)
            drafter = fake_loaded(ledger, PLANNED_DRAFTER.name, PLANNED_DRAFTER.llama_config())
            config = EngineConfig(mode=mode, offload=offload, on_chip_layers=row["on_chip_layers"])
            engine = Engine(target, config, drafter if config.uses_drafter else None)
            engine._allocate(131072)
            device, host = ledger.live(DEVICE), ledger.live("cpu")
            if not config.uses_drafter:  # loaded all the same, but no engine of this mode holds it
                device -= ledger_weights(drafter)
            del engine, target, drafter
            gc.collect()
        assert device == pytest.approx(row["device_bytes"] - reserve, rel=0.05), (offload, device, row)
        assert host == pytest.approx(row["host_bytes"], rel=0.05, abs=1), (offload, host, row)


def ledger_weights(loaded: LoadedModel) -> int:
    """Bytes of a model's parameters and buffers, each storage once."""
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize(
    ("name", "dtype", "chunk"),
    [
        ("Llama-3.1-8B", torch.bfloat16, 4096),
        ("Llama-3.1-8B", torch.bfloat16, 512),
        ("SmolLM2-135M", torch.bfloat16, 4096),
        ("SmolLM2-135M", torch.float32, 256),
    ],
)
def test_a_prefill_chunk_peaks_within_its_planned_activations(name, dtype, chunk):
    """A prefill chunk after the first (chunk new keys after as many held) of a two-layer model of the shape, on fake
    host tensors with the 'sdpa' attention backend (CUDA's without flash-attn): what it allocates beyond the model
    and the cache peaks within prefill_activation_bytes, the plan's item, and at more than nine tenths of it (the
    MLP's peak, for these shapes); a float32 model on the CPU runs the step ops (kernels/step.py), whose fused MLP
    holds less, and peaks above its gate and up rows."""
    shape = MODELS[name].target
    hf_config = dataclasses.replace(shape, num_layers=2).llama_config()
    with fake_memory() as ledger:
        state = fake_state(checkpoint_shapes(hf_config), dtype)
        model = model_from_state(
            state, hf_config, BuildOptions(torch.device("cpu"), dtype), Checkpoint(name, Path(), [])
        )
        for layer in model.model.layers:
            layer.self_attn.backend = "sdpa"
        cache = FullCache(2, shape.num_kv_heads, shape.head_dim, 2 * chunk, dtype)
        tokens = torch.zeros(chunk, dtype=torch.long)
        model(tokens, 0, cache, num_logits=1, decoding=False)
        held = ledger.live("cpu")
        ledger.reset_peaks()
        model(tokens, chunk, cache, num_logits=1, decoding=False)
        peak = ledger.peak("cpu") - held
    planned = prefill_activation_bytes(shape, chunk, dtype.itemsize)
    if dtype == torch.float32:  # the CPU's step ops: the MLP's gate and up rows are the largest tensor held
        assert chunk * 2 * shape.intermediate_size * dtype.itemsize < peak <= planned
    else:
        assert 0.9 * planned < peak <= planned


@pytest.mark.parametrize(("dtype", "kernel"), [(torch.bfloat16, "flash"), (torch.float32, "efficient")])
def test_the_sdpa_backends_cuda_kernels_allocate_by_the_chunk_not_the_context(dtype, kernel, monkeypatch):
    """A 4,096-token chunk of a Llama-3.1-8B layer (32 query heads, 8 KV heads, head dim 128) after 4,096 and after
    16,384 positions, on fake CUDA tensors, CUDA's answers to which kernel takes them given as its rules are (flash:
    16-bit, grouped heads; memory-efficient: float32, equal heads): two fused calls of that kernel, no
    blocked_attention, and the same allocations at both lengths, a few (Hq, T, D) tensors (no expanded context)."""
    module = sys.modules["triforce_cli.kernels.attention"]
    flash_takes = lambda params: params.query.dtype != torch.float32
    efficient_takes = lambda params: params.query.shape[1] == params.key.shape[1]  # equal heads
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", flash_takes)
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", efficient_takes)
    kernels = []
    fused = module.fused_attention
    monkeypatch.setattr(module, "fused_attention", lambda *a: kernels.append(a[-1]) or fused(*a))
    monkeypatch.setattr(module, "blocked_attention", lambda *a: pytest.fail("blocked_attention ran"))
    chunk, heads, head_dim = 4096, 32, 128
    peaks = []
    for context in (4096, 16384):
        with fake_memory() as ledger:
            q = torch.empty(heads, chunk, head_dim, dtype=dtype, device=DEVICE)
            k, v = (torch.empty(8, context + chunk, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
            held = ledger.live(DEVICE)
            out = module.torch_attention(q, k, v, head_dim**-0.5)
            assert out.shape == q.shape and out.dtype == dtype and out.device == DEVICE
            peaks.append(ledger.peak(DEVICE) - held)
    assert kernels == [kernel] * 4
    # a few float32 (Hq, T, D) tensors (outputs, the merge, float32's expanded new keys), 64 MiB each; the math
    # kernel's (Hq, T, L) scores would be 10 GiB at 20K keys
    assert peaks[0] == peaks[1] <= 6 * heads * chunk * head_dim * 4


def test_the_planned_prefill_hidden_states_are_what_the_layerwise_prefill_holds():
    """The planner's 'prefill hidden states' (ModelShape.prefill_hidden_bytes) are the bytes the layer-wise prefill
    holds for a whole prompt beside the cache it writes: counted on fake tensors on the CPU, its peak lies between
    them and them plus one prefill chunk's activations (prefill_activation_bytes, the plan's bound on them).
    A layer writes its output over its input chunk by chunk: the (T, C) hidden states are held once, as
    Transformer.prefill_layerwise_bytes counts them."""
    shape = ModelShape(
        name="small",
        num_layers=2,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    tokens, chunk = 8192, 256
    model = Transformer.from_hf_config(shape.llama_config(max_position_embeddings=tokens)).to(DTYPE).eval()
    model.use_attention("sdpa")  # the kernels a GPU without flash-attn runs (the CPU's own build a (T, L) mask)
    with fake_memory() as ledger:  # the small model's weights are real, the prompt and cache fake
        cache = FullCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, tokens, DTYPE)
        prompt = torch.zeros(tokens, dtype=torch.long)
        before = ledger.live("cpu")
        ledger.reset_peaks()
        model.prefill_layerwise(prompt, 0, cache, chunk)
        held = ledger.peak("cpu") - before
    planned = shape.prefill_hidden_bytes(tokens, DTYPE.itemsize)
    assert planned == model.prefill_layerwise_bytes(tokens)
    assert planned <= held <= planned + prefill_activation_bytes(shape, chunk, DTYPE.itemsize)
