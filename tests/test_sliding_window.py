"""Sliding-window attention (Mistral's sliding_window, Qwen2's and Qwen3's windowed layers): logits equal to
transformers' for prefill chunks, verification-sized steps and decode steps over sequences several windows long,
the attention kernels against an explicit band mask, greedy equality of every mode (eager and fixed-shape steps,
dense and half weights) on loaded checkpoints, and draft caches that let a windowed layer read nothing before its
window. A model whose every layer has the window keeps only it in its full cache: the bytes it holds, the logits
through many moves and rollbacks, the same chunk selection, every mode's greedy tokens, prefix reuse and saved
prefills."""

import sys
from dataclasses import replace

import pytest
import torch
from helpers import (
    F16_KV_TOLERANCE,
    full_cache_for,
    llama_config,
    random_prompt,
    reference_logits,
    save_tokenizer,
    wrap,
)
from transformers import (
    DynamicCache,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from triforce_cli.cache import CacheCapacityError, FullCache, RetrievalCache, StreamingCache
from triforce_cli.kernels import half_weights_available
from triforce_cli.kernels.attention import attention, attention_in_cache, cache_attention_available

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.prompt_state import PromptCache
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError
from triforce_cli.plan import DEFAULT_ACCEPTANCE, Hardware, Workload
from triforce_cli.plan.model import ModelShape, memory_items
from triforce_cli.runtime.loading import load_model
from triforce_cli.runtime.model import ModelConfig

WINDOW = 12
SEQ = 80  # several windows
ATOL = 1e-5
SETTINGS = {"budget": 16, "chunk_size": 8, "draft_window": 16, "sink_tokens": 4, "max_new_tokens": 24}
CPU = Hardware(
    name="cpu", memory_bytes=16 << 30, bandwidth=20e9, pcie=20e9, flops=100e9, layer_overhead_s=1e-4, gpu=False
)


def windowed(model_class, config_class, seed: int, **settings):
    """A tiny random-weight transformers model of that class, untied, with the window settings given."""
    cfg = llama_config(config_class=config_class, tie_word_embeddings=False, initializer_range=0.2, **settings)
    torch.manual_seed(seed)
    return cfg, model_class(cfg).eval()


def mistral(seed: int = 0, window: int = WINDOW):
    return windowed(MistralForCausalLM, MistralConfig, seed, sliding_window=window)


def qwen2_mixed(seed: int = 0):
    """A Qwen2 whose layer 0 reads every key and layer 1 a window (max_window_layers=1)."""
    return windowed(Qwen2ForCausalLM, Qwen2Config, seed, use_sliding_window=True, sliding_window=WINDOW,
                    max_window_layers=1)  # fmt: skip


def qwen3_explicit_layer_types(seed: int = 0):
    """A Qwen3 whose config names each layer's kind: layer 0 windowed, layer 1 reading every key."""
    return windowed(Qwen3ForCausalLM, Qwen3Config, seed, use_sliding_window=True, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"])  # fmt: skip


@torch.no_grad()
def reference_steps(ref, ids: list[int], first: int) -> torch.Tensor:
    """transformers' logits (T, V) for ids: the first `first` in one forward, then one token at a time on its cache
    (DynamicCache, which keeps only a window of a windowed layer's keys)."""
    cache = DynamicCache(config=ref.config)
    logits = [ref(torch.tensor([ids[:first]]), cache=cache, use_cache=True).logits[0]]
    for token in ids[first:]:
        logits.append(ref(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0])
    return torch.cat(logits).float()


def test_windows_follow_transformers_rule_per_layer():
    assert ModelConfig.from_hf(mistral()[0]).sliding_windows == (WINDOW, WINDOW)
    assert ModelConfig.from_hf(qwen2_mixed()[0]).sliding_windows == (None, WINDOW)
    assert ModelConfig.from_hf(qwen3_explicit_layer_types()[0]).sliding_windows == (WINDOW, None)
    off = llama_config(config_class=Qwen2Config, use_sliding_window=False, sliding_window=WINDOW)
    assert ModelConfig.from_hf(off).sliding_windows == ()
    assert ModelConfig.from_hf(mistral(window=None)[0]).sliding_windows == ()


@pytest.mark.parametrize(
    "build", [mistral, qwen2_mixed, qwen3_explicit_layer_types], ids=["mistral", "qwen2-mixed", "qwen3-layer-types"]
)
def test_logits_equal_transformers_for_prefill_chunks_verifications_and_steps(build):
    cfg, ref = build()
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=3)
    expected = reference_logits(ref, ids)
    whole = model(torch.tensor(ids), 0, full_cache_for(model))
    torch.testing.assert_close(whole, expected, **F16_KV_TOLERANCE)
    # chunks shorter and longer than the window, each query with its own lower bound
    cache, parts, start = full_cache_for(model), [], 0
    for size in (5, 20, 1, 9, 3, 30, 1, 1, 10):
        parts.append(model(torch.tensor(ids[start : start + size]), start, cache))
        start += size
    torch.testing.assert_close(torch.cat(parts), expected, **F16_KV_TOLERANCE)
    steps = [model(torch.tensor(ids[:30]), 0, cache := full_cache_for(model))]
    steps += [model(torch.tensor([t]), 30 + i, cache) for i, t in enumerate(ids[30:])]
    torch.testing.assert_close(torch.cat(steps), reference_steps(ref, ids, 30), **F16_KV_TOLERANCE)


def test_without_the_window_the_logits_differ():
    """The test above can fail: the same weights read with every key give other logits past the window."""
    cfg, ref = mistral()
    ids = random_prompt(SEQ, cfg.vocab_size, seed=3)
    cfg.sliding_window = None
    unwindowed = wrap(ref, cfg).model
    logits = unwindowed(torch.tensor(ids), 0, full_cache_for(unwindowed))
    cfg.sliding_window = WINDOW
    assert not torch.allclose(logits[WINDOW + 1 :], reference_logits(ref, ids)[WINDOW + 1 :], atol=1e-3)
    torch.testing.assert_close(logits[:WINDOW], reference_logits(ref, ids)[:WINDOW], **F16_KV_TOLERANCE)


def test_rollback_then_rewrite_keeps_the_window_exact():
    """A verification that rejects tokens rolls back; the positions written again give transformers' logits."""
    cfg, ref = mistral(seed=1)
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=4)
    cache = full_cache_for(model)
    model(torch.tensor(ids[:40]), 0, cache)
    model(torch.tensor(random_prompt(7, cfg.vocab_size, seed=9)), 40, cache)  # drafts, all rejected
    cache.rollback(40)
    logits = model(torch.tensor(ids[40:47]), 40, cache)
    torch.testing.assert_close(logits, reference_logits(ref, ids[:47])[40:], **F16_KV_TOLERANCE)


