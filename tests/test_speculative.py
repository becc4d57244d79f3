"""End-to-end checks of the speculative pipeline with tiny random models.

Greedy decoding in every speculative mode must reproduce autoregressive decoding token for token, with budgets
and drafter windows far smaller than the generated text (so re-selection and eviction happen). At temperature 1
the tokens must follow the target model's exact distribution; a chi-square test on a vocabulary of 8 checks that
for the whole pipeline and for the middle tier alone (against its own model-with-retrieval-cache distribution).
"""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers import (
    F16_KV_TOLERANCE,
    StubTokenizer,
    fixed_drafts_at_least,
    full_cache_for,
    make_model,
    random_prompt,
    reference_logits,
    rich_model,
    with_eos,
    wrong_verify_draft,
)
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache

from triforce_cli.decoding import speculative
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig, probabilities
from triforce_cli.decoding.speculation_length import StepCosts
from triforce_cli.decoding.speculative import ModelTier, Proposal, Tier, TokenSequence
from triforce_cli.decoding.stats import as_record
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.runtime.loading import LoadedModel

GREEDY = SamplingConfig(temperature=0)
PROMPT_TOKENS, NEW_TOKENS = 200, 80
P_THRESHOLD = 1e-3


def engine_config(mode: str = "triforce", **overrides) -> EngineConfig:
    settings = {
        "mode": mode,
        "chunk_size": 8,
        "budget": 32,
        "sink_tokens": 4,
        "draft_window": 16,
        "gamma1": 2,
        "gamma2": 6,
        "max_new_tokens": NEW_TOKENS,
        "refresh_interval": 1,
        "prefill_block": 16,  # also bounds the drafter's step slots, so its small window really evicts
        "sampling": GREEDY,
        "ngram": False,  # the model drafter alone; tests of the n-gram ask for it
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def prompt_for(seed: int) -> list[int]:
    return random_prompt(PROMPT_TOKENS, 32, seed=100 + seed)


@functools.cache
def autoregressive_tokens(seed: int) -> tuple[int, ...]:
    result = Engine(rich_model(seed).loaded, engine_config("autoregressive")).generate(prompt_for(seed))
    return tuple(result.token_ids)


# --- greedy: every mode equals autoregressive -------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_autoregressive_greedy_matches_reference_model(seed):
    tokens = list(autoregressive_tokens(seed))
    assert len(tokens) == NEW_TOKENS
    prompt = prompt_for(seed)
    logits = reference_logits(rich_model(seed).ref, prompt + tokens)[PROMPT_TOKENS - 1 : -1]  # before each token
    # transformers' float32 cache against our float16 one: each token is transformers' choice, or one its logits put
    # within the float16 cache's tolerance of it (a near-tie the rounding may break either way)
    gaps = logits.max(dim=-1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (gaps <= F16_KV_TOLERANCE["atol"]).all(), gaps.max()
    assert (gaps == 0).sum() >= NEW_TOKENS - 2
    assert len(set(tokens)) > 5  # the tiny model does not just repeat one token


COMBOS = {
    "b32-r1-g1x1": {"budget": 32, "refresh_interval": 1, "gamma1": 1, "gamma2": 1},
    "b64-r3-g2x6": {"budget": 64, "refresh_interval": 3, "gamma1": 2, "gamma2": 6},
    "b32-r3-g3x4": {"budget": 32, "refresh_interval": 3, "gamma1": 3, "gamma2": 4},
    "b64-r1-g3x4": {"budget": 64, "refresh_interval": 1, "gamma1": 3, "gamma2": 4},
}


def check_caches_were_exercised(engine: Engine):
    caches = engine._caches
    if caches.retrieval is not None:
        # chunks were re-selected while generating, well past the prompt
        assert caches.retrieval.selected_until > PROMPT_TOKENS + NEW_TOKENS // 2
    wants_drafts = not (engine.config.mode == "triforce" and engine.config.gamma2 == 1)
    if caches.streaming is not None and wants_drafts:
        # the drafter's window slid far past the prompt (unless target@full asks one token at a time of the
        # retrieval tier, which then samples it from its own forward, leaving the drafter nothing to draft)
        assert caches.streaming.window_start > PROMPT_TOKENS
        assert len(caches.streaming.cached_positions()) <= caches.streaming.capacity


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("mode", ["retrieval", "streaming", "triforce"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_speculative_equals_autoregressive(seed, mode, combo):
    target = rich_model(seed)
    # fixed lengths: under throughput the full tier may draft straight from the drafter for long stretches, and
    # the retrieval cache is re-selected only when the retrieval tier drafts (adaptive lengths: their own tests)
    engine = Engine(target.loaded, engine_config(mode, gamma_policy="fixed", **COMBOS[combo]))
    result = engine.generate(prompt_for(seed))
    assert result.token_ids == list(autoregressive_tokens(seed))
    assert result.stats.stop_reason == "max_new_tokens"
    check_caches_were_exercised(engine)


@pytest.mark.parametrize("mode", ["retrieval", "triforce"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_the_bound_chunk_score_equals_autoregressive(seed, mode):
    """Quest's bound picks other chunks than the mean key: the retrieval tier's drafts differ, the output not."""
    config = engine_config(mode, gamma_policy="fixed", chunk_score="bound", **COMBOS["b32-r3-g3x4"])
    engine = Engine(rich_model(seed).loaded, config)
    assert engine.generate(prompt_for(seed)).token_ids == list(autoregressive_tokens(seed))
    check_caches_were_exercised(engine)
    assert engine._caches.retrieval.chunk_keys.shape[0] == 2  # minimum and maximum keys


@pytest.mark.parametrize("combo", ["b64-r3-g2x6", "b32-r3-g3x4"])
@pytest.mark.parametrize("mode", ["streaming", "triforce"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_separate_drafter_equals_autoregressive(seed, mode, combo):
    target = rich_model(seed)
    drafter = rich_model(seed + 50, num_layers=1, name="drafter")
    engine = Engine(target.loaded, engine_config(mode, gamma_policy="fixed", **COMBOS[combo]), drafter=drafter.loaded)
    assert engine.drafter_description == "drafter"
    result = engine.generate(prompt_for(seed))
    assert result.token_ids == list(autoregressive_tokens(seed))
    check_caches_were_exercised(engine)


def test_draft_window_smaller_than_speculation_depth():
    """Either the configuration is refused up front, or decoding works (and stays exact)."""
    try:
        cfg = engine_config("triforce", draft_window=4, gamma1=2, gamma2=6)
        result = Engine(rich_model(0).loaded, cfg).generate(prompt_for(0))
    except ConfigError:
        return
    assert result.token_ids == list(autoregressive_tokens(0))


def test_greedy_default_budget_equals_autoregressive():
    engine = Engine(rich_model(0).loaded, engine_config("triforce", budget=None))
    assert engine.generate(prompt_for(0)).token_ids == list(autoregressive_tokens(0))
    assert engine._caches.retrieval.budget == PROMPT_TOKENS  # min(1024, the prompt's whole chunks)


def test_greedy_drafts_are_both_accepted_and_rejected():
    """Guard for the equality tests above: the speculative tiers really disagree with the target sometimes."""
    cfg = engine_config("triforce", gamma_policy="fixed", **COMBOS["b32-r3-g3x4"])  # every pass through 3 tiers
    result = Engine(rich_model(0).loaded, cfg).generate(prompt_for(0))
    assert len(result.stats.acceptance) == 2
    for stats in result.stats.acceptance:
        assert 0 < stats.accepted < stats.drafted, stats


def test_engine_reuse_across_prompts():
    """A second generate() (caches reused) gives the same tokens as a fresh engine."""
    engine = Engine(rich_model(1).loaded, engine_config("triforce"))
    engine.generate(prompt_for(2))
    assert engine.generate(prompt_for(1)).token_ids == list(autoregressive_tokens(1))
    short = prompt_for(1)[:120]
    fresh = Engine(rich_model(1).loaded, engine_config("autoregressive", max_new_tokens=30)).generate(short)
    again = Engine(rich_model(1).loaded, engine_config("triforce", max_new_tokens=30))
    again.generate(prompt_for(1))
    assert again.generate(short).token_ids == fresh.token_ids


# --- sampled generation: stats, stopping, callbacks ---------------------------------------------------------------


def sampled(mode: str, seed: int = 0, **overrides) -> EngineConfig:
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, seed=seed)
    return engine_config(mode, sampling=sampling, **overrides)


@pytest.mark.parametrize("mode", ["autoregressive", "retrieval", "streaming", "triforce"])
def test_stats_are_consistent(mode, tiny_target, tiny_drafter):
    cfg = sampled(mode, gamma1=3, gamma2=5, gamma_policy="fixed")  # every tier drafts its gamma
    result = Engine(tiny_target.loaded, cfg, drafter=tiny_drafter.loaded).generate(prompt_for(0))
    stats = result.stats
    assert len(result.token_ids) == stats.new_tokens == NEW_TOKENS
    assert stats.decoded_tokens + 1 == NEW_TOKENS  # the first token comes with the prefill
    assert stats.prompt_tokens == PROMPT_TOKENS and stats.mode == mode
    assert len(stats.round_tokens) == len(stats.round_seconds) > 0
    assert all(n >= 1 for n in stats.round_tokens)
    expected_pairs = {
        "autoregressive": [],
        "retrieval": [("retrieval", "target")],
        "streaming": [("drafter", "target")],
        "triforce": [("retrieval", "target"), ("drafter", "retrieval")],
    }[mode]
    assert [(a.proposer, a.verifier) for a in stats.acceptance] == expected_pairs
    gammas = {"target": cfg.gamma2 if mode != "streaming" else cfg.gamma1, "retrieval": cfg.gamma1}
    for a in stats.acceptance:
        gamma = gammas[a.verifier]
        if a.verifier == "target":
            assert fixed_drafts_at_least(gamma, a.verifications) <= a.drafted <= gamma * a.verifications
        else:  # the retrieval tier drafts fewer where the full tier wants fewer tokens than gamma1 + 1
            assert a.verifications < a.drafted < gamma * a.verifications
        assert 0 <= a.accepted <= a.drafted
        assert 0 < a.accepted < a.drafted  # peaky models: some drafts accepted, some rejected
        assert 1 <= a.mean_accepted_length <= gamma + 1
        assert a.acceptance_rate == pytest.approx(a.accepted / a.drafted)
        # each pass rejects at most one draft, after which nothing is judged
        assert 0 < a.rejections <= a.verifications and a.accepted + a.rejections < a.drafted
        assert a.judged_acceptance_rate == pytest.approx(a.accepted / (a.accepted + a.rejections))
    if stats.acceptance:
        top = stats.acceptance[0]
        # a last round that wants one token samples it without drafting
        assert len(stats.round_tokens) - 1 <= top.verifications <= len(stats.round_tokens)
        # every round commits its accepted drafts plus one token, none cut off
        assert stats.decoded_tokens == top.accepted + len(stats.round_tokens)
    record = as_record(stats)
    assert record["new_tokens"] == NEW_TOKENS and len(record["acceptance"]) == len(expected_pairs)
    assert result.text == " ".join(map(str, result.token_ids))


def test_sampled_generation_is_reproducible_with_a_seed(tiny_target):
    runs = [
        Engine(tiny_target.loaded, sampled("triforce", seed=s)).generate(prompt_for(0)).token_ids for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
@pytest.mark.parametrize("mode", ["autoregressive", "retrieval", "streaming", "triforce"])
def test_max_new_tokens_is_exact(mode, max_new_tokens, tiny_target):
    cfg = sampled(mode, max_new_tokens=max_new_tokens, gamma1=3, gamma2=6)
    result = Engine(tiny_target.loaded, cfg).generate(prompt_for(1))
    assert len(result.token_ids) == result.stats.new_tokens == max_new_tokens
    assert result.stats.stop_reason == "max_new_tokens"
    if result.stats.acceptance:  # the last round asks for no more than the tokens still wanted
        top = result.stats.acceptance[0]
        assert top.accepted + len(result.stats.round_tokens) == result.stats.decoded_tokens


@pytest.mark.parametrize("where", ["config", "tokenizer"])
@pytest.mark.parametrize("mode", ["autoregressive", "retrieval", "streaming", "triforce"])
def test_eos_stops_generation(mode, where):
    reference = list(autoregressive_tokens(0))
    eos = reference[12]
    expected = reference[: reference.index(eos) + 1]
    assert 1 < len(expected) < NEW_TOKENS
    ids = {"config_eos": [eos, 99]} if where == "config" else {"tokenizer_eos": eos}
    target = with_eos(rich_model(0).loaded, **ids)
    result = Engine(target, engine_config(mode, **COMBOS["b64-r3-g2x6"])).generate(prompt_for(0))
    assert result.token_ids == expected
    assert result.stats.stop_reason == "eos"
    assert result.stats.new_tokens == len(expected)


def test_eos_as_first_token():
    reference = list(autoregressive_tokens(0))
    target = with_eos(rich_model(0).loaded, config_eos=reference[0])
    result = Engine(target, engine_config("triforce")).generate(prompt_for(0))
    assert result.token_ids == reference[:1]
    assert result.stats.stop_reason == "eos" and result.stats.round_tokens == []


@pytest.mark.parametrize("interrupt_at", [1, 3])
@pytest.mark.parametrize("mode", ["autoregressive", "triforce"])
def test_keyboard_interrupt_returns_partial_result(mode, interrupt_at):
    delivered: list[int] = []
    origins: list[str] = []

    def on_tokens(tokens, tiers):
        delivered.extend(tokens)
        origins.extend(tiers)
        assert len(tokens) == len(tiers)
        if on_tokens.calls == interrupt_at - 1:
            raise KeyboardInterrupt
        on_tokens.calls += 1

    on_tokens.calls = 0
    result = Engine(rich_model(0).loaded, engine_config(mode)).generate(prompt_for(0), on_tokens=on_tokens)
    assert result.stats.stop_reason == "interrupted"
    assert result.token_ids == delivered
    assert result.stats.new_tokens == len(delivered) < NEW_TOKENS
    assert result.token_ids == list(autoregressive_tokens(0))[: len(delivered)]
    assert origins[0] == "target"
    assert set(origins) <= {"target", "retrieval", "drafter"}
    if interrupt_at == 1:
        assert len(delivered) == 1


def test_callbacks_report_prefill_and_origins(tiny_target):
    # A drafter with the target's weights and caches that hold the whole sequence, so every tier's drafts are
    # often accepted and all three origins appear whatever the random stream.
    clone = make_model(seed=0, peak=2.0, name="drafter", initializer_range=0.3, tie_word_embeddings=False)
    prefill: list[tuple[str, int, int]] = []
    origins: list[str] = []
    config = sampled(
        "triforce",
        prefill_block=64,
        budget=PROMPT_TOKENS,
        draft_window=PROMPT_TOKENS + NEW_TOKENS,
        gamma_policy="fixed",
    )
    engine = Engine(tiny_target.loaded, config, drafter=clone.loaded)
    result = engine.generate(
        prompt_for(0), on_prefill=lambda *a: prefill.append(a), on_tokens=lambda t, o: origins.extend(o)
    )
    assert [p for p in prefill if p[0] == "target"] == [("target", n, 200) for n in (64, 128, 192, 200)]
    assert [p for p in prefill if p[0] == "drafter"][-1] == ("drafter", 200, 200)
    assert len(origins) == len(result.token_ids)
    assert {"target", "retrieval", "drafter"} <= set(origins)


# --- configuration and prompt errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"mode": "medusa"},
        {"chunk_size": 0, "budget": None},
        {"chunk_size": 0, "budget": 32},
        {"budget": 30},  # not a multiple of the chunk size
        {"budget": 0},
        {"gamma1": 0},
        {"gamma2": 0},
        {"max_new_tokens": 0},
        {"refresh_interval": 0},
        {"draft_window": 0},
        {"sampling": SamplingConfig(temperature=-1)},
        {"sampling": SamplingConfig(top_p=0)},
        {"sampling": SamplingConfig(top_k=-1)},
    ],
)
def test_engine_config_validation(overrides):
    with pytest.raises(ConfigError):
        engine_config(**{"mode": "triforce", **overrides})


def test_prompt_errors(tiny_target):
    engine = Engine(tiny_target.loaded, engine_config("triforce"))
    with pytest.raises(PromptError, match="empty"):
        engine.generate([])
    with pytest.raises(PromptError, match="context"):
        engine.generate([1] * 500)  # 500 + 80 > 512
    with pytest.raises(ConfigError, match="budget"):
        engine.generate([1] * 20)  # budget 32 > 16 tokens in whole chunks
    short = Engine(tiny_target.loaded, engine_config("retrieval", budget=None))
    with pytest.raises(ConfigError, match="chunk"):
        short.generate([1] * 5)
    # without retrieval a short prompt is fine
    assert len(Engine(tiny_target.loaded, engine_config("streaming")).generate([1] * 5).token_ids) == NEW_TOKENS


def test_drafter_must_share_the_vocabulary(tiny_target, tiny_drafter):
    d = tiny_drafter.loaded
    other = LoadedModel("other", d.model, StubTokenizer(31), d.hf_config)
    with pytest.raises(ConfigError, match="vocabulary"):
        Engine(tiny_target.loaded, engine_config("triforce"), drafter=other)
    # a drafter is ignored where no mode uses one
    assert Engine(tiny_target.loaded, engine_config("retrieval"), drafter=other).drafter is None


# --- statistical exactness at temperature 1 ------------------------------------------------------------------------

VOCAB = 8
PROMPT8 = random_prompt(24, VOCAB, seed=0)
TEMPERATURE_1 = SamplingConfig(temperature=1.0, top_p=1.0)


def target8():
    return rich_model(1, vocab_size=VOCAB)


def drafter8():
    return rich_model(101, vocab_size=VOCAB, num_layers=1, name="drafter")


def joint_chi_square(pairs: list[tuple[int, int]], first: torch.Tensor, second: torch.Tensor) -> float:
    """p-value of observed (a, b) pairs against P(a) * P(b | a); cells expecting < 5 are pooled.

    A pair the exact distribution gives probability 0 (top-k / top-p truncation) yields p-value 0.
    """
    observed = np.zeros((VOCAB, VOCAB))
    for a, b in pairs:
        observed[a, b] += 1
    expected = (first.double()[:, None] * second.double()).numpy()
    expected *= len(pairs) / expected.sum()
    if observed[expected == 0].sum() > 0:
        return 0.0
    small = (expected < 5) & (expected > 0)
    large = expected >= 5
    obs, exp = observed[large], expected[large]
    if small.any():
        obs, exp = np.append(obs, observed[small].sum()), np.append(exp, expected[small].sum())
    assert large.sum() >= 6  # enough cells for a meaningful test
    chisquare = pytest.importorskip("scipy.stats").chisquare  # the test extra
    return chisquare(obs, exp).pvalue


@torch.no_grad()
def target_joint() -> tuple[torch.Tensor, torch.Tensor]:
    """Exact P(generated[0]) and P(generated[1] | generated[0]) from the reference transformers model."""
    ref = target8().ref
    first = probabilities(reference_logits(ref, PROMPT8)[-1:], TEMPERATURE_1)[0]
    second = torch.stack(
        [probabilities(reference_logits(ref, PROMPT8 + [a])[-1:], TEMPERATURE_1)[0] for a in range(VOCAB)]
    )
    return first, second


def pipeline_pairs(mode: str, trials: int, gamma_policy: str = "fixed", ngram: bool = False) -> list[tuple[int, int]]:
    """The first two tokens of `trials` seeded runs; fixed lengths by default, so that every tier drafts."""
    base = EngineConfig(
        gamma_policy=gamma_policy,
        mode=mode,
        ngram=ngram,  # False: the drafter's own probabilities are what the tiers above judge
        ngram_min_match=1,  # every match proposes: the 24-token prompt rarely repeats 3 tokens
        chunk_size=4,
        budget=8,  # 2 of the prompt's 6 chunks: the middle tier's distribution differs from the target's
        sink_tokens=2,
        draft_window=8,
        gamma1=2,
        gamma2=3,
        max_new_tokens=4,  # the first round wants 3 tokens: the full tier asks for 2, the middle tier drafts 1
        refresh_interval=1,
        prefill_block=8,
        sampling=TEMPERATURE_1,
    )
    target, drafter = target8().loaded, drafter8().loaded
    pairs = []
    for seed in range(trials):
        cfg = dataclasses.replace(base, sampling=dataclasses.replace(TEMPERATURE_1, seed=seed))
        tokens = Engine(target, cfg, drafter=drafter).generate(PROMPT8).token_ids
        pairs.append((tokens[0], tokens[1]))
    return pairs


PIPELINE_TRIALS = 1500
POWER_TRIALS = 600  # the inexact variant is off by far more than the exact tests could miss


@pytest.mark.parametrize(
    "mode, ngram", [("triforce", False), ("retrieval", False), ("streaming", False), ("triforce", True)]
)
def test_pipeline_is_exact_at_temperature_one(mode, ngram):
    pairs = pipeline_pairs(mode, PIPELINE_TRIALS, ngram=ngram)
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD


def test_free_drafts_keep_the_target_distribution(monkeypatch):
    """Under the costed policy the n-gram's drafts offered to the target at every step (ModelTier.lookup) go through
    the same speculative sampling: the first two tokens keep the target's joint distribution, and in most trials
    the second came from a verification of a free draft (the first offer is verified, as a probe, where the
    prior alone would not pay)."""
    second_from_free = []  # per trial: whether its first round after the prompt's token verified free drafts
    free_step = speculative.ModelTier._free_step

    def counted(self, sequence, limit):
        result = free_step(self, sequence, limit)
        if len(sequence) == len(PROMPT8) + 1:
            second_from_free.append(result is not None)
        return result

    monkeypatch.setattr(speculative.ModelTier, "_free_step", counted)
    pairs = pipeline_pairs("triforce", PIPELINE_TRIALS, gamma_policy="costed", ngram=True)
    assert len(second_from_free) == PIPELINE_TRIALS and sum(second_from_free) > PIPELINE_TRIALS // 2
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD


def test_pipeline_chi_square_detects_an_inexact_top_tier(monkeypatch):
    monkeypatch.setattr(speculative, "verify_draft", wrong_verify_draft)
    pairs = pipeline_pairs("retrieval", POWER_TRIALS)
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) < P_THRESHOLD


class MiddleTier:
    """drafter@StreamingLLM -> target@retrieval on the 8-token vocabulary, after a prefill of PROMPT8."""

    def __init__(self, sampling: SamplingConfig, seed: int, gamma_policy: str = "fixed"):
        model, drafter = target8().model, drafter8().model
        cfg, dcfg = model.config, drafter.config
        self.full = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32)
        model(torch.tensor(PROMPT8), 0, self.full)
        self.retrieval = RetrievalCache(self.full, budget=8, chunk_size=4, recent_capacity=16)
        self.retrieval.select_chunks()
        streaming = StreamingCache(dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim, 2, 8, 12, torch.float32)
        for start in range(0, len(PROMPT8), 12):
            drafter(torch.tensor(PROMPT8[start : start + 12]), start, streaming)
        generator = torch.Generator().manual_seed(seed)
        draft_tier = ModelTier(
            name=Tier.DRAFTER, model=drafter, cache=streaming, sampling=sampling, generator=generator
        )
        self.tier = ModelTier(
            name=Tier.RETRIEVAL,
            model=model,
            cache=self.retrieval,
            sampling=sampling,
            generator=generator,
            proposer=draft_tier,
            gamma=2,
            gamma_policy=gamma_policy,
        )
        self.model, self.sampling = model, sampling

    def exact_joint(self, committed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The retrieval-cache model's own P(t0) and P(t1 | t0) after PROMPT8 + [committed]."""
        start = len(PROMPT8)
        first = probabilities(self.model(torch.tensor([committed]), start, self.retrieval), self.sampling)[0]
        second = []
        for a in range(VOCAB):
            self.retrieval.rollback(start + 1)
            second.append(probabilities(self.model(torch.tensor([a]), start + 1, self.retrieval), self.sampling)[0])
        self.retrieval.rollback(start)
        return first, torch.stack(second)

    def pairs(self, committed: int, trials: int) -> list[tuple[int, int]]:
        """The first two of three tokens proposed after PROMPT8 + [committed]: three, so that the first
        verification may take two drafts (a tier drafts no more than the tokens still wanted, less one)."""
        sequence = TokenSequence.of(PROMPT8 + [committed], "cpu")
        out = []
        for _ in range(trials):
            self.tier.rollback(len(PROMPT8))
            proposal = self.tier.propose(sequence, 3)
            assert proposal.probs.shape == (3, VOCAB)
            out.append((proposal.tokens[0], proposal.tokens[1]))
        return out


MIDDLE_TRIALS = 2500
MIDDLE_SAMPLINGS = {
    "t1": TEMPERATURE_1,
    "t0.8-topk6-topp0.9": SamplingConfig(temperature=0.8, top_k=6, top_p=0.9),
}


@pytest.mark.parametrize("sampling", list(MIDDLE_SAMPLINGS))
def test_middle_tier_alone_is_exact_for_its_own_cache(sampling):
    middle = MiddleTier(MIDDLE_SAMPLINGS[sampling], seed=5)
    first, second = middle.exact_joint(committed=3)
    # guard: with this budget the middle tier's own distribution is far from the full target's
    full_first = probabilities(reference_logits(target8().ref, PROMPT8 + [3])[-1:], MIDDLE_SAMPLINGS[sampling])[0]
    assert 0.5 * (first - full_first).abs().sum() > 0.2
    pairs = middle.pairs(committed=3, trials=MIDDLE_TRIALS)
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD
    stats = middle.tier.stats
    assert 0 < stats.accepted < stats.drafted


def test_middle_tier_chi_square_detects_resampling_from_p(monkeypatch):
    monkeypatch.setattr(speculative, "verify_draft", wrong_verify_draft)
    middle = MiddleTier(TEMPERATURE_1, seed=5)
    first, second = middle.exact_joint(committed=3)
    pairs = middle.pairs(committed=3, trials=POWER_TRIALS)
    assert joint_chi_square(pairs, first, second) < P_THRESHOLD


def test_own_steps_of_the_top_tier_are_exact(monkeypatch):
    """Where the throughput policy drops drafting, the top tier samples its own forward: still the target's
    distribution (forced here from the first round on, so the second token always comes from an own step)."""
    from triforce_cli.decoding.speculation_length import SpeculationLength

    monkeypatch.setattr(SpeculationLength, "drafting", property(lambda length: not length.own_steps))
    pairs = pipeline_pairs("triforce", PIPELINE_TRIALS, gamma_policy="throughput")
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD


# --- the costed policy on a scripted proposer: drafts never, always or sometimes accepted --------------------------

SCRIPTED_TOKENS = 80
SCRIPTED_PRICES = StepCosts((1.0, 1.2, 1.4, 1.6, 1.8), proposer=0.0)  # a CPU's slope; free drafts (as an n-gram's)


@dataclass
class ScriptedProposer:
    """Drafts the target's greedy continuation, known beforehand, where right(i) says (i: the index of the token in
    the continuation), and the token after it in the vocabulary elsewhere; one-hot draft probabilities, so greedy
    verification accepts exactly the right ones."""

    prompt_length: int
    greedy: list[int]
    right: Callable[[int], bool]
    vocab_size: int
    name: str = "scripted"

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        first = len(sequence) - self.prompt_length
        continuation = self.greedy[first : first + n]
        tokens = [t if self.right(first + i) else (t + 1) % self.vocab_size for i, t in enumerate(continuation)]
        ids = torch.tensor(tokens, dtype=torch.long)
        probs = torch.nn.functional.one_hot(ids, self.vocab_size).float()
        return Proposal(ids, probs, [self.name] * len(tokens), tokens)

    def rollback(self, length: int) -> None:
        pass


@dataclass
class ScriptedLookup(ScriptedProposer):
    """A ScriptedProposer that finds a continuation only where offered(i) says, as the n-gram lookup finds one only
    where the text repeats; its continuation is known on the host first."""

    offered: Callable[[int], bool] = lambda i: True
    name: str = "lookup"

    def continuation(self, prefix: list[int], n: int) -> list[int]:
        first = len(prefix) - self.prompt_length
        return self.propose(TokenSequence.of(prefix, "cpu"), n).tokens if self.offered(first) else []


def scripted_decode(
    right: Callable[[int], bool] | None, free: tuple[Callable[[int], bool], Callable[[int], bool]] | None = None
) -> tuple[list[int], ModelTier]:
    """SCRIPTED_TOKENS greedy tokens of target@full after prompt_for(0): drafted by a ScriptedProposer under the
    costed policy at SCRIPTED_PRICES, or (right None) each sampled from its own forward; and the top tier. free:
    (right, offered) of a ScriptedLookup offering free drafts beside the proposer."""
    model = rich_model(0).model
    prompt = prompt_for(0)
    reference = None if right is None else scripted_decode(None)[0]
    cache = full_cache_for(model, capacity=len(prompt) + 2 * SCRIPTED_TOKENS)
    first = int(model(torch.tensor(prompt), 0, cache).argmax(dim=-1)[-1])
    proposer = lookup = None
    if right is not None:
        greedy = reference + [0] * SCRIPTED_PRICES.ceiling  # a last pass may draft past the end
        proposer = ScriptedProposer(len(prompt), greedy, right, model.config.vocab_size)
        if free is not None:
            lookup = ScriptedLookup(len(prompt), greedy, free[0], model.config.vocab_size, offered=free[1])
    top = ModelTier(
        name=Tier.TARGET,
        model=model,
        cache=cache,
        sampling=GREEDY,
        generator=torch.Generator().manual_seed(0),
        proposer=proposer,
        lookup=lookup,
        gamma=SCRIPTED_PRICES.ceiling,
        gamma_policy="costed",
        own_steps=True,
    )
    if proposer is not None:
        top.price(SCRIPTED_PRICES)
    generated = [first]
    sequence = TokenSequence.of([*prompt, first], "cpu", len(prompt) + 2 * SCRIPTED_TOKENS)
    while len(generated) < SCRIPTED_TOKENS:
        tokens = top.step(sequence, limit=SCRIPTED_TOKENS - len(generated))
        sequence.append(tokens.ids, tokens.tokens)
        generated += tokens.tokens
    return generated, top


def test_costed_drafts_never_accepted_are_only_probed():
    tokens, top = scripted_decode(right=lambda i: False)
    assert tokens == scripted_decode(None)[0]
    # free drafts: the prior says the first two passes pay; then probes after 10, 20 and 40 own steps (a rejected
    # probe loses 0.2 of a plain step, which is 2% of 10)
    assert top.length.probe_base == 10
    assert top.stats.verifications == top.stats.drafted == 5 and top.stats.accepted == 0
    assert top.length.own_steps_taken >= SCRIPTED_TOKENS - 10


def test_costed_drafts_always_accepted_are_drafted_at_every_step():
    tokens, top = scripted_decode(right=lambda i: True)
    assert tokens == scripted_decode(None)[0]
    assert top.length.own_steps_taken == 0 and top.stats.accepted == top.stats.drafted
    assert top.stats.mean_drafted > 3  # the ceiling (4) but for the first passes and the last


def test_costed_drafts_sometimes_accepted_stay_exact():
    """Two drafts in three right: drafting pays at short lengths; the tokens are the target's own."""
    tokens, top = scripted_decode(right=lambda i: i % 3 != 2)
    assert tokens == scripted_decode(None)[0]
    assert 0 < top.stats.accepted < top.stats.drafted


def test_costed_drops_are_noted_with_their_prices():
    _, top = scripted_decode(right=lambda i: False)
    costs = top.costs()
    assert costs.priced and costs.drops >= 1 and costs.step_ms[0] == 1000 * SCRIPTED_PRICES.own
    assert "priced 1000.0 ms a token" in costs.note and "1 drafts 1200.0 ms" in costs.note


# --- free drafts offered at every step (the n-gram lookup beside the costed policy) --------------------------------


def free_decode(right: Callable[[int], bool], offered: Callable[[int], bool]) -> tuple[list[int], ModelTier]:
    """scripted_decode with a proposer whose drafts are never right, and a ScriptedLookup offering free drafts; its
    tokens checked against plain decoding's."""
    tokens, top = scripted_decode(lambda i: False, free=(right, offered))
    assert tokens == scripted_decode(None)[0]
    return tokens, top


def test_free_drafts_always_right_are_verified_wherever_offered():
    """Offered at every other step and always right: each offer verified at the ceiling's length, the tokens the
    target's own; the proposer, never right, is only probed."""
    _, top = free_decode(right=lambda i: True, offered=lambda i: i % 2 == 0)
    free = top.lookup_stats
    assert free.verifications >= 10 and free.accepted == free.drafted and free.mean_drafted > 3
    assert top.stats.accepted == 0 and top.stats.verifications < free.verifications


def test_free_drafts_never_right_are_probed_ever_more_rarely():
    """Offered at every step and never right: verified while the estimate still pays (the prior, then after one
    rejection), then probed after 8, 16 and 32 declined offers (each rejected probe doubles the wait), one draft
    each: 5 of 80 steps."""
    _, top = free_decode(right=lambda i: False, offered=lambda i: True)
    free = top.lookup_stats
    assert free.accepted == 0 and free.drafted == free.verifications == 5
    assert top.length.free_wait == 64


def test_free_drafts_not_offered_leave_the_policy_as_it_was():
    """A lookup that never finds a continuation changes nothing: the same steps as without one."""
    _, top = free_decode(right=lambda i: True, offered=lambda i: False)
    _, plain = scripted_decode(right=lambda i: False)
    assert top.lookup_stats.verifications == 0
    assert top.stats.verifications == plain.stats.verifications
    assert top.length.own_steps_taken == plain.length.own_steps_taken


def test_free_drafts_are_not_looked_up_before_the_host_has_read_the_sequence():
    """A round queued ahead of its token's read (rounds.decode's lookahead on a GPU) leaves the host copy behind:
    the lookup, which reads the host copy, is skipped rather than made to wait for the device."""
    _, top = free_decode(right=lambda i: True, offered=lambda i: True)
    asked = []
    top.lookup.continuation = lambda prefix, n: asked.append(n) or []
    behind = TokenSequence.of(prompt_for(0), "cpu", 64)
    behind.append(torch.tensor([1]))  # on the device only
    assert top._free_step(behind, None) is None and asked == []
    behind.host_ids()
    assert top._free_step(behind, None) is None and asked == [SCRIPTED_PRICES.ceiling]
