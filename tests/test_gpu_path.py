"""The GPU path, proven on the CPU where no GPU is at hand.

- Every decode step (the drafter's on its StreamingLLM cache, the retrieval tier's verification, the full
  verification) compiles with torch.compile(fullgraph=True) and gives the eager logits: a graph break here is what
  would stop CUDA-graph capture on a GPU.
- The attention kernels are chosen at one point (kernels.attention_backend): cpu and sdpa agree; a backend that
  cannot run is one clear error; `triforce info` says what a run would pick.
- Tests marked `cuda` (`pytest -m cuda`) run the same on a GPU and skip cleanly without one.
"""

import json
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import full_cache_for, llama_config, make_model, random_prompt, small_config, wrap
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache, kv_dtype
from triforce_cli.kernels import attention, attention_backend, attention_in_cache, attention_reference, optional
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.decoding import engine as engine_module
from triforce_cli.decoding import prefill as prefill_module
from triforce_cli.decoding import rounds, sizing, speculative
from triforce_cli.decoding.clock import DeviceClock
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig, verify_on_device
from triforce_cli.decoding.setup import resolve_attention
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.forms import StepMode, resolve_steps, resolve_weights
from triforce_cli.runtime.model import MAX_STEP_TOKENS

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = 64


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    cfg = llama_config(vocab_size=64, num_layers=2)
    return wrap(LlamaForCausalLM(cfg).eval(), cfg)


def prefilled(model, kind: str, device: str = "cpu", dtype: torch.dtype | None = None):
    """A cache of kind ('full', 'retrieval' or 'streaming') holding a prompt of PROMPT tokens, in dtype (None: the
    engine's for the model on device, cache.kv_dtype)."""
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).to(device)
    dtype = dtype or kv_dtype(device, model.model.embed_tokens.weight.dtype)
    if kind == "streaming":
        streaming = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 24, 8, dtype, device)
        for start in range(0, PROMPT, 8):  # the StreamingLLM cache takes at most 8 positions per forward
            model(prompt[start : start + 8], start, streaming)
        return streaming
    full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2 * PROMPT, dtype, device)
    model(prompt, 0, full)
    if kind == "full":
        return full
    retrieval = RetrievalCache(full, 32, 8, 32)
    retrieval.select_chunks()
    return retrieval


def make_static(cache, dtype: torch.dtype = torch.float32) -> None:
    """Make cache static for fixed-shape steps of a model computing in dtype."""
    if isinstance(cache, FullCache):
        cache.make_static(4, MAX_STEP_TOKENS, dtype)  # llama_config's 4 query heads
    else:
        cache.make_static()


def compiled_model(backend: str = "aot_eager"):
    """A fresh model whose decode steps run compiled (aot_eager: the same graphs, traced without codegen)."""
    loaded = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    loaded.model.compile_steps(backend=backend)
    return loaded


@pytest.mark.parametrize(("kind", "new_tokens"), [("full", 7), ("retrieval", 3), ("streaming", 1)])
def test_every_decode_step_compiles_once_for_every_position(kind, new_tokens):
    """The full tier verifies gamma2 + 1 = 7 tokens, the retrieval tier gamma1 + 1 = 3, the drafter drafts 1. Each
    step is compiled by inductor with fullgraph=True (a graph break fails it: that is what would stop CUDA-graph
    capture on a GPU), once for three positions in a row, and gives the eager logits and cache contents."""
    model = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3).loaded.model
    counter = CompileCounterWithBackend("inductor")
    model.fixed_step = torch.compile(model.compute_logits, backend=counter, fullgraph=True, dynamic=False)
    eager, fixed = prefilled(model, kind), prefilled(model, kind)
    make_static(fixed)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        tokens = torch.randint(0, model.config.vocab_size, (new_tokens,), generator=generator)
        start = eager.length
        expected = model(tokens, start, eager, num_logits=new_tokens)  # write_start is None: an eager step
        got = model(tokens, start, fixed, num_logits=new_tokens)
        assert fixed.static_step and not eager.static_step
        assert got.shape == (new_tokens, model.config.vocab_size)
        # inductor's fused reductions round otherwise than the eager kernels: float32 sums of a few hundred terms
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-5)
        assert fixed.length == eager.length
    held = slice(0, eager._write.stop)  # every slot the eager cache wrote, in both caches' own layout
    torch.testing.assert_close(fixed.keys[:, :, held], eager.keys[:, :, held])
    torch.testing.assert_close(fixed.values[:, :, held], eager.values[:, :, held])
    assert counter.frame_count == 1


def test_a_compiled_step_writes_the_cache_in_place():
    """Writing a layer's view of the (layers, Hkv, S, D) buffer would compile to a copy of the whole buffer per
    layer (the view's base): the generated code must allocate nothing of the buffer's shape."""
    model = make_model(seed=5, vocab_size=64, num_layers=4).loaded.model
    model.compile_steps()
    cfg = model.config
    cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4096, torch.float32)
    model(torch.arange(64) % cfg.vocab_size, 0, cache, decoding=False)
    make_static(cache)
    _, code = run_and_get_code(lambda: model(torch.tensor([1]), 64, cache))
    shape = ", ".join(map(str, cache.keys.shape))
    assert f"({shape})" in "".join(code)  # the buffers are the step's inputs
    assert not re.search(rf"empty_strided\w*\(\({shape}\)", "".join(code))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=3)])
