"""Phi-3 (model type phi3, LongRoPE) against transformers' Phi3ForCausalLM, and LongRoPE's set of frequencies chosen
once per generation (Transformer.fit_rope) so that every mode stays token-for-token the autoregressive one."""

import pytest
import torch
from helpers import (
    F16_KV_TOLERANCE,
    F16_SPLIT_TOLERANCE,
    full_cache_for,
    llama_config,
    random_prompt,
    reference_logits,
    save_tokenizer,
    wrap,
)
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import LlamaConfig, Phi3Config, Phi3ForCausalLM

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.prompt_state import PromptCache
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.runtime.loading import load_model
from triforce_cli.runtime.model import MAX_STEP_TOKENS, ModelConfig, Transformer, UnsupportedModelError

ATOL = 1e-5
ORIGINAL = 64  # original_max_position_embeddings: a context past it takes the long factors
VOCAB = 128
HEAD_DIM = 16  # hidden 64 over 4 heads: 8 factors per set
# (tokens of the sequence, tokens of its first forward): below ORIGINAL, and past it from the first forward on, so
# that transformers' own cache keeps one set throughout
REGIMES = {"short": (48, 20), "long": (96, 70)}
SETTINGS = {"budget": 16, "chunk_size": 8, "draft_window": 16, "sink_tokens": 4, "max_new_tokens": 24}


