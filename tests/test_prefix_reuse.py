"""A prompt that starts with the previous prompt's ids keeps the full cache's whole prefill chunks of that prefix and
prefills only the rest (Engine.generate, _Prefilled): the kept positions hold what a fresh prefill writes, bit for
bit, so every mode's output is the fresh engine's, token for token, greedy and seeded."""

import pytest
import torch
import triforce_cli.cache.retrieval as retrieval_module
from helpers import make_model, random_prompt, small_config

from triforce_cli.decoding.config import MODES
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig

CHUNK = 16  # prefill chunk: a 64-token document is four of them
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return make_model(seed=5, vocab_size=VOCAB, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded


def config(mode: str, sampling: SamplingConfig, **changes):
    return small_config(mode=mode, sampling=sampling, **{"prefill_chunk": CHUNK, "cache_positions": 256, **changes})


DOCUMENT = random_prompt(70, VOCAB, seed=1)  # four whole chunks and 6 tokens
QUESTION = random_prompt(9, VOCAB, seed=2)
OTHER = random_prompt(12, VOCAB, seed=3)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=4)])
@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_extending_the_last_one_prefills_only_its_new_chunks_and_gives_the_fresh_tokens(model, mode, sampling):
    engine = Engine(model, config(mode, sampling))
    first = engine.generate(DOCUMENT)
    assert first.stats.reused_tokens == 0
    longer = DOCUMENT + first.token_ids + QUESTION  # a second question after the first answer
    reused = engine.generate(longer)
    assert reused.stats.reused_tokens == 64  # the whole chunks of the document; the answer was decoded, not prefilled
    assert len(reused.stats.prefill_chunk_seconds) == -(-(len(longer) - 64) // CHUNK)
    fresh = Engine(model, config(mode, sampling)).generate(longer)
    assert reused.token_ids == fresh.token_ids


def test_the_kept_positions_hold_a_fresh_prefill_bit_for_bit(model, monkeypatch):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy))
    engine.generate(DOCUMENT)
    summarised = []  # the positions each chunk summary computation covers
    real = retrieval_module.chunk_summaries
    monkeypatch.setattr(
        retrieval_module,
        "chunk_summaries",
        lambda keys, size, score: summarised.append(keys.shape[1]) or real(keys, size, score),
    )
    longer = DOCUMENT[:64] + OTHER
    engine.generate(longer)
    assert summarised and max(summarised) < 64  # the 64 kept positions' chunks were not summarised again
    monkeypatch.undo()
    fresh = Engine(model, config("triforce", greedy))
    fresh.generate(longer)
    held, expected = engine._caches.full, fresh._caches.full
    length = len(longer)
    assert torch.equal(held.keys[:, :, :length], expected.keys[:, :, :length])
    assert torch.equal(held.values[:, :, :length], expected.values[:, :, :length])
    retrieval, expected_retrieval = engine._caches.retrieval, fresh._caches.retrieval
    chunks = length // 8  # the prompt's whole chunks (decoding's keys depend on how its steps were grouped)
    assert min(retrieval.num_mean_keys, expected_retrieval.num_mean_keys) >= chunks >= 8
    assert torch.equal(retrieval.chunk_keys[:, :, :, :chunks], expected_retrieval.chunk_keys[:, :, :, :chunks])


def test_a_prompt_that_differs_early_or_a_different_chunking_keeps_nothing(model):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("retrieval", greedy))
    engine.generate(DOCUMENT)
    changed = [DOCUMENT[0] + 1, *DOCUMENT[1:]]  # a document edited at its first token
    assert engine.generate(changed).stats.reused_tokens == 0
    assert engine.generate(changed[:40] + OTHER).stats.reused_tokens == 32  # two shared whole chunks
    other_chunking = engine.reconfigured(config("retrieval", greedy, prefill_chunk=8), None)
    assert other_chunking.generate(changed[:40] + QUESTION).stats.reused_tokens == 0


def test_a_restored_prompt_state_is_reused_by_the_next_prompt(model):
    greedy = SamplingConfig(temperature=0)
    saved = []
    Engine(model, config("triforce", greedy)).generate(DOCUMENT, on_prompt_state=saved.append)
    engine = Engine(model, config("triforce", greedy))
    engine.generate(DOCUMENT, prompt_state=saved[0])
    longer = DOCUMENT + QUESTION
    result = engine.generate(longer)
    assert result.stats.reused_tokens == 64
    assert result.token_ids == Engine(model, config("triforce", greedy)).generate(longer).token_ids


def test_an_interrupted_prefill_leaves_nothing_to_reuse(model, monkeypatch):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("autoregressive", greedy))
    engine.generate(DOCUMENT)
    calls = []

    def interrupt(name, done, total):
        calls.append(done)
        if len(calls) == 2:
            raise KeyboardInterrupt

    assert engine.generate(OTHER + DOCUMENT, on_prefill=interrupt).stats.stop_reason == "interrupted"
    assert engine._caches.prefilled is None
    result = engine.generate(OTHER + DOCUMENT)
    assert result.stats.reused_tokens == 0
    assert result.token_ids == Engine(model, config("autoregressive", greedy)).generate(OTHER + DOCUMENT).token_ids


@pytest.mark.parametrize("on_chip_layers", [0, 1])
def test_an_offloaded_full_cache_keeps_the_shared_prefix_too(model, on_chip_layers):
    """The layer-by-layer prefill of an offloaded cache starts at the kept positions, as the chunked one does."""
    greedy = SamplingConfig(temperature=0)
    offloaded = config("triforce", greedy, offload="kv", on_chip_layers=on_chip_layers)
    engine = Engine(model, offloaded)
    first = engine.generate(DOCUMENT)
    longer = DOCUMENT + first.token_ids + QUESTION
    reused = engine.generate(longer)
    assert reused.stats.reused_tokens == 64
    assert reused.token_ids == Engine(model, config("triforce", greedy)).generate(longer).token_ids


def test_the_drafter_prefills_only_its_sinks_and_the_last_two_windows(model):
    """The drafter's cache keeps the sinks and one window, so its prefill reads no further back than two windows:
    its forwards cover the same positions for a fresh prompt and for one that reuses a prefix."""
    drafter = make_model(seed=6, vocab_size=VOCAB, num_layers=1, initializer_range=0.3).loaded
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy, max_new_tokens=1), drafter=drafter)
    prompt = random_prompt(120, VOCAB, seed=7)  # 4 sinks, then more than two 24-token windows
    positions = []
    real = drafter.model.forward
    drafter.model.forward = lambda tokens, start, cache, **kw: (
        positions.extend(range(start, start + len(tokens))) or real(tokens, start, cache, **kw)
    )
    try:
        engine.generate(prompt)
    finally:
        drafter.model.forward = real
    assert positions == [*range(4), *range(120 - 48, 120)]