def test_layerwise_prefill_equals_chunked_forwards():
    cfg, ref = mistral(seed=2)
    model = wrap(ref, cfg).model
    ids = torch.tensor(random_prompt(SEQ, cfg.vocab_size, seed=5))
    chunked = full_cache_for(model)
    for start in range(0, SEQ, 16):
        last = model(ids[start : start + 16], start, chunked)
    layerwise = full_cache_for(model)
    logits = model.prefill_layerwise(ids, 0, layerwise, chunk=16)
    torch.testing.assert_close(logits, last[-1:], atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(layerwise.keys[:, :, :SEQ], chunked.keys[:, :, :SEQ])


def windowed_reference(q, k, v, scale, window):
    """Explicit masked softmax in float64: query t at position L - T + t reads keys in its window."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    num_queries, num_keys = q.shape[1], k.shape[1]
    positions = torch.arange(num_keys - num_queries, num_keys)[:, None]
    keys = torch.arange(num_keys)[None, :]
    visible = (keys <= positions) & (keys > positions - window)
    scores = (q.double() @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).float()


@pytest.mark.parametrize("backend", ["cpu", "sdpa"])
@pytest.mark.parametrize("num_queries", [1, 3, 8, 20])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16-cache"])
def test_attention_reads_only_the_window(num_queries, half, backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(4, num_queries, 16), torch.randn(2, 70, 16), torch.randn(2, 70, 16)
    if half:
        if backend != "cpu" or not cache_attention_available(q, k.half()):
            pytest.skip("float16 caches with float32 queries: the CPU extension's cache_attention")
        k, v = k.half(), v.half()  # the window goes to the kernel
    out = attention(q, k, v, 0.25, backend, window=WINDOW)
    torch.testing.assert_close(out, windowed_reference(q, k, v, 0.25, WINDOW), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_keys", [30, 70])
def test_the_sdpa_backend_reads_a_long_chunk_in_query_blocks(num_keys, monkeypatch):
    """A chunk of 20 queries in blocks of at most 8 (WINDOW_QUERY_BLOCK): every SDPA call masks at most 8 queries
    against at most window + 7 keys, the math kernel's scores on CUDA bounded by the block, and the chunk's output
    is the window's attention; 30 keys: the first block's window starts at key 0."""
    module = sys.modules["triforce_cli.kernels.attention"]
    monkeypatch.setattr(module, "WINDOW_QUERY_BLOCK", 8)
    shapes = []  # (queries, keys) of each SDPA call
    sdpa = module.F.scaled_dot_product_attention

    def recorded(q, k, *args, **kwargs):
        shapes.append((q.shape[-2], k.shape[-2]))
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(module.F, "scaled_dot_product_attention", recorded)
    torch.manual_seed(2)
    q, k, v = torch.randn(4, 20, 16), torch.randn(2, num_keys, 16), torch.randn(2, num_keys, 16)
    out = attention(q, k, v, 0.25, "sdpa", window=WINDOW)
    torch.testing.assert_close(out, windowed_reference(q, k, v, 0.25, WINDOW), atol=1e-5, rtol=1e-5)
    assert [queries for queries, _ in shapes] == [8, 8, 4]
    assert all(keys <= WINDOW + 7 for _, keys in shapes)


@pytest.mark.parametrize("num_queries", [1, 4])
def test_fixed_shape_step_masks_the_window(num_queries):
    torch.manual_seed(1)
    q, keys, values = torch.randn(4, num_queries, 16), torch.randn(2, 64, 16), torch.randn(2, 64, 16)
    start = 40
    out = attention_in_cache(q, keys, values, torch.tensor([start], dtype=torch.int32), 0.25, "sdpa", WINDOW)
    seen = start + num_queries
    expected = windowed_reference(q, keys[:, :seen], values[:, :seen], 0.25, WINDOW)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("build", [mistral, qwen2_mixed], ids=["mistral", "qwen2-mixed"])
def test_checkpoint_loads_and_every_mode_is_greedy_equal(tmp_path, build):
    """A saved windowed checkpoint goes through load_model, and every mode gives autoregressive's greedy tokens for
    a prompt several windows long."""
    cfg, ref = build(seed=1)
    ref.save_pretrained(tmp_path / "windowed")
    save_tokenizer(tmp_path / "windowed", cfg.vocab_size)
    loaded = load_model(str(tmp_path / "windowed"))
    assert loaded.model.config.sliding_windows == ModelConfig.from_hf(cfg).sliding_windows
    ids = random_prompt(64, cfg.vocab_size, seed=7)
    model = loaded.model
    torch.testing.assert_close(
        model(torch.tensor(ids), 0, full_cache_for(model)), reference_logits(ref, ids), **F16_KV_TOLERANCE
    )
    greedy = SamplingConfig(temperature=0)
    expected = Engine(loaded, EngineConfig(mode="autoregressive", sampling=greedy, **SETTINGS)).generate(ids)
    with torch.no_grad():
        reference = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    assert expected.token_ids == reference
    for mode in ("retrieval", "streaming", "triforce"):
        result = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **SETTINGS)).generate(ids)
        assert result.token_ids == expected.token_ids, mode
    # the fixed-shape steps (masked over the caches' whole buffers, kernels.attention_in_cache), run uncompiled
    model.fixed_step = model.compute_logits
    for mode in ("autoregressive", "retrieval", "triforce"):
        result = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **SETTINGS)).generate(ids)
        assert result.token_ids == expected.token_ids, f"{mode}, fixed-shape steps"


def test_retrieval_cache_selects_no_chunk_before_the_window():
    """Chunks wholly before a windowed layer's window, chunk 0's sinks included, are neither selected nor read;
    the layer without a window keeps chunk 0 and reads every selected chunk."""
    cfg, ref = qwen2_mixed(seed=2)
    model = wrap(ref, cfg).model
    full = full_cache_for(model)
    model(torch.tensor(random_prompt(SEQ, cfg.vocab_size, seed=6)), 0, full)
    chunk, budget = 4, 12
    retrieval = RetrievalCache(full, budget, chunk, 16, windows=model.config.sliding_windows)
    retrieval.select_chunks()
    first_visible = SEQ - WINDOW + 1  # of the next position's window
    windowed = retrieval.chunk_ids[1]  # (Hkv, chunks)
    hidden = retrieval.first_slots[1] // chunk
    assert hidden == 0  # the window holds enough chunks for the budget here
    assert ((windowed + 1) * chunk > first_visible).all()
    assert (retrieval.chunk_ids[0, :, 0] == 0).all() and retrieval.first_slots[0] == 0
    retrieval.prepare(SEQ, 1)
    keys, _ = retrieval.update(1, None, full.keys[1, :, :1], full.values[1, :, :1])
    assert keys.shape[1] == budget + 1  # the selected chunks and the key written here

    small_window = RetrievalCache(full, budget, chunk, 16, windows=(None, 6))
    small_window.select_chunks()
    small_window.prepare(SEQ, 1)
    complete = SEQ // chunk
    selectable = complete - (SEQ - 6 + 1) // chunk  # chunks of the window
    assert small_window.first_slots[1] == (budget // chunk - selectable) * chunk
    in_view = small_window.chunk_ids[1, :, small_window.first_slots[1] // chunk :]
    assert ((in_view + 1) * chunk > SEQ - 6 + 1).all()
    keys, _ = small_window.update(1, None, full.keys[1, :, :1], full.values[1, :, :1])
    assert keys.shape[1] == budget - small_window.first_slots[1] + 1


def saved_half_mistral(folder):
    """A windowed Mistral saved to folder and loaded with half weights, and a prompt several windows long."""
    cfg, ref = mistral(seed=3)
    ref.save_pretrained(folder / "windowed")
    save_tokenizer(folder / "windowed", cfg.vocab_size)
    return load_model(str(folder / "windowed"), weights="half"), random_prompt(64, cfg.vocab_size, seed=8)


@pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")
def test_half_weights_read_the_float16_cache_inside_the_window_in_every_mode(tmp_path):
    """With half weights attention reads the float16 cache, cut to the window: every mode still gives
    autoregressive's greedy tokens."""
    loaded, ids = saved_half_mistral(tmp_path)
    greedy = SamplingConfig(temperature=0)
    reference = Engine(loaded, EngineConfig(mode="autoregressive", sampling=greedy, **SETTINGS))
    expected = reference.generate(ids)
    assert reference._caches.full.keys.dtype == torch.float16
    for mode in ("retrieval", "streaming", "triforce"):
        result = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **SETTINGS)).generate(ids)
        assert result.token_ids == expected.token_ids, mode