def test_compiled_steps_generate_the_eager_tokens_in_every_mode(sampling):
    """Greedy: all modes equal eager autoregressive decoding. Seeded sampling (fixed speculation lengths): each
    mode draws the same tokens compiled as eager, the uniforms being the same and the distributions equal."""
    eager = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    compiled = compiled_model()
    prompt = random_prompt(PROMPT, 64, seed=3)
    reference = None
    for mode in ("autoregressive", "retrieval", "streaming", "triforce"):
        config = small_config(mode=mode, sampling=sampling)
        expected = Engine(eager, config).generate(prompt).token_ids
        engine = Engine(compiled, config)
        assert engine.compiled
        assert engine.generate(prompt).token_ids == expected, mode
        reference = reference or expected
        if sampling.greedy:
            assert expected == reference, mode


READS = ("tolist", "item", "__int__", "__index__", "__float__", "__bool__")  # what makes the host wait for a GPU


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=1)])
def test_the_device_is_read_once_per_verification_and_never_while_drafting(sampling, monkeypatch):
    """TriForce with a model drafter: the reads are the first token's, one per verification, and at most one more
    where the last token is the target's own sample; the drafter's tokens stay on the device. A read on the CPU
    is what a synchronisation is on a GPU."""
    loaded = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    config = small_config(
        max_new_tokens=40,
        sampling=sampling,
        ngram=False,
        gamma_policy="fixed",  # the drafter drafts gamma1 = 2 per verification, whatever the clock says
    )
    engine = Engine(loaded, config, drafter=loaded)
    prompt = random_prompt(PROMPT, 64, seed=3)
    reads = []

    def counted(name: str):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return method(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    monkeypatch.setattr(speculative, "verify_draft", verify_on_device)  # a GPU's (the CPU verifies on the host)
    with ScalarReads() as scalar_reads:
        result = engine.generate(prompt)
    monkeypatch.undo()
    verifications = sum(stats.verifications for stats in result.stats.acceptance)
    drafted = sum(stats.drafted for stats in result.stats.acceptance if stats.proposer == "drafter")
    assert drafted > verifications > 0
    assert 1 + verifications <= len(reads) <= 2 + verifications, reads
    # a read the Python methods above do not see: indexing with a 0-d tensor reads it inside torch's C++
    assert scalar_reads.count == sum(name != "tolist" for name in reads), scalar_reads.count


DRAFTING = {  # (ngram setting, a model drafter given, mode)
    "drafter": (False, True, "triforce"),
    "ngram": (True, False, "triforce"),
    "ngram-then-drafter": (None, True, "triforce"),
    "autoregressive": (False, False, "autoregressive"),
}


@pytest.mark.parametrize("policy", ["fixed", "costed"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=1)])
@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_a_round_copies_no_token_list_to_the_device_and_reads_once_per_verification(
    drafting, sampling, policy, monkeypatch
):
    """While decoding (after the prefill) the device is read once per verification (its outcome: how many drafts
    passed and the tokens committed) and once per round where the top tier sampled its own token (which the caller
    prints), and no token list goes from the host to the device but the prompt's, once: drafts, samples and
    verified tokens stay on the device, and the committed ids are a device buffer appended to in place. On a GPU
    each such copy or read waits for the device. Under the costed policy the n-gram's drafts are also offered to
    the top tier at every step (ModelTier.lookup), from the host copy alone. Every match proposes (ngram_min_match
    1): random weights rarely continue a repeat far enough for the gate."""
    ngram, with_drafter, mode = DRAFTING[drafting]
    loaded = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    config = small_config(
        mode=mode, max_new_tokens=40, sampling=sampling, ngram=ngram, ngram_min_match=1, gamma_policy=policy
    )
    engine = Engine(loaded, config, drafter=loaded if with_drafter else None)
    prompt = random_prompt(PROMPT // 2, 64, seed=3) * 2  # text that repeats itself: the n-gram finds drafts
    copies, reads, decoding = [], [], [False]

    def counted_copy(original):
        def copy(data, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if decoding[0] and caller.startswith("triforce_cli.decoding") and isinstance(data, (list, tuple, int)):
                copies.append(caller)
            return original(data, *args, **kwargs)

        return copy

    def counted_read(name: str):
        method = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if decoding[0]:
                reads.append(name)
            return method(self, *args, **kwargs)

        return read

    decode = engine_module.decode

    def counted_decode(*args, **kwargs):
        decoding[0] = True
        try:
            return decode(*args, **kwargs)
        finally:
            decoding[0] = False

    for name in ("tensor", "as_tensor"):
        monkeypatch.setattr(torch, name, counted_copy(getattr(torch, name)))
    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted_read(name))
    monkeypatch.setattr(engine_module, "decode", counted_decode)
    monkeypatch.setattr(speculative, "verify_draft", verify_on_device)  # a GPU's (the CPU verifies on the host)
    result = engine.generate(prompt)
    monkeypatch.undo()
    stats = result.stats
    rounds = len(stats.round_tokens)
    verifications = sum(acceptance.verifications for acceptance in stats.acceptance)
    own_rounds = rounds - sum(
        acceptance.verifications for acceptance in stats.acceptance if acceptance.verifier == "target"
    )
    if sampling.greedy:
        plain = small_config(mode="autoregressive", max_new_tokens=40, sampling=sampling)
        assert result.token_ids == Engine(loaded, plain).generate(prompt).token_ids
    assert rounds > 5 and (verifications > rounds or mode == "autoregressive" or policy == "costed")
    if ngram is not False:
        assert sum(a.drafted for a in stats.acceptance if a.proposer.startswith("ngram")) > 0
    assert copies == ["triforce_cli.decoding.speculative"], (len(copies), rounds)  # the prompt's, once
    assert len(reads) == verifications + own_rounds, (len(reads), verifications, own_rounds)


def test_prefill_chunks_are_timed_on_the_device_clock(monkeypatch):
    """Each prefill chunk's seconds are the device clock's between marks around its one forward: on a GPU, CUDA
    events whose reading waits for the chunk's work (DeviceClock), not the host's time to launch it. The clock here
    reads how many forwards ran, so a chunk measures 1."""
    loaded = make_model(seed=5, vocab_size=64, num_layers=2).loaded
    forwards = []
    loaded.model.register_forward_hook(lambda *_: forwards.append(1))

    class ForwardClock:
        def __init__(self, device):
            assert torch.device(device) == loaded.device

        def mark(self) -> int:
            return len(forwards)

        def seconds(self, start: int, end: int) -> float:
            return float(end - start)

    monkeypatch.setattr(prefill_module, "DeviceClock", ForwardClock)
    config = small_config(mode="autoregressive", max_new_tokens=2, prefill_block=16)
    result = Engine(loaded, config).generate(random_prompt(PROMPT, 64, seed=3))
    assert result.stats.prefill_chunk_seconds == [1.0] * (PROMPT // 16)


@CUDA
def test_the_device_clock_times_the_work_not_its_launch():
    clock = DeviceClock(torch.device("cuda"))
    matrix = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    began, start = time.perf_counter(), clock.mark()
    for _ in range(50):
        matrix = matrix @ matrix / 64
    seconds = clock.seconds(start, clock.mark())  # waits for the products
    torch.cuda.synchronize()
    assert seconds >= 0.5 * (time.perf_counter() - began)


class ScalarReads(TorchDispatchMode):
    """Counts every read of one value from a tensor to the host (aten._local_scalar_dense), from Python's .item()
    and int() or from inside torch: what waits for a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def bfloat16_step(sigma: float = 3.0):
    """A fixed-shape step's bfloat16 inputs with peaked scores (standard deviation about sigma**2: rounding them to
    bfloat16 moves a weight by percents) and the float64 attention of the same values: query t reads slots
    [0, 200 + t] of 300."""
    generator = torch.Generator().manual_seed(0)
    q = (sigma * torch.randn(8, 3, 64, generator=generator)).bfloat16()
    keys = (sigma * torch.randn(2, 300, 64, generator=generator)).bfloat16()
    values = torch.randn(2, 300, 64, generator=generator).bfloat16()
    start = torch.tensor([200], dtype=torch.int32)
    seen = 200 + 3
    exact = attention_reference(q.double(), keys[:, :seen].double(), values[:, :seen].double(), 64**-0.5)
    return q, keys, values, start, exact


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_step_scores_bfloat16_inputs_in_float32(compiled):
    """The non-flash fixed-shape step keeps its scores in float32: its error against float64 stays within twice
    bfloat16's relative precision of the outputs (the output's and the weights' roundings). Scores rounded to
    bfloat16, as the step once computed them, were off by 0.054 here against a bound of 0.024 (now 0.011)."""
    q, keys, values, start, exact = bfloat16_step()
    step = torch.compile(attention_in_cache, fullgraph=True, dynamic=False) if compiled else attention_in_cache
    out = step(q, keys, values, start, 64**-0.5, "sdpa")
    assert out.dtype == torch.bfloat16
    bound = 2 * 2**-8 * exact.abs().max().item()
    assert (out.double() - exact).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "first_slot"), [(None, None), (100, None), (None, 300)])
def test_a_split_step_equals_the_reference(dtype, window, first_slot):
    """The value product split over the slots (4 parts of 256 here) gives the reference attention of the slots each
    query reads: float32 as exactly as an unsplit product, bfloat16 within twice its relative precision of the
    float64 result (the weights' and the outputs' roundings)."""
    from triforce_cli.kernels.attention import slot_splits

    generator = torch.Generator().manual_seed(7)
    start, num_queries, num_slots = 700, 3, 1024
    assert slot_splits(num_slots) == 4
    q = torch.randn(8, num_queries, 64, generator=generator)
    keys, values = (torch.randn(2, num_slots, 64, generator=generator) for _ in range(2))
    q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    read = slice(first_slot or 0, start + num_queries)
    exact = attention_reference(q.double(), keys[:, read].double(), values[:, read].double(), 0.125, window)
    at = None if first_slot is None else torch.tensor([first_slot], dtype=torch.int32)
    out = attention_in_cache(q, keys, values, torch.tensor([start], dtype=torch.int32), 0.125, "sdpa", window, at)
    assert out.dtype == dtype and out.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-6)
    else:
        assert (out.double() - exact).abs().max().item() <= 2 * 2**-8 * exact.abs().max().item()


class StepOps(TorchDispatchMode):
    """Counts the non-view ops a step dispatches, and the tensors it makes from host data (aten.lift_fresh: what
    torch.tensor(...) of Python values dispatches, a host-to-device copy on a GPU that a CUDA graph cannot replay).

    one_op(fn) makes each call of fn count as one op, whatever it dispatches: what is one kernel on CUDA and
    several on the CPU (rms_norm's decomposition, the CPU's few-row product of a linear, float32_bmm's upcasts of
    16-bit factors where CUDA runs bmm with out_dtype)."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.from_host = 0
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.from_host += 1
        elif not func.is_view and not self.inside:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def one_op(self, fn):
        def counted(*args, **kwargs):
            self.ops += 1
            self.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside -= 1

        return counted


def count_static_step(num_layers: int, dtype: torch.dtype, kind: str, monkeypatch, device: str = "cpu") -> StepOps:
    """The ops of one fixed-shape step of 3 tokens padded to 4, uncompiled on the 'sdpa' backend (CUDA's without
    flash-attn), of a model of num_layers on a cache of kind ('full' of 1024 slots: a split value product)."""
    import importlib

    import torch.nn.functional as F

    import triforce_cli.runtime.model as model_module

    attention_module = importlib.import_module("triforce_cli.kernels.attention")  # the package's name is a function

    model = make_model(seed=5, vocab_size=64, num_layers=num_layers).loaded.model.to(device, dtype)
    model.use_attention("sdpa")
    cfg = model.config
    if kind == "full":
        cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1024, dtype, device)
        model(torch.arange(PROMPT, device=device) % cfg.vocab_size, 0, cache, decoding=False)
    else:
        cache = prefilled(model, kind, device, dtype)  # the model's dtype, as on a GPU
    make_static(cache, dtype)
    start = cache.length
    cache.prepare(start, 3, padding=1)
    counter = StepOps()
    monkeypatch.setattr(F, "rms_norm", counter.one_op(F.rms_norm))
    monkeypatch.setattr(model_module, "linear", counter.one_op(model_module.linear))
    monkeypatch.setattr(attention_module, "float32_bmm", counter.one_op(attention_module.float32_bmm))
    with torch.no_grad(), counter:
        model.compute_logits(torch.arange(4, device=device), torch.arange(start, start + 4, device=device), cache)
    monkeypatch.undo()
    return counter


