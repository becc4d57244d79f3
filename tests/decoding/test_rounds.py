"""The decoding loop (decoding/rounds.py): rounds of the top tier, the autograd mode their forwards run in, and a
round queued before the read of the one before it where that one's token was left unread on the device (lookahead,
on by default where the model runs asynchronously: CUDA).

Queued ahead or not, a generation commits the same tokens, stops at the same end-of-sequence token and holds in its
full cache only the keys of committed tokens; the lookahead takes no step past max_new_tokens, and one past an
end-of-sequence token at most."""

import functools

import pytest
import torch
from helpers import make_model, random_prompt, small_config, tiled

from triforce_cli.decoding import engine as engine_module
from triforce_cli.decoding import rounds
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.speculative import ModelTier, Tier
from triforce_cli.runtime.forms import StepMode
from triforce_cli.runtime.model import Transformer

VOCAB = 64
PROMPT = random_prompt(70, VOCAB, seed=1)
QUESTION = random_prompt(9, VOCAB, seed=2)
GREEDY = SamplingConfig(temperature=0)
SEEDED = SamplingConfig(temperature=0.8, seed=3)


@pytest.fixture(scope="module")
def model():
    return tiled(
        make_model(seed=5, vocab_size=VOCAB, num_layers=2, initializer_range=0.3, tie_word_embeddings=False).loaded
    )


def config(mode: str, sampling: SamplingConfig, **changes):
    return small_config(mode=mode, sampling=sampling, **{"cache_positions": 256, **changes})


def queue_ahead(monkeypatch) -> dict[str, int]:
    """Engines made from now on queue rounds ahead (as on a GPU) on the CPU; the counts of the top tier's steps
    and of the reads queued behind them."""
    counts = {"steps": 0, "queued reads": 0}
    monkeypatch.setattr(engine_module, "decode", functools.partial(rounds.decode, lookahead=True))
    step, queued_read = ModelTier.step, rounds.queued_read

    def counted_step(tier, *args, **kwargs):
        counts["steps"] += tier.name == Tier.TARGET
        return step(tier, *args, **kwargs)

    def counted_read(ids):
        counts["queued reads"] += 1
        return queued_read(ids)

    monkeypatch.setattr(ModelTier, "step", counted_step)
    monkeypatch.setattr(rounds, "queued_read", counted_read)
    return counts


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize(("mode", "policy"), [("autoregressive", "fixed"), ("triforce", "costed")])
def test_rounds_queued_ahead_commit_the_same_tokens(model, mode, policy, sampling, monkeypatch):
    """Plain decoding, and the costed default (whose tiny target, drafting for itself, takes its own steps), give
    the same tokens with and without the lookahead, greedy and seeded; plain decoding queues every round's read,
    and takes no step past max_new_tokens."""
    settings = config(mode, sampling, gamma_policy=policy)
    expected = Engine(model, settings).generate(PROMPT)
    counts = queue_ahead(monkeypatch)
    result = Engine(model, settings).generate(PROMPT)
    assert result.token_ids == expected.token_ids
    assert len(result.token_ids) == settings.max_new_tokens
    assert counts["queued reads"] > 0
    if mode == "autoregressive":  # the first token comes from the prefill's logits
        assert counts == {"steps": settings.max_new_tokens - 1, "queued reads": settings.max_new_tokens - 1}


def test_a_round_queued_past_an_end_of_sequence_token_is_dropped(model, monkeypatch):
    """The generation stops at the end-of-sequence token as without the lookahead, one step further on at most;
    that step wrote the end-of-sequence token's keys, a fresh prefill's (up to rounding), so the held positions
    still hold what their ids say and the next prompt keeps them, and answers as a fresh engine does."""
    settings = config("autoregressive", GREEDY)
    first = Engine(model, settings).generate(PROMPT)
    eos = first.token_ids[5]
    stop = first.token_ids.index(eos)
    counts = queue_ahead(monkeypatch)
    engine = Engine(model, settings)
    engine.eos_ids = {eos}
    stopped = engine.generate(PROMPT)
    assert stopped.stats.stop_reason == "eos" and stopped.token_ids == first.token_ids[: stop + 1]
    assert counts["steps"] == stop + 1  # the rounds that made tokens 1..stop, and one queued past the last
    held, full = engine._caches.holds, engine._caches.full
    assert held.ids == PROMPT + stopped.token_ids and held.length == len(held.ids) == full.length
    fresh = Engine(model, config("autoregressive", GREEDY, max_new_tokens=1))
    fresh.generate(held.ids)
    expected = fresh._caches.full
    for mine, theirs in ((full.keys, expected.keys), (full.values, expected.values)):
        torch.testing.assert_close(mine[:, :, : held.length], theirs[:, :, : held.length], rtol=1e-4, atol=1e-5)
    follow_up = held.ids + QUESTION
    again = engine.generate(follow_up)
    assert again.stats.reused_tokens == held.length
    assert again.token_ids == Engine(model, settings).generate(follow_up).token_ids


def test_without_lookahead_on_the_cpu_every_round_is_read_before_the_next(model, monkeypatch):
    """The default on the CPU, where a queued round would run before the read anyway: no read is queued."""
    reads = []
    monkeypatch.setattr(rounds, "queued_read", lambda ids: reads.append(ids) or ids.tolist)
    Engine(model, config("autoregressive", GREEDY)).generate(PROMPT)
    assert reads == []


@pytest.mark.parametrize("steps", [StepMode.EAGER, StepMode.GRAPHS])
def test_eager_decoding_runs_its_forwards_in_inference_mode_entered_once(steps, monkeypatch):
    """Where every model steps eager, decoding enters inference mode once (rounds.forward_mode), so no forward
    enters it again; where a model runs fixed-shape steps, which a compiler would key by that mode, it does not."""
    loaded = make_model(seed=5, vocab_size=VOCAB, num_layers=2, initializer_range=0.3, tie_word_embeddings=False)
    target = tiled(loaded.loaded)
    target.model.use_steps(steps)
    modes, decoding = [], []
    forward, decode = Transformer.forward, engine_module.decode

    def noted_forward(model, *args, **kwargs):
        if decoding:
            modes.append(torch.is_inference_mode_enabled())
        return forward(model, *args, **kwargs)

    def noted_decode(*args, **kwargs):
        decoding.append(True)
        decode(*args, **kwargs)
        decoding.clear()

    monkeypatch.setattr(Transformer, "forward", noted_forward)
    monkeypatch.setattr(engine_module, "decode", noted_decode)
    Engine(target, config("triforce", GREEDY, gamma_policy="fixed")).generate(PROMPT)
    assert len(modes) > 10 and set(modes) == {steps == StepMode.EAGER}