def test_streaming_cache_leaves_what_a_windowed_drafter_cannot_see_out_of_its_view():
    """Sinks before a windowed layer's window are not read there, nor window positions before it; a layer without a
    window reads every slot. Positions are checked through the values, each slot holding its position."""
    sinks, draft_window = 4, 16
    cache = StreamingCache(2, 1, 1, sinks, draft_window, 4, torch.float32, windows=(None, 6))
    for position in range(40):
        cache.prepare(position, 1)
        keys = torch.full((1, 1, 1), float(position))
        views = [cache.update(layer, None, keys, keys)[1].flatten().tolist() for layer in range(2)]
        held = [float(p) for p in cache.cached_positions()]
        assert views[0] == held
        assert views[1] == [p for p in held if p > position - 6], position
        assert cache.first_slot(1).item() == len(held) - len(views[1])


# ------------------------------------------------------------------ a full cache that keeps only the window
# Mistral windows every layer alike: its full cache keeps W + slack slots, dropping positions no later query reads.

WINDOW_KEPT = {**SETTINGS, "prefill_block": 8}  # the slack (sizing.full_slots) then lies well under the prompt
ALIGN = 4


def windowed_cache_for(model, capacity: int, align: int = ALIGN) -> FullCache:
    """A full cache of capacity slots that keeps only model's shared window, in full_cache_for's dtype."""
    cfg = model.config
    dtype = full_cache_for(model, 0).keys.dtype
    return FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, dtype, window=WINDOW, align=align)