def phi3_config(**changes) -> Phi3Config:
    """A tiny Phi-3 with random LongRoPE factors, short ones near 1 and long ones up to 11."""
    factors = torch.Generator().manual_seed(0)
    rope = {
        "rope_type": "longrope",
        "short_factor": (1 + torch.rand(HEAD_DIM // 2, generator=factors)).tolist(),
        "long_factor": (1 + 10 * torch.rand(HEAD_DIM // 2, generator=factors)).tolist(),
        "rope_theta": 10000.0,
    }
    settings = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_heads": 4,
        "num_kv_heads": 2,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": ORIGINAL,
        "tie_word_embeddings": False,
        "initializer_range": 0.2,
        "rope_parameters": rope,
        "sliding_window": None,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    return llama_config(config_class=Phi3Config, **{**settings, **changes})


def phi3(seed: int = 0) -> tuple[Phi3Config, Phi3ForCausalLM]:
    cfg = phi3_config()
    torch.manual_seed(seed)
    return cfg, Phi3ForCausalLM(cfg).eval()


def test_a_windowed_phi3_is_transformers_phi3():
    """Phi-3 with a sliding window (as Phi-3-mini-4k sets one): prefill logits past the window are transformers'."""
    cfg = phi3_config(sliding_window=12)
    torch.manual_seed(3)
    ref = Phi3ForCausalLM(cfg).eval()
    ours = wrap(ref, cfg).model
    ids = random_prompt(40, VOCAB, seed=4)
    ours.fit_rope(len(ids))
    torch.testing.assert_close(our_logits(ours, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


def our_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), 0, full_cache_for(model))


def our_steps(model: Transformer, ids: list[int], first: int) -> torch.Tensor:
    """Logits (T, V) of a forward of ids[:first], then of one forward per token, on one cache."""
    cache = full_cache_for(model)
    steps = [model(torch.tensor(ids[:first]), 0, cache)]
    steps += [model(torch.tensor([token]), first + i, cache) for i, token in enumerate(ids[first:])]
    return torch.cat(steps)


@torch.no_grad()
def reference_steps(ref: Phi3ForCausalLM, ids: list[int], first: int) -> torch.Tensor:
    """transformers' logits (T, V) of a forward of ids[:first], then of one forward per token with its own cache."""
    out = ref(torch.tensor([ids[:first]]), use_cache=True)
    cache, steps = out.cache, [out.logits[0]]
    for token in ids[first:]:
        out = ref(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[0])
    return torch.cat(steps).float()


def test_phi3_configs_accepted_and_refused():
    """LongRoPE is accepted, and a sliding window on every layer (Phi-3-mini-4k's 2047); partial rotary is refused
    by name."""
    cfg = ModelConfig.from_hf(phi3_config())
    assert cfg.rope["rope_type"] == "longrope" and cfg.rope["original_max_position_embeddings"] == ORIGINAL
    assert cfg.sliding_windows == ()
    assert ModelConfig.from_hf(phi3_config(sliding_window=32)).sliding_windows == (32, 32)
    partial = phi3_config()
    partial.rope_parameters["partial_rotary_factor"] = 0.5
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        ModelConfig.from_hf(partial)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_phi3_prefill_and_decode_steps_match_transformers(regime):
    """With the set transformers picks for the sequence, a prefill and decode steps on the cache equal its logits,
    both its whole-sequence forward and its own cached steps; the other set does not."""
    length, first = REGIMES[regime]
    cfg, ref = phi3()
    model = wrap(ref, cfg).model
    ids = random_prompt(length, VOCAB, seed=3)
    model.fit_rope(length)
    assert model.rope_factors == regime
    whole = our_logits(model, ids)
    expected = reference_logits(ref, ids)
    assert expected.std() > 0.1
    torch.testing.assert_close(whole, expected, **F16_KV_TOLERANCE)
    torch.testing.assert_close(reference_steps(ref, ids, first), expected, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(our_steps(model, ids, first), expected, **F16_KV_TOLERANCE)
    model.fit_rope(ORIGINAL + 1 if regime == "short" else ORIGINAL)  # the other set
    assert not torch.allclose(our_logits(model, ids), expected, atol=1e-3)


def test_phi3_set_stays_fixed_within_a_generation():
    """Fitted for 96 positions, forwards that see fewer than ORIGINAL (a prefill, a verification of several tokens,
    single steps) still take the long set: they equal one forward of the whole sequence, which transformers
    computes with the long set, where transformers' own short forward of the prefix does not."""
    cfg, ref = phi3(seed=1)
    model = wrap(ref, cfg).model
    buffer = model.inv_freq.data_ptr()
    ids = random_prompt(96, VOCAB, seed=4)
    model.fit_rope(len(ids))
    assert model.rope_factors == "long" and model.inv_freq.data_ptr() == buffer  # copied into the same buffer
    whole = our_logits(model, ids)
    torch.testing.assert_close(whole, reference_logits(ref, ids), **F16_KV_TOLERANCE)
    cache = full_cache_for(model)
    forwards = [model(torch.tensor(ids[:40]), 0, cache), model(torch.tensor(ids[40:48]), 40, cache)]
    forwards += [model(torch.tensor([token]), 48 + i, cache) for i, token in enumerate(ids[48:56])]
    torch.testing.assert_close(torch.cat(forwards), whole[:56], **F16_SPLIT_TOLERANCE)
    assert not torch.allclose(reference_logits(ref, ids[:40]), whole[:40], atol=1e-3)  # transformers: short there
    model.fit_rope(40)
    assert model.rope_factors == "short" and model.inv_freq.data_ptr() == buffer
    torch.testing.assert_close(our_logits(model, ids[:40]), reference_logits(ref, ids[:40]), **F16_KV_TOLERANCE)


def test_a_compiled_step_reads_the_set_fitted_after_it_compiled():
    """fit_rope copies into the buffer a compiled step reads (as a CUDA graph replays it): one graph, compiled with
    fullgraph=True, gives the eager logits of a 4-token verification with the short set, the long one, and back."""
    cfg, ref = phi3(seed=3)
    model = wrap(ref, cfg).model
    counter = CompileCounterWithBackend("aot_eager")
    model.fixed_step = torch.compile(model.compute_logits, backend=counter, fullgraph=True, dynamic=False)
    ids = random_prompt(40, VOCAB, seed=10)
    for length in (40, 96, 40):
        model.fit_rope(length)
        expected = our_logits(model, ids)  # eager: a cache not made static
        cache = full_cache_for(model)
        model(torch.tensor(ids[:36]), 0, cache, decoding=False)
        cache.make_static(cfg.num_attention_heads, MAX_STEP_TOKENS, torch.float32)
        got = model(torch.tensor(ids[36:]), 36, cache)
        assert cache.static_step
        torch.testing.assert_close(got, expected[36:], atol=ATOL, rtol=1e-5)
    assert counter.frame_count == 1


def test_fit_rope_is_a_no_op_without_longrope():
    model = Transformer.from_hf_config(llama_config(config_class=LlamaConfig))
    before = model.inv_freq.clone()
    model.fit_rope(100_000)
    assert model.rope_factors is None and model.rope_factors_for(100_000) is None
    assert torch.equal(model.inv_freq, before)


@pytest.fixture(scope="module")
def saved_phi3(tmp_path_factory):
    """transformers' Phi-3 and the checkpoint it saved, loaded through load_model."""
    folder = tmp_path_factory.mktemp("phi3") / "phi3"
    cfg, ref = phi3(seed=2)
    ref.save_pretrained(folder)
    save_tokenizer(folder, cfg.vocab_size)
    return ref, load_model(str(folder))


def test_phi3_checkpoint_loads_its_fused_projections_as_they_are(saved_phi3):
    """Phi-3's checkpoint stores qkv_proj (q, k, v rows) and gate_up_proj (gate, up rows) under the runtime's names."""
    ref, loaded = saved_phi3
    ours, theirs = loaded.model.model.layers[1], ref.model.layers[1]
    assert torch.equal(ours.self_attn.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
    assert torch.equal(ours.mlp.gate_up_proj.weight, theirs.mlp.gate_up_proj.weight)
    for length in (40, 96):
        ids = random_prompt(length, VOCAB, seed=5)
        loaded.model.fit_rope(length)
        torch.testing.assert_close(our_logits(loaded.model, ids), reference_logits(ref, ids), **F16_KV_TOLERANCE)


@pytest.mark.parametrize(("regime", "prompt_tokens"), [("short", 32), ("long", 56)])
def test_phi3_every_mode_is_greedy_equal(saved_phi3, regime, prompt_tokens):
    """Every mode gives autoregressive's greedy tokens, below the boundary and past it; the long run's prompt alone
    is below it (transformers would switch sets in the middle of the generation), yet the whole run is long."""
    _, loaded = saved_phi3
    ids = random_prompt(prompt_tokens, VOCAB, seed=7)
    greedy = SamplingConfig(temperature=0)
    engine = Engine(loaded, EngineConfig(mode="autoregressive", sampling=greedy, ignore_eos=True, **SETTINGS))
    expected = engine.generate(ids)
    assert loaded.model.rope_factors == regime and len(expected.token_ids) == SETTINGS["max_new_tokens"]
    for mode in ("retrieval", "streaming", "triforce"):
        config = EngineConfig(mode=mode, sampling=greedy, ngram=False, ignore_eos=True, **SETTINGS)
        result = Engine(loaded, config).generate(ids)
        assert result.token_ids == expected.token_ids, mode


def test_phi3_prefix_reuse_only_under_the_same_set(saved_phi3):
    """A prompt extending the last one keeps its prefill's chunks only where both runs take the same set; a
    longer one that crosses into the long set prefills whole, and gives what a fresh engine gives."""
    _, loaded = saved_phi3
    ids = random_prompt(64, VOCAB, seed=8)
    greedy = SamplingConfig(temperature=0)
    reuse = {"max_new_tokens": 8, "prefill_block": 8, "cache_positions": 128}
    config = EngineConfig(mode="autoregressive", sampling=greedy, ignore_eos=True, **{**SETTINGS, **reuse})
    engine = Engine(loaded, config)
    engine.generate(ids[:32])  # 40 positions: short
    same_set = engine.generate(ids[:48])  # 56: short
    assert same_set.stats.reused_tokens > 0
    crossed = engine.generate(ids)  # 72: long
    assert loaded.model.rope_factors == "long" and crossed.stats.reused_tokens == 0
    assert crossed.token_ids == Engine(loaded, config).generate(ids).token_ids


def test_phi3_prompt_cache_keys_name_the_set(saved_phi3, tmp_path):
    """The same prompt ids prefilled for a short and for a long run are two entries of the prompt cache."""
    _, loaded = saved_phi3
    ids = random_prompt(48, VOCAB, seed=9)
    short, long = (PromptCache(tmp_path, loaded, prefill_chunk=8, new_tokens=new) for new in (16, 24))  # 64, 72
    assert short.path_for(ids) != long.path_for(ids)
    assert set(short.block_hashes(ids, 48)).isdisjoint(long.block_hashes(ids, 48))
    shorter = PromptCache(tmp_path, loaded, prefill_chunk=8, new_tokens=8)
    assert short.path_for(ids) == shorter.path_for(ids) and short.block_hashes(ids, 48) == shorter.block_hashes(ids, 48)
