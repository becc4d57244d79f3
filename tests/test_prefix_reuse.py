"""A prompt that starts with ids the full cache holds keeps those positions and prefills only the rest (Engine.generate,
cache_pool.Held): under the numeric contract (Engine.exact_positions: a float32 target on the CPU, eager steps) everything
the cache holds, the last prompt and the answer decoded after it, up to any position; elsewhere only the whole
prefill chunks of the last prompt. The kept positions hold what a fresh prefill writes, bit for bit, so every mode's
output is the fresh engine's, token for token, greedy and seeded.

Under the contract that equality rests on the CPU kernels computing a row whatever the rows beside it
(test_numeric_contract.py): the tests marked below as resting on it fail where the kernels do not keep it."""

import pytest
import torch
import triforce_cli.cache.retrieval as retrieval_module
from helpers import make_model, random_prompt, small_config, tiled

from triforce_cli.decoding.config import MODES
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig

CHUNK = 16  # prefill chunk: a 64-token document is four of them
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return tiled(
        make_model(seed=5, vocab_size=VOCAB, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    )


def config(mode: str, sampling: SamplingConfig, **changes):
    """Every tier drafts its gamma (at the costed default's prices the tiny target drafting for itself never would)."""
    settings = {"prefill_block": CHUNK, "cache_positions": 256, "gamma_policy": "fixed"}
    return small_config(mode=mode, sampling=sampling, **{**settings, **changes})


@pytest.fixture
def chunks_only(monkeypatch):
    """Engines computing outside the numeric contract, as on a GPU: only whole prefill chunks are kept."""
    monkeypatch.setattr(Engine, "exact_positions", property(lambda engine: False))


DOCUMENT = random_prompt(70, VOCAB, seed=1)  # four whole chunks and 6 tokens
QUESTION = random_prompt(9, VOCAB, seed=2)
OTHER = random_prompt(12, VOCAB, seed=3)
NEW_TOKENS = 24  # small_config's max_new_tokens; the tiny model has no end-of-sequence token


def test_the_tiny_model_computes_under_the_numeric_contract(model):
    assert Engine(model, config("triforce", SamplingConfig(temperature=0))).exact_positions


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, seed=4)])
@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_extending_the_last_one_and_its_answer_prefills_only_its_new_tokens(model, mode, sampling):
    """Rests on the numeric contract for the tokens."""
    engine = Engine(model, config(mode, sampling))
    first = engine.generate(DOCUMENT)
    assert first.stats.reused_tokens == 0 and len(first.token_ids) == NEW_TOKENS
    held = engine._caches.holds
    assert held.ids == DOCUMENT + first.token_ids
    # every committed token but the last, whose keys the next forward writes: no draft rolled back
    assert held.length == engine._caches.full.length == len(DOCUMENT) + NEW_TOKENS - 1
    longer = DOCUMENT + first.token_ids + QUESTION  # a second question after the first answer
    reused = engine.generate(longer)
    assert reused.stats.reused_tokens == len(DOCUMENT) + NEW_TOKENS - 1  # prompt, answer and partial chunks
    assert len(reused.stats.prefill_chunk_seconds) == 1  # the answer's last token and the question: one forward
    fresh = Engine(model, config(mode, sampling)).generate(longer)
    assert reused.token_ids == fresh.token_ids