def saved(folder, built):
    """The model built (config, transformers model) saved in folder and loaded; and its transformers reference."""
    cfg, ref = built
    ref.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    return load_model(str(folder)), ref


def saved_mistral(tmp_path, seed: int = 1, window: int | None = WINDOW):
    """A windowed Mistral checkpoint on disk, loaded; and its transformers reference."""
    return saved(tmp_path / "windowed", mistral(seed=seed, window=window))


def test_shared_window_is_that_of_every_layer_alike():
    assert ModelConfig.from_hf(mistral()[0]).shared_window == WINDOW
    assert ModelConfig.from_hf(qwen2_mixed()[0]).shared_window is None
    assert ModelConfig.from_hf(mistral(window=None)[0]).shared_window is None
    shape = ModelShape.from_config(name="m", config=ModelConfig.from_hf(mistral()[0]))
    assert shape.shared_window == WINDOW


@pytest.mark.parametrize("capacity, align", [(WINDOW + 12, ALIGN), (WINDOW + 10, 1)])
def test_logits_equal_transformers_on_a_cache_that_moves_many_times(capacity, align):
    """Prefill chunks of several sizes, then single steps, on a cache of a few slots more than the window: the cache
    drops and moves positions again and again, and the logits stay transformers'."""
    cfg, ref = mistral()
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=3)
    cache, parts, start, offsets = windowed_cache_for(model, capacity, align), [], 0, set()
    for size in (5, 8, 1, 9, 3, 8, 1, 1, 7, 8, 2, 8):  # 61 positions
        parts.append(model(torch.tensor(ids[start : start + size]), start, cache))
        start += size
        offsets.add(cache.offset)
    torch.testing.assert_close(torch.cat(parts), reference_logits(ref, ids[:start]), **F16_KV_TOLERANCE)
    steps = []
    for position in range(start, SEQ):
        steps.append(model(torch.tensor(ids[position : position + 1]), position, cache))
        offsets.add(cache.offset)
    torch.testing.assert_close(torch.cat(steps), reference_steps(ref, ids, start)[start:], **F16_KV_TOLERANCE)
    assert cache.keys.shape[2] == capacity and len(offsets) > 5 and cache.offset >= SEQ - capacity
    assert all(offset % align == 0 for offset in offsets)