@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_static_step_costs_at_most_20_ops_per_layer(dtype, kind, monkeypatch):
    """What a CUDA graph replays per layer: a norm, the fused QKV product, RoPE (2), two cache writes, attention
    (scores with scale and mask, softmax, the split weights, their product with the values, the sum of the parts),
    the output product, a residual, a norm, gate/up, SiLU, a product, down, a residual; the mask and slots are
    built once per step, not per layer. Embedding and head ops cancel in the difference of a 3- and a 1-layer
    step. (On the full cache the step once dispatched 40 ops per layer in float32, 45 in bfloat16, counted so.)"""
    one, three = (count_static_step(layers, dtype, kind, monkeypatch) for layers in (1, 3))
    per_layer = (three.ops - one.ops) / 2
    assert per_layer <= 20, per_layer


@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
def test_a_static_step_makes_no_tensor_from_host_data(kind, monkeypatch):
    """Nothing inside the step makes a tensor of Python values (torch.tensor(layer) once did, in every layer): on a
    GPU that is a host-to-device copy, which a CUDA graph cannot capture."""
    counter = count_static_step(2, torch.float32, kind, monkeypatch)
    assert counter.ops > 0 and counter.from_host == 0


class TestFlashDecoding:
    """flash_attn_with_kvcache's contract, checked on the CPU by a stand-in that enforces it and computes the
    reference: the same call runs the real kernel on a GPU."""

    @staticmethod
    def window_of(window_size: tuple[int, int]) -> int | None:
        """The sliding window of flash-attn's window_size: (left, 0), left keys before each query's own; (-1, -1)
        none."""
        left, right = window_size
        assert (left, right) == (-1, -1) or (left >= 0 and right == 0)
        return None if left < 0 else left + 1

    def stand_in(self, q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, window_size=(-1, -1)):
        assert q.dim() == k_cache.dim() == 4 and q.shape[0] == k_cache.shape[0] == 1  # (batch, seq, heads, dim)
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1  # all flash-attn asks of a cache's strides
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (1,) and causal
        seen = int(cache_seqlens[0])
        keys, values = k_cache[0, :seen].transpose(0, 1), v_cache[0, :seen].transpose(0, 1)
        window = self.window_of(window_size)
        return attention_reference(q[0].transpose(0, 1), keys, values, softmax_scale, window).transpose(0, 1)[None]

    def prefill_stand_in(self, q, k, v, softmax_scale, causal, window_size=(-1, -1)):
        """flash_attn_func, for the eager prefill: (1, T, H, D) tensors, bottom-right causal."""
        assert causal
        keys, values = k[0].transpose(0, 1), v[0].transpose(0, 1)
        out = attention_reference(q[0].transpose(0, 1), keys, values, softmax_scale, self.window_of(window_size))
        return out.transpose(0, 1)[None]

    def test_flash_reads_the_head_major_buffers_in_place_and_compiles(self, monkeypatch):
        monkeypatch.setattr(optional, "flash_attn_with_kvcache", self.stand_in)
        generator = torch.Generator().manual_seed(4)
        keys, values = torch.randn(2, 40, 8, generator=generator), torch.randn(2, 40, 8, generator=generator)
        q = torch.randn(6, 3, 8, generator=generator)
        start = torch.tensor([20], dtype=torch.int32)
        expected = attention_in_cache(q, keys, values, start, 0.3, "sdpa")
        for step in (attention_in_cache, torch.compile(attention_in_cache, fullgraph=True, dynamic=False)):
            torch.testing.assert_close(step(q, keys, values, start, 0.3, "flash"), expected)

    def test_flash_steps_and_prefill_take_a_sliding_window(self, monkeypatch):
        monkeypatch.setattr(optional, "flash_attn_with_kvcache", self.stand_in)
        monkeypatch.setattr(optional, "flash_attn_func", self.prefill_stand_in)
        generator = torch.Generator().manual_seed(5)
        keys, values = torch.randn(2, 40, 8, generator=generator), torch.randn(2, 40, 8, generator=generator)
        q = torch.randn(6, 3, 8, generator=generator)
        start = torch.tensor([20], dtype=torch.int32)
        expected = attention_in_cache(q, keys, values, start, 0.3, "sdpa", window=7)
        assert not torch.allclose(expected, attention_in_cache(q, keys, values, start, 0.3, "sdpa"))
        torch.testing.assert_close(attention_in_cache(q, keys, values, start, 0.3, "flash", window=7), expected)
        view = slice(0, 23)
        out = attention(q, keys[:, view], values[:, view], 0.3, backend="flash", window=7)
        torch.testing.assert_close(out, expected)

    def test_a_model_on_flash_steps_generates_the_eager_tokens(self, monkeypatch):
        monkeypatch.setattr(optional, "flash_attn_with_kvcache", self.stand_in)
        monkeypatch.setattr(optional, "flash_attn_func", self.prefill_stand_in)
        greedy = SamplingConfig(temperature=0)
        eager = make_model(seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False)
        compiled = compiled_model()
        compiled.model.use_attention("flash")
        config = small_config(max_new_tokens=16, sampling=greedy)
        prompt = random_prompt(PROMPT, 64, seed=6)
        expected = Engine(eager.loaded, config).generate(prompt).token_ids
        assert Engine(compiled, config).generate(prompt).token_ids == expected