@pytest.mark.parametrize("mode", MODES)
def test_without_the_numeric_contract_only_whole_prefill_chunks_are_kept(model, mode, chunks_only):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config(mode, greedy))
    first = engine.generate(DOCUMENT)
    longer = DOCUMENT + first.token_ids + QUESTION
    reused = engine.generate(longer)
    assert reused.stats.reused_tokens == 64  # the whole chunks of the document; the answer was decoded, not prefilled
    assert len(reused.stats.prefill_chunk_seconds) == -(-(len(longer) - 64) // CHUNK)
    assert reused.token_ids == Engine(model, config(mode, greedy)).generate(longer).token_ids


@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_the_held_positions_hold_the_committed_tokens(model, mode):
    """After a generation whose verifications rejected drafts, the full cache's held positions are the prompt and
    the committed tokens: their keys are a fresh prefill's of those ids (up to rounding: the forwards grouped the
    rows otherwise), never a rejected draft's."""
    engine = Engine(model, config(mode, SamplingConfig(temperature=0.8, seed=3)))
    result = engine.generate(DOCUMENT)
    if mode == "triforce":
        assert any(a.accepted < a.drafted for a in result.stats.acceptance)
    held, full = engine._caches.holds, engine._caches.full
    assert held.ids == DOCUMENT + result.token_ids and held.length == len(held.ids) - 1
    fresh = Engine(model, config("autoregressive", SamplingConfig(temperature=0), max_new_tokens=1))
    fresh.generate(held.ids[: held.length + 1])
    expected = fresh._caches.full
    for mine, theirs in ((full.keys, expected.keys), (full.values, expected.values)):
        torch.testing.assert_close(mine[:, :, : held.length], theirs[:, :, : held.length], rtol=1e-4, atol=1e-5)


def test_an_end_of_sequence_token_cuts_the_held_ids(model):
    """Drafts accepted after an end-of-sequence token are not committed: the held ids stop at it."""
    first = Engine(model, config("triforce", SamplingConfig(temperature=0))).generate(DOCUMENT)
    engine = Engine(model, config("triforce", SamplingConfig(temperature=0)))
    engine.eos_ids = {first.token_ids[5]}
    stopped = engine.generate(DOCUMENT)
    stop = first.token_ids.index(first.token_ids[5])
    assert stopped.stats.stop_reason == "eos" and stopped.token_ids == first.token_ids[: stop + 1]
    held = engine._caches.holds
    assert held.ids == DOCUMENT + stopped.token_ids
    assert held.length == min(engine._caches.full.length, len(held.ids)) >= len(DOCUMENT)


def test_the_kept_chunks_keep_their_retrieval_summaries(model, monkeypatch):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy))
    engine.generate(DOCUMENT)
    summarised = []  # the positions each chunk summary computation covers
    real = retrieval_module.chunk_summaries
    monkeypatch.setattr(
        retrieval_module,
        "chunk_summaries",
        lambda keys, *rest: summarised.append(keys.shape[1]) or real(keys, *rest),
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


@pytest.mark.parametrize(
    "shared",
    [
        pytest.param(64, id="whole-chunks"),
        pytest.param(70, id="mid-chunk"),
        pytest.param(80, id="into-the-answer"),
    ],
)
def test_the_kept_positions_hold_a_fresh_prefill_bit_for_bit_at_any_length(model, shared):
    """Past whole chunks rests on the numeric contract: the kept positions were computed by a shorter forward (the
    last chunk of the prompt) or by decode steps, the fresh prefill's by 16-token chunks."""
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("triforce", greedy))
    first = engine.generate(DOCUMENT)
    longer = (DOCUMENT + first.token_ids)[:shared] + OTHER
    assert OTHER[0] != (DOCUMENT + first.token_ids)[shared]
    assert engine.generate(longer).stats.reused_tokens == shared
    fresh = Engine(model, config("triforce", greedy))
    fresh.generate(longer)
    held, expected = engine._caches.full, fresh._caches.full
    length = len(longer)
    assert torch.equal(held.keys[:, :, :length], expected.keys[:, :, :length])
    assert torch.equal(held.values[:, :, :length], expected.values[:, :, :length])


def test_a_prompt_that_differs_early_keeps_what_it_shares(model):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("retrieval", greedy))
    engine.generate(DOCUMENT)
    changed = [DOCUMENT[0] + 1, *DOCUMENT[1:]]  # a document edited at its first token
    assert engine.generate(changed).stats.reused_tokens == 0
    assert OTHER[0] != changed[40]
    assert engine.generate(changed[:40] + OTHER).stats.reused_tokens == 40
    other_chunking = engine.reconfigured(config("retrieval", greedy, prefill_block=8), None)
    assert other_chunking.generate(changed[:40] + QUESTION).stats.reused_tokens == 40  # the same bits in any chunk