def test_a_cache_keeping_the_window_refuses_what_it_cannot_serve():
    """A write longer than its slack is a CacheCapacityError; a write needing a dropped position (a rollback past
    the last write) is a ValueError, never a forward over what the cache no longer holds."""
    cfg, ref = mistral()
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=3)
    cache = windowed_cache_for(model, WINDOW + 12)
    with pytest.raises(CacheCapacityError):
        model(torch.tensor(ids[:30]), 0, cache)
    cache.reset()
    for start in range(0, 40, 8):
        model(torch.tensor(ids[start : start + 8]), start, cache)
    assert cache.offset > 0 and not cache.can_write_from(cache.offset)
    cache.rollback(cache.offset)
    with pytest.raises(ValueError, match="dropped"):
        model(torch.tensor(ids[cache.offset : cache.offset + 1]), cache.offset, cache)


def test_rollback_after_a_move_rewrites_exactly():
    """Rejected drafts whose write moved the cache are rolled back; the positions written again give transformers'
    logits."""
    cfg, ref = mistral(seed=1)
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=4)
    cache = windowed_cache_for(model, WINDOW + 8, align=1)
    for start in range(0, 40, 4):
        model(torch.tensor(ids[start : start + 4]), start, cache)
    before = cache.offset
    model(torch.tensor(random_prompt(7, cfg.vocab_size, seed=9)), 40, cache)  # drafts, all rejected
    assert cache.offset > before  # their write moved the cache
    cache.rollback(40)
    logits = model(torch.tensor(ids[40:47]), 40, cache)
    torch.testing.assert_close(logits, reference_logits(ref, ids[:47])[40:], **F16_KV_TOLERANCE)