class TestChoosingCompile:
    def test_auto_is_graphs_on_cuda_and_eager_on_the_cpu(self):
        assert resolve_steps(None, torch.device("cuda"), "auto") == StepMode.GRAPHS
        assert resolve_steps(None, torch.device("cpu"), "auto") == StepMode.EAGER
        assert resolve_steps("compiled", torch.device("cpu"), "dense") == StepMode.COMPILED
        assert resolve_weights("auto", torch.float32, torch.device("cpu"), "cpu", compiled=True) == "dense"

    @pytest.mark.parametrize("steps", ["graphs", "compiled"])
    def test_half_weights_cannot_take_fixed_shape_steps(self, steps):
        with pytest.raises(ConfigError, match=f"`steps` {steps} runs dense weights only, not half"):
            resolve_steps(steps, torch.device("cpu"), "half")

    def test_cli_compile_with_half_weights_is_one_line(self, tmp_path):
        prompt = tmp_path / "p.txt"
        prompt.write_text("hello")
        result = CliRunner().invoke(app, ["generate", "-p", str(prompt), "--compile", "--weights", "half"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr.strip().startswith("error: --steps compiled runs dense") and result.stderr.count("\n") == 1

    def test_cli_steps_and_a_shorthand_that_disagree_are_one_line(self, tmp_path):
        prompt = tmp_path / "p.txt"
        prompt.write_text("hello")
        result = CliRunner().invoke(app, ["generate", "-p", str(prompt), "--no-compile", "--steps", "graphs"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr.strip() == "error: --no-compile means --steps eager, not --steps graphs: give one of them"


@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
def test_cpu_and_sdpa_kernels_agree(small, kind):
    model = small.model
    outputs = {}
    for backend in ("cpu", "sdpa"):
        model.use_attention(backend)
        cache = prefilled(model, kind)
        outputs[backend] = model(torch.tensor([3, 5, 7, 11]), cache.length, cache, num_logits=4)
    model.use_attention("cpu")
    torch.testing.assert_close(outputs["sdpa"], outputs["cpu"], rtol=1e-4, atol=1e-4)


def test_greedy_modes_agree_on_sdpa(small):
    model = small
    greedy = SamplingConfig(temperature=0)
    prompt = torch.randint(0, 64, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    model.model.use_attention("sdpa")
    try:
        expected = Engine(model, EngineConfig(mode="autoregressive", max_new_tokens=24, sampling=greedy)).generate(
            prompt
        )
        for mode in ("retrieval", "streaming", "triforce"):
            config = small_config(mode=mode, sampling=greedy)
            assert Engine(model, config).generate(prompt).token_ids == expected.token_ids, mode
    finally:
        model.model.use_attention("cpu")


class TestChoosingKernels:
    def test_auto_on_the_cpu(self):
        assert attention_backend(torch.device("cpu"), torch.float32) == "cpu"
        assert resolve_attention("auto", torch.device("cpu"), torch.float32, "auto") == "cpu"

    @pytest.mark.parametrize(
        ("requested", "weights", "fragment"),
        [
            ("flash", "dense", "needs a CUDA GPU"),
            ("sdpa", "half", "use `weights` dense"),
            ("tiled", "dense", "unknown"),
        ],
    )
    def test_a_backend_that_cannot_run_is_one_clear_error(self, requested, weights, fragment):
        with pytest.raises(ConfigError, match=fragment):
            resolve_attention(requested, torch.device("cpu"), torch.float32, weights)

    def test_auto_weights_follow_the_kernels(self):
        cpu = torch.device("cpu")
        assert resolve_weights("auto", torch.float32, cpu, "sdpa") == "dense"
        assert resolve_weights("half", torch.float32, cpu, "cpu") == "half"

    def test_cli_flash_on_a_cpu_is_one_line(self, tmp_path):
        prompt = tmp_path / "p.txt"
        prompt.write_text("hello")
        result = CliRunner().invoke(app, ["generate", "-p", str(prompt), "--attention", "flash", "--device", "cpu"])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr.strip().startswith("error: --attention flash") and result.stderr.count("\n") == 1


def test_info_says_what_a_run_picks():
    result = CliRunner().invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    expected_device = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert facts["device"] == expected_device
    assert facts["attention"] == attention_backend(torch.device(expected_device), getattr(torch, facts["dtype"]))
    assert facts["steps"] == ("graphs" if torch.cuda.is_available() else "eager")
    assert facts["dtype"] in ("float32", "bfloat16")
    assert {"torch", "transformers", "flash-attn"} <= set(facts["versions"])
    plain = CliRunner().invoke(app, ["info"], env={"COLUMNS": "80"})
    assert plain.exit_code == 0 and "what a run picks" in plain.stdout and "…" not in plain.stdout


def test_retrieval_side_structures_stay_in_the_cache_dtype(small):
    """Chunk mean keys are one per chunk in the cache's dtype (bfloat16 on a GPU), never float32 for the whole
    context, and score the same chunks as float32 keys would."""
    model = small.model
    full = prefilled(model, "full", dtype=torch.float32)
    half_full = full_cache_for(model, 2 * PROMPT)
    half_full.keys = full.keys.to(torch.bfloat16)
    half_full.values = full.values.to(torch.bfloat16)
    half_full.length, half_full.queries, half_full.query_start = full.length, full.queries, full.query_start
    fp32, bf16 = RetrievalCache(full, 32, 8, 32), RetrievalCache(half_full, 32, 8, 32)
    assert bf16.mean_keys.dtype == torch.bfloat16 and bf16.mean_keys.shape[2] == 2 * PROMPT // 8
    fp32.select_chunks()
    bf16.select_chunks()
    assert torch.equal(fp32.chunk_ids, bf16.chunk_ids)


@pytest.mark.cuda
@CUDA
class TestOnAGpu:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_a_static_step_costs_at_most_20_ops_per_layer(self, dtype, monkeypatch):
        one, three = (count_static_step(layers, dtype, "full", monkeypatch, "cuda") for layers in (1, 3))
        assert (three.ops - one.ops) / 2 <= 20 and three.from_host == 0

    def test_flash_and_sdpa_agree(self):
        from triforce_cli.kernels.attention import flash_attention, torch_attention
        from triforce_cli.kernels.optional import flash_attn_func

        if flash_attn_func is None:
            pytest.skip("flash-attn is not installed")
        q = torch.randn(8, 5, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        torch.testing.assert_close(
            flash_attention(q, k, v, 0.125), torch_attention(q, k, v, 0.125), rtol=2e-2, atol=2e-2
        )

    @pytest.mark.parametrize(("num_queries", "num_keys"), [(1, 3000), (300, 300), (5, 3000), (300, 3000)])
    @pytest.mark.parametrize("head_dim", [64, 128])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_the_sdpa_backend_matches_the_reference(self, dtype, head_dim, num_queries, num_keys, monkeypatch):
        """CUDA's fused kernels (flash for bfloat16, memory-efficient for float32) on the context part and the
        causal square, merged by log-sum-exp, with no call of blocked_attention."""
        import sys

        from triforce_cli.kernels.attention import torch_attention

        module = sys.modules["triforce_cli.kernels.attention"]
        monkeypatch.setattr(module, "blocked_attention", lambda *a: pytest.fail("blocked_attention ran"))
        generator = torch.Generator().manual_seed(num_keys)
        scale = head_dim**-0.5
        q = torch.randn(8, num_queries, head_dim, generator=generator).to("cuda", dtype)
        k, v = (torch.randn(2, num_keys, head_dim, generator=generator).to("cuda", dtype) for _ in range(2))
        exact = attention_reference(q.double(), k.double(), v.double(), scale)
        reference_error = (attention_reference(q, k, v, scale).double() - exact).abs().max().item()
        error = (torch_attention(q, k, v, scale).double() - exact).abs().max().item()
        assert error <= 4 * reference_error + 1e-5

    def test_blocked_attention_scores_bfloat16_in_float32(self):
        """The fallback's float32_bmm: bmm's out_dtype where torch has it, upcast factors otherwise."""
        from triforce_cli.kernels.attention import blocked_attention

        generator = torch.Generator().manual_seed(0)
        q = torch.randn(8, 300, 64, generator=generator).to("cuda", torch.bfloat16)
        k, v = (torch.randn(2, 3000, 64, generator=generator).to("cuda", torch.bfloat16) for _ in range(2))
        exact = attention_reference(q.double(), k.double(), v.double(), 0.125)
        reference_error = (attention_reference(q, k, v, 0.125).double() - exact).abs().max().item()
        error = (blocked_attention(q, k, v, 0.125).double() - exact).abs().max().item()
        assert error <= 4 * reference_error + 1e-5

    def test_a_compiled_step_scores_bfloat16_inputs_in_float32(self):
        q, keys, values, start, exact = (x.cuda() for x in bfloat16_step())
        step = torch.compile(attention_in_cache, fullgraph=True, dynamic=False)
        out = step(q, keys, values, start, 64**-0.5, "sdpa")
        assert (out.double() - exact).abs().max().item() <= 2 * 2**-8 * exact.abs().max().item()

    @staticmethod
    def gpu_model(dtype: torch.dtype = torch.float32, steps: StepMode = StepMode.EAGER):
        loaded = make_model(
            seed=5, vocab_size=64, num_layers=2, initializer_range=0.3, tie_word_embeddings=False
        ).loaded
        loaded.model.to("cuda", dtype)
        loaded.model.use_steps(steps)
        return loaded

    @pytest.mark.parametrize("steps", [StepMode.GRAPHS, StepMode.COMPILED])
    def test_cuda_graphs_generate_the_eager_tokens_in_every_mode(self, steps):
        greedy = SamplingConfig(temperature=0)
        eager, graphed = self.gpu_model(), self.gpu_model(steps=steps)
        prompt = random_prompt(PROMPT, 64, seed=3)
        for mode in ("autoregressive", "retrieval", "streaming", "triforce"):
            config = small_config(mode=mode, sampling=greedy)
            expected = Engine(eager, config).generate(prompt).token_ids
            assert Engine(graphed, config).generate(prompt).token_ids == expected, mode
        assert graphed.model.step_graphs.captured > 0

    def test_rounds_queued_ahead_of_their_reads_give_the_tokens_read_round_by_round(self, monkeypatch):
        """On CUDA a round goes to the device before the round before it is read (rounds.decode's lookahead): graphed
        plain decoding and the default give the tokens they give without it, and the reads were queued."""
        graphed = self.gpu_model(steps=StepMode.GRAPHS)
        prompt = random_prompt(PROMPT, 64, seed=3)
        queued, read = [], rounds.queued_read
        for mode in ("autoregressive", "triforce"):
            config = small_config(mode=mode, sampling=SamplingConfig(temperature=0))
            monkeypatch.setattr(engine_module, "decode", partial(rounds.decode, lookahead=False))
            expected = Engine(graphed, config).generate(prompt).token_ids
            monkeypatch.undo()
            queued.clear()
            monkeypatch.setattr(rounds, "queued_read", lambda ids: queued.append(ids) or read(ids))
            assert Engine(graphed, config).generate(prompt).token_ids == expected, mode
            monkeypatch.undo()
            assert mode != "autoregressive" or len(queued) == config.max_new_tokens - 1

    @pytest.mark.parametrize("steps", [StepMode.GRAPHS, StepMode.COMPILED])
    def test_a_graphed_step_never_waits_for_the_host(self, steps):
        """After the first replays (warm-up and capture), a decode step queues its work and returns."""
        model = self.gpu_model(torch.bfloat16, steps=steps).model
        cfg = model.config
        cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.bfloat16, "cuda")
        model(torch.arange(PROMPT, device="cuda") % cfg.vocab_size, 0, cache, decoding=False)
        make_static(cache, torch.bfloat16)
        tokens = torch.tensor([1, 2, 3], device="cuda")
        for start in (PROMPT, PROMPT + 3, PROMPT + 6):
            model(tokens, start, cache)
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(tokens, PROMPT + 9, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_greedy_modes_agree_on_cuda(self):
        cfg = llama_config(vocab_size=64, num_layers=2)
        torch.manual_seed(0)
        model = wrap(LlamaForCausalLM(cfg).eval(), cfg)
        model.model.to("cuda")
        greedy = SamplingConfig(temperature=0)
        prompt = torch.randint(0, 64, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
        expected = Engine(model, EngineConfig(mode="autoregressive", max_new_tokens=24, sampling=greedy)).generate(
            prompt
        )
        config = small_config(max_new_tokens=24, sampling=greedy)
        assert Engine(model, config).generate(prompt).token_ids == expected.token_ids


class TestMemory:
    CONFIG = small_config(max_new_tokens=16)

    def test_cache_bytes_are_what_the_caches_allocate(self, small):
        engine = Engine(small, self.CONFIG, drafter=small)
        caches = engine._allocate(PROMPT)
        allocated = sum(
            t.nbytes
            for t in (caches.full.keys, caches.full.values, caches.retrieval.keys, caches.retrieval.values,
                      caches.retrieval.mean_keys, caches.streaming.keys, caches.streaming.values)
        )  # fmt: skip
        assert engine.cache_bytes(PROMPT) == allocated

    def test_caches_that_cannot_fit_are_one_clear_error_before_allocating(self, small, monkeypatch):
        monkeypatch.setattr(sizing, "available_memory", lambda device: 1000)
        engine = Engine(small, self.CONFIG)
        with pytest.raises(ConfigError, match=r"need [\d.]+ KiB on cpu, which has 1000 B free: use a shorter prompt"):
            engine.generate(list(range(PROMPT)))
        assert engine._caches.full is None  # nothing was allocated


GIB = 2**30


@pytest.mark.parametrize(
    ("free", "total", "reserved", "allocated", "fraction", "expected"),
    [
        # torch's caching allocator holds memory the driver reports as used: it is free for the caches; 5% of the
        # card stays for the allocator's rounding, graph pools and activations (the CUDA context exists already)
        (10 * GIB, 24 * GIB, 3 * GIB, 1 * GIB, 1.0, 12 * GIB - int(0.05 * 24 * GIB)),
        # an 80 GiB card held to 0.3 of itself (torch.cuda.set_per_process_memory_fraction) offers 24 GiB less what
        # is allocated, whatever the driver reports free, and the slack is a share of those 24 GiB
        (70 * GIB, 80 * GIB, 6 * GIB, 5 * GIB, 0.3, int(80 * GIB * 0.3) - 5 * GIB - int(0.05 * int(80 * GIB * 0.3))),
    ],
)
def test_free_gpu_memory_is_what_this_process_may_still_allocate(
    free, total, reserved, allocated, fraction, expected, monkeypatch
):
    from triforce_cli.runtime import environment

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
    assert environment.available_memory(torch.device("cuda", 0)) == expected


def test_the_gpu_check_script_runs_its_random_weight_comparison_on_the_cpu(tmp_path):
    """scripts/gpu_check.py runs, which scripts/gpu-check.sh runs on a GPU, on a tiny shape here: every run lands
    in the JSON lines and the summary as it finishes, one refused (an empty prompt) or taking too long (a
    128K prompt on the CPU, clamped to the model's positions less the new tokens) is recorded and the others still
    run; bash can parse the shell script (tests/test_gpu_check.py checks its pieces one by one)."""
    root = Path(__file__).resolve().parent.parent
    assert subprocess.run(["bash", "-n", str(root / "scripts" / "gpu-check.sh")], check=False).returncode == 0
    runs = "256:none:autoregressive,0:none:autoregressive,131072:none:autoregressive,384:kv:triforce"
    command = [sys.executable, str(root / "scripts" / "gpu_check.py"), "runs", "--device", "cpu", "--shape", "tiny"]
    command += ["--runs", runs, "--new-tokens", "4", "--memory-limit-gib", "0", "--run-timeout", "20"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]  # refusals and timeouts are outcomes, not defects
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["context"], r["offload"], r["mode"], r["outcome"]) for r in records] == [
        (256, "none", "autoregressive", "ran"),
        (0, "none", "autoregressive", "refused"),
        (131068, "none", "autoregressive", "timeout"),
        (384, "kv", "triforce", "ran"),
    ]
    assert "0 tokens" in records[1]["detail"] and records[2]["requested_context"] == 131072
    assert all(r["ms_per_token"] > 0 and r["planned_ms_per_token"] > 0 for r in records if r["outcome"] == "ran")
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("[runs]") == 4 + 3 and "acceptance is not" in summary  # 4 runs, machine, set-up, note