def test_without_the_numeric_contract_a_different_chunking_keeps_nothing(model, chunks_only):
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("retrieval", greedy))
    engine.generate(DOCUMENT)
    changed = [DOCUMENT[0] + 1, *DOCUMENT[1:]]
    assert engine.generate(changed).stats.reused_tokens == 0
    assert engine.generate(changed[:40] + OTHER).stats.reused_tokens == 32  # two shared whole chunks
    other_chunking = engine.reconfigured(config("retrieval", greedy, prefill_block=8), None)
    assert other_chunking.generate(changed[:40] + QUESTION).stats.reused_tokens == 0


def test_a_restored_prompt_state_is_reused_by_the_next_prompt(model):
    """Rests on the numeric contract for the tokens."""
    greedy = SamplingConfig(temperature=0)
    saved = []
    Engine(model, config("triforce", greedy)).generate(DOCUMENT, on_prompt_state=saved.append)
    engine = Engine(model, config("triforce", greedy))
    answer = engine.generate(DOCUMENT, prompt_state=saved[0])
    assert QUESTION[0] != answer.token_ids[0]
    longer = DOCUMENT + QUESTION
    result = engine.generate(longer)
    assert result.stats.reused_tokens == len(DOCUMENT)
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
    assert engine._caches.holds is None
    result = engine.generate(OTHER + DOCUMENT)
    assert result.stats.reused_tokens == 0
    assert result.token_ids == Engine(model, config("autoregressive", greedy)).generate(OTHER + DOCUMENT).token_ids


def test_a_decode_interrupted_inside_a_forward_holds_only_the_rounds_that_ended(model, monkeypatch):
    """A Ctrl-C in the middle of a decode step's forward leaves its positions half written: the held ids stop
    where that forward started, and the next prompt keeps only those."""
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, config("autoregressive", greedy))
    engine.generate(QUESTION)  # the caches, allocated
    full = engine._caches.full
    real, starts = full.prepare, []

    def prepare(start, num_tokens, padding=None):
        real(start, num_tokens, padding)
        starts.append(start)
        if len(starts) == 6 + 4:  # the prompt's 6 chunks, then 3 whole steps and one interrupted
            raise KeyboardInterrupt

    monkeypatch.setattr(full, "prepare", prepare)
    prompt = OTHER + DOCUMENT  # 82 tokens: 6 chunks, nothing shared with QUESTION
    result = engine.generate(prompt)
    monkeypatch.undo()
    assert result.stats.stop_reason == "interrupted" and len(result.token_ids) == 4
    held = engine._caches.holds
    assert held.ids == prompt + result.token_ids and held.length == starts[-1] == len(prompt) + 3 < full.length
    again = engine.generate(prompt + result.token_ids + QUESTION)
    assert again.stats.reused_tokens == held.length


@pytest.mark.parametrize("on_chip_layers", [0, 1])
def test_an_offloaded_full_cache_keeps_the_shared_prefix_too(model, on_chip_layers):
    """The layer-by-layer prefill of an offloaded cache starts at the kept positions, as the chunked one does."""
    greedy = SamplingConfig(temperature=0)
    offloaded = config("triforce", greedy, offload="kv", on_chip_layers=on_chip_layers)
    engine = Engine(model, offloaded)
    first = engine.generate(DOCUMENT)
    longer = DOCUMENT + first.token_ids + QUESTION
    reused = engine.generate(longer)
    assert reused.stats.reused_tokens == len(DOCUMENT) + NEW_TOKENS - 1
    assert reused.token_ids == Engine(model, config("triforce", greedy)).generate(longer).token_ids  # the contract


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