def test_a_float16_cache_keeping_the_window_reads_as_one_keeping_every_position():
    """A float16 cache that keeps the window gives the logits read from a float16 cache that keeps every position,
    through moves past the prompt."""
    cfg, ref = mistral(seed=2)
    model = wrap(ref, cfg).model
    ids = random_prompt(SEQ, cfg.vocab_size, seed=5)
    logits = []
    for cache in (full_cache_for(model), windowed_cache_for(model, WINDOW + 12)):
        assert cache.keys.dtype == torch.float16
        for start in range(0, 48, 8):
            model(torch.tensor(ids[start : start + 8]), start, cache)
        logits.append(torch.cat([model(torch.tensor([t]), 48 + i, cache) for i, t in enumerate(ids[48:])]))
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("budget", [8, 16], ids=["window-holds-the-budget", "budget-filled-before-the-window"])
def test_retrieval_cache_selects_the_same_chunks_on_a_cache_keeping_the_window(budget):
    """Selection on a full cache that dropped every position before the window reads the same chunks in the
    windowed layers' view as on one keeping every position."""
    cfg, ref = mistral(seed=2)
    model = wrap(ref, cfg).model
    ids = torch.tensor(random_prompt(SEQ, cfg.vocab_size, seed=6))
    chunk = 4
    views = []
    for full in (full_cache_for(model), windowed_cache_for(model, WINDOW + 12, align=chunk)):
        for start in range(0, SEQ, 8):
            model(ids[start : start + 8], start, full)
        retrieval = RetrievalCache(full, budget, chunk, 16, windows=model.config.sliding_windows)
        retrieval.select_chunks()
        retrieval.prepare(SEQ, 1)
        first = retrieval.first_slots[0]
        assert (first > 0) == (budget == 16)  # the window holds three whole chunks
        key = torch.zeros(cfg.num_key_value_heads, 1, model.config.head_dim)
        keys, _ = retrieval.update(0, None, key, key)
        views.append((retrieval.chunk_ids[:, :, first // chunk :], keys))
    assert views[1][0].shape[-1] > 0
    assert torch.equal(views[1][0], views[0][0])
    torch.testing.assert_close(views[1][1], views[0][1])


def test_full_cache_bytes_are_the_window_and_a_slack(tmp_path):
    """The memory plan, the allocated cache and the planner hold W + slack positions for a model whose every layer
    has the window; the same model without one, offloaded, or a Qwen2 with one windowed layer, every position."""
    loaded, _ = saved_mistral(tmp_path)
    ids = random_prompt(64, loaded.model.config.vocab_size, seed=7)
    per_position = 2 * 2 * 2 * loaded.model.config.head_dim * 2  # keys and values, 2 layers, 2 KV heads, float16
    engine = Engine(loaded, EngineConfig(mode="autoregressive", **WINDOW_KEPT))
    spare = engine.config.speculation_depth
    slots = WINDOW + max(8, spare) + WINDOW_KEPT["chunk_size"]
    assert engine.memory_plan(len(ids)).bytes_of("full KV cache") == slots * per_position
    engine.generate(ids)
    full = engine._caches.full
    assert full.keys.nbytes + full.values.nbytes == slots * per_position and full.offset > 0
    offloaded = Engine(loaded, EngineConfig(mode="autoregressive", offload="kv", **WINDOW_KEPT))
    every = len(ids) + WINDOW_KEPT["max_new_tokens"] + spare
    assert offloaded.memory_plan(len(ids)).bytes_of("full KV cache") == every * per_position
    for other in (saved_mistral(tmp_path / "plain", window=None)[0], saved(tmp_path / "mixed", qwen2_mixed())[0]):
        other_engine = Engine(other, EngineConfig(mode="autoregressive", **WINDOW_KEPT))
        assert other_engine.memory_plan(len(ids)).bytes_of("full KV cache") == every * per_position

    shape = ModelShape.from_config(name="m", config=loaded.model.config)
    workload = Workload(len(ids), EngineConfig(**WINDOW_KEPT), DEFAULT_ACCEPTANCE, dtype_bytes=4)
    planned = {}
    for name, target in (("windowed", shape), ("plain", replace(shape, shared_window=None))):
        items, _ = memory_items(
            target=target, drafter=target, hardware=CPU, workload=workload, mode="autoregressive", offload="none"
        )
        planned[name] = next(item.device_bytes for item in items if item.what == "full KV cache")
    assert planned == {"windowed": slots * per_position, "plain": every * per_position}


# the drafter records its decode steps (up to 4 tokens); its catch-up writes, up to the prefill chunk, run eager
@pytest.mark.parametrize("fixed_shape, prefill_block", [(False, 8), (True, 32)], ids=["eager", "fixed-shape"])
def test_every_mode_is_greedy_equal_on_a_cache_keeping_the_window(tmp_path, fixed_shape, prefill_block):
    """Every mode gives transformers' greedy tokens for a prompt several windows long, with a full cache that holds
    fewer positions than the prompt and moves many times; self-speculation fills its drafter cache from it."""
    loaded, ref = saved_mistral(tmp_path)
    model = loaded.model
    if fixed_shape:
        model.fixed_step = model.compute_logits  # masked over the caches' whole buffers, uncompiled
    ids = random_prompt(64, model.config.vocab_size, seed=7)
    greedy = SamplingConfig(temperature=0)
    with torch.no_grad():
        reference = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :].tolist()
    for mode in ("autoregressive", "retrieval", "streaming", "triforce"):
        settings = {**WINDOW_KEPT, "prefill_block": prefill_block}
        engine = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **settings))
        result = engine.generate(ids)
        assert result.token_ids == reference, mode
        full = engine._caches.full
        assert full.capacity < len(ids) and full.offset > 0, mode


@pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")
def test_half_weights_are_greedy_equal_on_a_cache_keeping_the_window(tmp_path):
    """With half weights every mode reads the float16 cache, which moves its positions."""
    loaded, ids = saved_half_mistral(tmp_path)
    greedy = SamplingConfig(temperature=0)
    expected = Engine(loaded, EngineConfig(mode="autoregressive", sampling=greedy, **WINDOW_KEPT)).generate(ids)
    for mode in ("retrieval", "streaming", "triforce"):
        result = Engine(loaded, EngineConfig(mode=mode, sampling=greedy, ngram=False, **WINDOW_KEPT)).generate(ids)
        assert result.token_ids == expected.token_ids, mode


def test_prefix_reuse_keeps_what_the_window_still_holds(tmp_path):
    """A prompt extending a prefilled one keeps its prefix where the cache still holds the window before its end;
    after an answer moved the cache past it, nothing is kept. Either way the tokens are a fresh engine's."""
    loaded, _ = saved_mistral(tmp_path)
    vocab = loaded.model.config.vocab_size
    document, question = random_prompt(64, vocab, seed=7), random_prompt(9, vocab, seed=8)
    greedy = SamplingConfig(temperature=0)
    config = EngineConfig(mode="triforce", sampling=greedy, ngram=False, **WINDOW_KEPT)
    engine = Engine(loaded, config)
    engine.prefill(document, capture=False)
    reused = engine.generate(document + question)
    assert reused.stats.reused_tokens == 64
    assert reused.token_ids == Engine(loaded, config).generate(document + question).token_ids
    again = engine.generate(document + question[:4])  # the answer above moved the cache past the document's end
    assert again.stats.reused_tokens == 0
    assert again.token_ids == Engine(loaded, config).generate(document + question[:4]).token_ids


