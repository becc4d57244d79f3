"""The GPU path, proven on the CPU where no GPU is at hand.

- Every decode step (the drafter's on its StreamingLLM cache, the retrieval tier's verification, the full
  verification) compiles with torch.compile(fullgraph=True) and gives the eager logits: a graph break here is what
  would stop CUDA-graph capture on a GPU.
- The attention kernels are chosen at one point (kernels.attention_backend): cpu and sdpa agree; a backend that
  cannot run is one clear error; `triforce info` says what a run would pick.
- Tests marked `cuda` (`pytest -m cuda`) run the same on a GPU and skip cleanly without one.
"""

import json

import pytest
import torch
from conftest import full_cache_for, llama_config, wrap
from transformers import LlamaForCausalLM
from typer.testing import CliRunner

from cache import RetrievalCache, StreamingCache
from kernels import attention_backend
from triforce_cli.cli.app import app
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import resolve_attention
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.loading import resolve_weights

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = 64


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    cfg = llama_config(vocab_size=64, num_layers=2)
    return wrap(LlamaForCausalLM(cfg).eval(), cfg)


def prefilled(model, kind: str, device: str = "cpu"):
    """A cache of kind ('full', 'retrieval' or 'streaming') holding a prompt of PROMPT tokens."""
    cfg = model.config
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).to(device)
    if kind == "streaming":
        dtype = model.model.embed_tokens.weight.dtype
        streaming = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 24, 8, dtype, device)
        for start in range(0, PROMPT, 8):  # the StreamingLLM cache takes at most 8 positions per forward
            model(prompt[start : start + 8], start, streaming)
        return streaming
    full = full_cache_for(model, 2 * PROMPT)
    model(prompt, 0, full)
    if kind == "full":
        return full
    retrieval = RetrievalCache(full, 32, 8, 32)
    retrieval.select_chunks()
    return retrieval


@pytest.mark.parametrize(("kind", "new_tokens"), [("full", 7), ("retrieval", 3), ("streaming", 1)])
def test_every_decode_step_compiles_without_a_graph_break(small, kind, new_tokens):
    """The full tier verifies gamma2 + 1 = 7 tokens, the retrieval tier gamma1 + 1 = 3, the drafter drafts 1."""
    model = small.model
    cache = prefilled(model, kind)
    start = cache.length
    tokens = torch.randint(0, model.config.vocab_size, (new_tokens,), generator=torch.Generator().manual_seed(2))

    def step(tokens: torch.Tensor, start: int) -> torch.Tensor:
        return model.compute_logits(tokens, start, cache, num_logits=tokens.shape[0])

    with torch.no_grad():
        eager = step(tokens, start)
        cache.rollback(start)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(tokens, start)
    assert compiled.shape == (new_tokens, model.config.vocab_size)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


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
            config = EngineConfig(
                mode=mode, budget=32, chunk_size=8, draft_window=24, sink_tokens=4, max_new_tokens=24, sampling=greedy
            )
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
            ("sdpa", "half", "use --weights dense"),
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
    assert facts["compile"] is False and facts["dtype"] in ("float32", "bfloat16")
    assert {"torch", "transformers", "flash-attn"} <= set(facts["versions"])
    plain = CliRunner().invoke(app, ["info"], env={"COLUMNS": "80"})
    assert plain.exit_code == 0 and "what a run picks" in plain.stdout and "…" not in plain.stdout


def test_retrieval_side_structures_stay_in_the_cache_dtype(small):
    """Chunk mean keys are one per chunk in the cache's dtype (bfloat16 on a GPU), never float32 for the whole
    context, and score the same chunks as float32 keys would."""
    model = small.model
    full = prefilled(model, "full")
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
    def test_flash_and_sdpa_agree(self):
        from kernels.attention import flash_attention, sdpa_attention
        from kernels.optional import flash_attn_func

        if flash_attn_func is None:
            pytest.skip("flash-attn is not installed")
        q = torch.randn(8, 5, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        torch.testing.assert_close(
            flash_attention(q, k, v, 0.125), sdpa_attention(q, k, v, 0.125), rtol=2e-2, atol=2e-2
        )

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
        config = EngineConfig(
            budget=32, chunk_size=8, draft_window=24, sink_tokens=4, max_new_tokens=24, sampling=greedy
        )
        assert Engine(model, config).generate(prompt).token_ids == expected.token_ids


class TestMemory:
    CONFIG = EngineConfig(budget=32, chunk_size=8, draft_window=24, sink_tokens=4, max_new_tokens=16)

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
        import triforce_cli.decoding.engine as engine_module

        monkeypatch.setattr(engine_module, "available_memory", lambda device: 1000)
        engine = Engine(small, self.CONFIG)
        with pytest.raises(ConfigError, match=r"need [\d.]+ KiB, but cpu has 1000 B free: use a shorter prompt"):
            engine.generate(list(range(PROMPT)))
        assert engine._caches is None  # nothing was allocated