def test_saved_prefill_holds_the_window_and_serves_the_fresh_tokens(tmp_path):
    """A prefill saved from a cache keeping the window holds the prompt's last positions; put back (through the
    prompt cache's file) every mode gives a fresh prefill's tokens, and an offloaded run refuses it in one line."""
    loaded, _ = saved_mistral(tmp_path)
    ids = random_prompt(64, loaded.model.config.vocab_size, seed=7)
    greedy = SamplingConfig(temperature=0)
    state = Engine(loaded, EngineConfig(mode="autoregressive", **WINDOW_KEPT)).prefill(ids)
    assert 0 < state.first_position and state.keys.shape[2] == len(ids) - state.first_position < WINDOW + 20
    cache = PromptCache(tmp_path / "prompts", loaded, prefill_chunk=WINDOW_KEPT["prefill_block"])
    cache.save(state, ids)
    loaded_state = cache.load(ids)
    assert loaded_state is not None and loaded_state.first_position == state.first_position
    for mode in ("autoregressive", "triforce"):
        config = EngineConfig(mode=mode, sampling=greedy, ngram=False, **WINDOW_KEPT)
        restored = Engine(loaded, config).generate(ids, prompt_state=loaded_state)
        assert restored.stats.prompt_cached
        assert restored.token_ids == Engine(loaded, config).generate(ids).token_ids, mode
    offloaded = Engine(loaded, EngineConfig(mode="autoregressive", offload="kv", **WINDOW_KEPT))
    with pytest.raises(ConfigError, match="sliding window"):
        offloaded.generate(ids, prompt_state=loaded_state)


def test_self_speculation_fills_the_drafter_cache_from_the_positions_held():
    """A StreamingLLM cache filled from a full cache that dropped its first positions shows every windowed layer the
    keys that one filled from a cache keeping every position shows."""
    cfg, ref = mistral(seed=2)
    model = wrap(ref, cfg).model
    ids = torch.tensor(random_prompt(SEQ, cfg.vocab_size, seed=6))
    head_dim = model.config.head_dim
    views = []
    for full in (full_cache_for(model), windowed_cache_for(model, WINDOW + 12)):
        for start in range(0, SEQ, 8):
            model(ids[start : start + 8], start, full)
        streaming = StreamingCache(2, 2, head_dim, 4, 16, 8, torch.float32, windows=model.config.sliding_windows)
        streaming.fill_from(full)
        streaming.prepare(SEQ, 1)
        key = torch.zeros(2, 1, head_dim)
        views.append([streaming.update(layer, None, key, key)[0] for layer in range(2)])
    assert full.offset > 0
    for plain, windowed in zip(*views, strict=True):
        assert plain.shape[1] == WINDOW  # the window's positions before the new one, and the new one
        torch.testing.assert_close(windowed, plain)


def test_retrieval_cache_selects_again_where_the_positions_to_copy_were_dropped():
    """The middle tier skipped while the full cache moved past positions it had not copied: it chooses its chunks
    again, for the full cache's new length, instead of reading positions no longer held."""
    cfg, ref = mistral(seed=2)
    model = wrap(ref, cfg).model
    ids = torch.tensor(random_prompt(SEQ, cfg.vocab_size, seed=6))
    full = windowed_cache_for(model, WINDOW + 12)
    for start in range(0, 48, 8):
        model(ids[start : start + 8], start, full)
    retrieval = RetrievalCache(full, 8, ALIGN, 40, windows=model.config.sliding_windows)
    retrieval.select_chunks()
    for start in range(48, 72, 8):
        model(ids[start : start + 8], start, full)
    assert full.offset > retrieval.synced_until == 48
    retrieval.sync_recent()
    assert retrieval.selected_until == retrieval.length == 72
    assert (retrieval.chunk_ids * ALIGN >= 72 - WINDOW + 1 - ALIGN).all()
