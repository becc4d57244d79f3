"""Adaptive speculation lengths: the policies as pure functions, and the pipeline staying exact under them."""

import itertools
import random

import pytest
from helpers import fixed_drafts_at_least, rich_model
from test_speculative import (
    COMBOS,
    MIDDLE_TRIALS,
    NEW_TOKENS,
    P_THRESHOLD,
    PIPELINE_TRIALS,
    PROMPT_TOKENS,
    TEMPERATURE_1,
    MiddleTier,
    autoregressive_tokens,
    engine_config,
    joint_chi_square,
    pipeline_pairs,
    prompt_for,
    target_joint,
)
from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache

from triforce_cli.decoding import speculative, step_costs
from triforce_cli.decoding.clock import DeviceClock
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.speculation_length import (
    DEFAULT_PRIOR,
    DRAFT_MARGIN,
    DRAFT_RETRY,
    MAX_DRAFT_RETRY,
    MAX_PROBE_WAIT,
    PROBE_WAIT,
    SHORTCUT_RETRY,
    AcceptanceCounts,
    DraftSource,
    SpeculationLength,
    StepCosts,
    expected_tokens,
    heuristic_length,
    prior_acceptance,
    throughput_length,
    verification_cost,
)
from triforce_cli.decoding.speculative import TierCosts
from triforce_cli.errors import ConfigError


def test_heuristic_grows_by_two_and_shrinks_by_one_within_bounds():
    assert heuristic_length(3, all_accepted=True, ceiling=8) == 5
    assert heuristic_length(7, all_accepted=True, ceiling=8) == 8
    assert heuristic_length(3, all_accepted=False, ceiling=8) == 2
    assert heuristic_length(1, all_accepted=False, ceiling=8) == 1


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_throughput_length_weighs_acceptance_against_costs():
    flat = {n: 1.0 for n in range(1, 9)}
    assert throughput_length(0.95, 0.01, flat, 8) == 8  # cheap, reliable drafts: draft as far as allowed
    assert throughput_length(0.1, 0.5, flat, 8) == 1  # expensive, rarely accepted drafts: draft least
    # with a = 0.8 and free drafts, 1.8 tokens for 1.0 s beats 2.44 tokens for 2.0 s
    steep = {1: 1.0, 2: 1.0, 3: 2.0, 4: 2.0}
    assert throughput_length(0.8, 0.0, steep, 4) == 2


def test_heuristic_policy_follows_verifications():
    length = SpeculationLength("heuristic", ceiling=6)
    assert length.current == 6
    trace = []
    for drafted, accepted in [(6, 2), (5, 0), (4, 4), (6, 6), (0, 0), (6, 1)]:
        length.record(drafted, accepted, 0.0, 0.0)
        trace.append(length.current)
    assert trace == [5, 4, 6, 6, 6, 5]  # an empty proposal (0 drafted) changes nothing


def test_throughput_policy_learns_costs_per_length():
    length = SpeculationLength("throughput", ceiling=4)
    for _ in range(30):
        n = length.current
        # every draft accepted with probability ~0.8; verifying more than 2 tokens doubles the cost
        length.record(n, round(0.8 * n), 0.0, 1.0 if n <= 2 else 2.0)
    assert length.verify_seconds[4] == pytest.approx(2.0) and length.verify_seconds[2] == pytest.approx(1.0)
    assert length.current == 2


def test_a_draft_source_weighs_every_draft_alike():
    source = DraftSource()
    assert source.acceptance is None and source.draft_seconds is None
    source.record(drafted=1, accepted=0, draft_seconds=0.5)
    source.record(drafted=6, accepted=6, draft_seconds=0.6)
    # six accepted drafts outweigh one earlier rejection: 6 / (0.9 * 1 + 6)
    assert source.acceptance == pytest.approx(6 / 6.9)
    assert source.draft_seconds == pytest.approx((0.9 * 0.5 + 0.6) / 6.9)


def test_acceptance_estimate_of_single_drafts_stays_near_the_truth():
    """One draft per verification, each accepted with probability 0.4: the estimate the policy acts on stays
    within about 0.1 of 0.4 (a running average per verification with weight 0.3 wanders by about 0.2)."""
    rng = random.Random(0)
    source = DraftSource()
    estimates = []
    for i in range(2000):
        source.record(1, int(rng.random() < 0.4), 0.0)
        if i >= 50:
            estimates.append(source.acceptance)
    mean = sum(estimates) / len(estimates)
    spread = (sum((e - mean) ** 2 for e in estimates) / len(estimates)) ** 0.5
    assert abs(mean - 0.4) < 0.02 and spread < 0.13


def test_acceptance_counts_only_drafts_the_verifier_judged():
    """Four drafts a verification, each accepted with probability 0.5 until the first rejection: the estimate is
    0.5, not the 0.23 of accepted over drafted (drafts after a rejection are never judged)."""
    rng = random.Random(1)
    source = DraftSource()
    estimates = []
    for i in range(3000):
        accepted = 0
        while accepted < 4 and rng.random() < 0.5:
            accepted += 1
        source.record(4, accepted, 0.0)
        if i >= 50:
            estimates.append(source.acceptance)
    assert abs(sum(estimates) / len(estimates) - 0.5) < 0.03


def asked_lengths(length: SpeculationLength, wanted: int, accepted: bool, rounds: int = 12) -> list[int]:
    """The lengths a tier asks for when its caller never wants more than `wanted` tokens (so it drafts at most
    wanted - 1) and every draft is accepted, or every one rejected; verifications cost 1 s, drafts 1 ms."""
    asked = []
    for _ in range(rounds):
        n = min(length.current, wanted - 1)
        asked.append(length.current)
        length.record(n, n if accepted else 0, 0.001 * n, 1.0)
    return asked


def test_lengths_a_tier_is_never_asked_for_in_full_do_not_stall_the_policy():
    """Drafting at most 2 of a ceiling of 4, the tier explores 1 after 2 and then chooses: one draft where all are
    rejected; where all pass, the longest length (3 and 4, never measured, cost what 2 does), cut to 2."""
    assert asked_lengths(SpeculationLength("throughput", ceiling=4), wanted=3, accepted=False) == [4, 1] + [1] * 10
    assert asked_lengths(SpeculationLength("throughput", ceiling=4), wanted=3, accepted=True) == [4, 1] + [4] * 10


def test_verification_cost_of_an_unmeasured_length_is_the_nearest_below():
    measured = {2: 1.0, 5: 3.0}
    assert [verification_cost(measured, n) for n in range(1, 8)] == [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0]


def run_policy(length: SpeculationLength, rounds: int, sources: dict) -> list[bool]:
    """Feed `rounds` verifications costing 1 s each; sources maps use_shortcut to (whether drafts are accepted,
    seconds per draft). Returns the source of each verification."""
    used = []
    for _ in range(rounds):
        n, shortcut = length.current, length.use_shortcut
        accepted, draft_seconds = sources[shortcut]
        length.record(n, n if accepted else 0, draft_seconds * n, 1.0)
        used.append(shortcut)
    return used


def test_throughput_policy_takes_the_shortcut_when_it_pays():
    """A middle tier whose drafts cost more than they save is skipped, and retried every SHORTCUT_RETRY rounds."""
    length = SpeculationLength("throughput", ceiling=4, has_shortcut=True)
    costly_middle, cheap_drafter = (True, 1.0), (True, 0.01)
    used = run_policy(length, 5 + 3 * SHORTCUT_RETRY, {False: costly_middle, True: cheap_drafter})
    assert used[:4] == [False] * 4  # every length tried once, through the middle tier
    assert used[4] is True  # then the shortcut, unmeasured so far
    later = used[5:]
    assert later.count(False) == 3 and later.count(True) == len(later) - 3  # the middle tier only on retries


def test_throughput_policy_keeps_the_middle_tier_when_it_pays():
    length = SpeculationLength("throughput", ceiling=4, has_shortcut=True)
    cheap_middle, poor_drafter = (True, 0.05), (False, 0.01)
    used = run_policy(length, 5 + 3 * SHORTCUT_RETRY, {False: cheap_middle, True: poor_drafter})
    assert used[4] is True and used[5:].count(True) == 3  # the drafter alone only on retries


def test_an_empty_shortcut_proposal_returns_to_the_proposer():
    length = SpeculationLength("throughput", ceiling=2, has_shortcut=True)
    for n in (2, 1):
        length.record(n, n, 0.0, 1.0)
    assert length.use_shortcut
    length.record(0, 0, 0.0, 1.0)  # the shortcut (an n-gram, say) found nothing
    assert not length.use_shortcut


def test_a_source_measured_alone_sets_the_length():
    """Where only the shortcut has drafted so far (a proposer that found nothing, or passes cut short at the end
    of a generation), the next length comes from the shortcut's measurements, and a retry returns to the
    unmeasured proposer."""
    length = SpeculationLength("throughput", ceiling=3, has_shortcut=True)
    length.use_shortcut = True
    length.record(1, 1, 0.001, 0.01)  # one length, the shortest: nothing shorter left to explore
    assert length.current == 3  # every draft accepted, drafting cheap: the ceiling
    assert length.use_shortcut is False  # the forced first retry goes to the unmeasured proposer


def test_without_a_shortcut_the_source_never_changes():
    length = SpeculationLength("throughput", ceiling=3)
    assert not any(run_policy(length, 3 * SHORTCUT_RETRY, {False: (True, 0.1)}))


class ScriptedSource(SpeculationLength):
    """The throughput lengths, with the source of every verification (where there are two) set by the test's
    `shortcut_now` instead of the policy."""

    def shortcut_now(self) -> bool:
        raise NotImplementedError

    @property
    def use_shortcut(self) -> bool:
        return self.has_shortcut and self.shortcut_now()

    @use_shortcut.setter
    def use_shortcut(self, value: bool) -> None:
        pass


class CoinFlipSource(ScriptedSource):
    """Every verification's source drawn at random."""

    def shortcut_now(self) -> bool:
        return random.random() < 0.5


def test_pipeline_is_exact_when_the_top_tier_switches_sources(monkeypatch):
    """Target@full verifying drafts from the retrieval tier or straight from the drafter, chosen anew for each
    verification, still samples from its own distribution."""
    monkeypatch.setattr(speculative, "SpeculationLength", CoinFlipSource)
    random.seed(0)
    pairs = pipeline_pairs("triforce", PIPELINE_TRIALS, gamma_policy="throughput")
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD


class AlwaysShortcut(ScriptedSource):
    """Every verification drafts from the shortcut, as many tokens as the ceiling."""

    def shortcut_now(self) -> bool:
        return True

    def _choose(self, drafted: int) -> None:
        pass


def full_lengths_at_calls(monkeypatch, method: str) -> list[int]:
    """The full cache's length at every call of RetrievalCache.<method> from now on (the method still runs)."""
    lengths: list[int] = []
    original = getattr(RetrievalCache, method)

    def recorded(self):
        lengths.append(self.full.length)
        return original(self)

    monkeypatch.setattr(RetrievalCache, method, recorded)
    return lengths


def test_an_idle_retrieval_tier_is_not_refreshed(monkeypatch):
    """While target@full drafts straight from the drafter, the retrieval cache keeps the view of the prefill:
    no chunk selection or recent-token copy beyond it, and the greedy output is unchanged."""
    monkeypatch.setattr(speculative, "SpeculationLength", AlwaysShortcut)
    selections = full_lengths_at_calls(monkeypatch, "select_chunks")
    syncs = full_lengths_at_calls(monkeypatch, "sync_recent")
    engine = Engine(rich_model(0).loaded, engine_config("triforce", gamma_policy="throughput"))
    result = engine.generate(prompt_for(0))
    assert result.token_ids == list(autoregressive_tokens(0))
    assert (len(selections), len(syncs)) == (1, 1)  # the selection after prefill, which syncs once
    *through_the_middle, shortcut = result.stats.acceptance  # retrieval -> target, drafter -> retrieval
    assert shortcut.verifications > 1 and all(stats.verifications == 0 for stats in through_the_middle)


class ThreeShortcutsThenTheMiddle(ScriptedSource):
    """Three verifications drafted straight from the drafter, then one through the middle tier, over and over;
    every length at the ceiling."""

    rounds = 0

    def shortcut_now(self) -> bool:
        return self.rounds % 4 != 3

    def record(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.rounds += 1


def test_the_retrieval_tier_catches_up_after_shortcut_rounds(monkeypatch):
    """With a selection due every 8 rounds and the middle tier drafting every 4th, it drafts once after copying
    three rounds of recent tokens, once after a selection: exact, within its recent region, with a selection
    before every second turn."""
    monkeypatch.setattr(speculative, "SpeculationLength", ThreeShortcutsThenTheMiddle)
    selections = full_lengths_at_calls(monkeypatch, "select_chunks")
    config = engine_config("triforce", gamma_policy="throughput", refresh_interval=8)
    result = Engine(rich_model(0).loaded, config).generate(prompt_for(0))
    assert result.token_ids == list(autoregressive_tokens(0))
    top, middle, shortcut = result.stats.acceptance
    assert (middle.proposer, middle.verifier) == ("drafter", "retrieval")
    passes = top.verifications + shortcut.verifications  # a last round that wants one token verifies nothing
    # selections after passes 11, 19, 27, ...: the middle tier's turns when 8 rounds have passed since the last
    assert shortcut.verifications == passes - passes // 4 and len(selections) == 1 + (passes - 3) // 8


def test_fixed_policy_never_moves():
    length = SpeculationLength("fixed", ceiling=3)
    length.record(3, 0, 1.0, 1.0)
    assert length.current == 3


def test_auto_is_costed_seeded_or_not():
    def resolved(policy="auto", **sampling):
        return EngineConfig(gamma_policy=policy, sampling=SamplingConfig(**sampling)).speculation_policy

    assert resolved(temperature=0.6) == "costed"
    assert resolved(temperature=0.6, seed=3) == "costed"  # its choices follow no clock: a seeded run repeats
    assert resolved(temperature=0, seed=3) == "costed"
    assert resolved("heuristic", temperature=0.6, seed=3) == "heuristic"
    assert resolved("throughput", temperature=0.6) == "throughput"


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="unknown gamma policy 'greedy'"):
        engine_config(gamma_policy="greedy")


@pytest.mark.parametrize("policy", ["heuristic", "throughput"])
@pytest.mark.parametrize("mode", ["retrieval", "streaming", "triforce"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_adaptive_lengths_equals_autoregressive(seed, mode, policy):
    engine = Engine(rich_model(seed).loaded, engine_config(mode, gamma_policy=policy, **COMBOS["b32-r3-g3x4"]))
    result = engine.generate(prompt_for(seed))
    assert result.token_ids == list(autoregressive_tokens(seed))
    ceilings = {"retrieval": 3, "target": 4 if mode != "streaming" else 3}
    tiers = result.stats.acceptance
    if mode == "triforce" and policy == "throughput":
        *tiers, shortcut = tiers  # drafter -> target, tried at least once
        assert (shortcut.proposer, shortcut.verifier) == ("drafter", "target") and shortcut.verifications >= 1
    own_steps = {costs.tier: costs.own_steps for costs in result.stats.tier_costs}
    for stats in tiers:
        # the length moved: above 1 on average, and for target@full below what a fixed ceiling drafts, which
        # only its last passes cut (by at most 1 + 2 + ... + (ceiling - 1) drafts; the retrieval tier's drafts are
        # cut to the tokens the full tier wants at every pass, so only their lower bound tells), or down to own
        # steps (length 0, throughput only)
        assert 1 < stats.mean_drafted, stats
        ceiling = ceilings["target"]
        moved = stats.drafted < fixed_drafts_at_least(ceiling, stats.verifications) or own_steps.get("target", 0)
        assert stats.verifier != "target" or moved


@pytest.mark.parametrize("policy", ["heuristic", "throughput"])
def test_greedy_with_ngram_and_adaptive_lengths_equals_autoregressive(policy):
    engine = Engine(rich_model(0).loaded, engine_config("triforce", ngram=True, gamma_policy=policy))
    assert engine.generate(prompt_for(0)).token_ids == list(autoregressive_tokens(0))


def test_middle_tier_with_heuristic_lengths_is_exact_for_its_own_cache():
    """Lengths of 1 and 2 alternate across the trials (the policy's state carries over); tokens stay exact."""
    middle = MiddleTier(TEMPERATURE_1, seed=6, gamma_policy="heuristic")
    first, second = middle.exact_joint(committed=3)
    pairs = middle.pairs(committed=3, trials=MIDDLE_TRIALS)
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD
    stats = middle.tier.stats
    assert 1 < stats.mean_drafted < 2


def feed(length: SpeculationLength, rounds: int, accepted: bool, draft_seconds: float, own_seconds: float) -> list[int]:
    """Run `rounds` steps of a tier whose verifications cost 1 s and own steps own_seconds; drafts are all accepted
    or all rejected and cost draft_seconds each. Returns the length of each step (0: an own step)."""
    lengths = []
    for _ in range(rounds):
        n = length.current
        lengths.append(n)
        if n == 0:
            length.record_own_step(own_seconds)
        else:
            length.record(n, n if accepted else 0, draft_seconds * n, 1.0)
    return lengths


def test_drafting_that_does_not_pay_is_dropped_for_own_steps_and_retried_ever_less_often():
    length = SpeculationLength("throughput", ceiling=3, own_steps=True)
    lengths = feed(length, 200, accepted=False, draft_seconds=0.1, own_seconds=0.9)
    assert lengths[:4] == [3, 2, 1, 0]  # every length tried once, then one own step to measure it
    retries = [i for i in range(1, len(lengths)) if lengths[i] and not lengths[i - 1]]
    gaps = [b - a - 1 for a, b in itertools.pairwise(retries)]
    assert gaps[:5] == [DRAFT_RETRY, 2 * DRAFT_RETRY, 4 * DRAFT_RETRY, MAX_DRAFT_RETRY, MAX_DRAFT_RETRY]  # each lost
    assert lengths.count(0) > 0.9 * len(lengths) and length.dropped == len(retries)


def test_drafting_that_pays_is_kept_after_one_own_step():
    length = SpeculationLength("throughput", ceiling=3, own_steps=True)
    lengths = feed(length, 60, accepted=True, draft_seconds=0.01, own_seconds=0.9)
    assert lengths.count(0) == 1 and length.dropped == 0 and lengths[-1] == 3


def test_own_steps_are_tried_again_after_the_text_changes():
    """Drafts that stopped paying are dropped; once they pay again, the next retry keeps them."""
    length = SpeculationLength("throughput", ceiling=3, own_steps=True)
    feed(length, 40, accepted=False, draft_seconds=0.1, own_seconds=0.9)
    assert length.current == 0 or length.retrying
    lengths = feed(length, 120, accepted=True, draft_seconds=0.01, own_seconds=0.9)
    first_draft = next(i for i, n in enumerate(lengths) if n)
    assert first_draft <= MAX_DRAFT_RETRY and 0 not in lengths[first_draft + 1 :]


def test_without_own_steps_the_length_never_drops_to_zero():
    length = SpeculationLength("throughput", ceiling=3)
    assert 0 not in feed(length, 50, accepted=False, draft_seconds=0.1, own_seconds=0.01)


# --- costed: prices fixed before decoding, acceptance counts learnt -------------------------------------------------


def costed(forward: tuple[float, ...], draft: float = 0.01, shortcut: float | None = None) -> SpeculationLength:
    """A costed top tier (own steps allowed) with ceiling len(forward) - 1, priced at forward (seconds of a forward
    of 1, 2, ... tokens) and `draft` seconds a drafted token; a shortcut priced where given."""
    has_shortcut = shortcut is not None
    length = SpeculationLength("costed", ceiling=len(forward) - 1, has_shortcut=has_shortcut, own_steps=True)
    priors = {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR} if has_shortcut else {False: DEFAULT_PRIOR}
    length.price(StepCosts(forward, draft, shortcut or 0.0), priors)
    return length


def feed_costed(length: SpeculationLength, rounds: int, accepts, seconds=lambda: 1.0) -> list[tuple[int, bool]]:
    """Run `rounds` steps; accepts(drafted, round) gives how many drafts a verification accepts, seconds() what
    every step is said to take. Returns (length, source) of each step, (0, False) for an own step."""
    steps = []
    for i in range(rounds):
        n, shortcut = length.current, length.use_shortcut
        if n == 0:
            steps.append((0, False))
            length.record_own_step(seconds())
        else:
            steps.append((n, shortcut))
            length.record(n, accepts(n, i), seconds(), seconds())
    return steps


VERIFY_EACH_TOKEN = (1.0, 2.0, 3.0, 4.0, 5.0)  # verifying s drafts costs s + 1 plain steps: drafting never pays
FLAT = (1.0,) * 5  # verifying any number of drafts costs one plain step
SLOPE = (1.0, 1.2, 1.4, 1.6, 1.8)  # each verified token adds a fifth of a plain step, as on a CPU


def test_costed_drafting_that_could_not_pay_even_if_always_accepted_is_never_tried():
    """Each verified token costs a plain step: even with every draft accepted, drafting yields fewer tokens per
    second than own steps, so no step drafts, not even a probe, and the tier's note says why."""
    length = costed(VERIFY_EACH_TOKEN)
    steps = feed_costed(length, 200, accepts=lambda n, i: n)
    assert all(n == 0 for n, _ in steps)
    assert length.payable == ()
    costs = TierCosts("target", {0: 1000.0}, own_steps=length.own_steps_taken, priced=True)
    assert "every draft accepted" in costs.note and "200 steps" in costs.note


def test_costed_drafting_that_could_pay_but_does_not_is_probed_ever_less_often():
    """Drafts that would pay if accepted, never accepted: a rejected probe loses 0.21 of a plain step (a draft at
    0.01 and a verification of one draft at 1.2, for the one token a plain step gives), so the shortest wait is
    11 plain steps (0.21 is 2% of 10.5); in 200 steps drafting is probed at the first, then after 11, 22, 44 and
    64 own steps; one draft a probe."""
    length = costed(SLOPE)
    assert length.probe_base == 11
    steps = feed_costed(length, 200, accepts=lambda n, i: 0)
    probes = [i for i, (n, _) in enumerate(steps) if n]
    assert probes == [0, 12, 35, 80, 145]
    assert all(steps[i][0] == 1 for i in probes)


def test_costed_probes_wait_longer_where_a_verification_costs_more():
    """The shortest wait between probes grows with what a rejected probe loses, and is never below PROBE_WAIT."""
    cheap = costed((1.0, 1.0, 1.0), draft=0.01)  # a rejected probe loses a hundredth of a step
    dear = costed((1.0, 1.5, 2.0), draft=0.01)  # half a step
    assert cheap.probe_base == PROBE_WAIT
    assert dear.probe_base == 26  # 0.51 / 0.02 = 25.5


def test_costed_drafts_whose_choice_of_chunks_eats_the_gain_are_never_probed():
    """A retrieval tier drafting at 0.5 of a plain step, verified at 1.3 (as at 7K on a 2-core CPU): every draft
    accepted gives 2 tokens for 1.8 steps, 1.11x the rate of own steps, so without a choice of chunks the tier
    probes; a choice at 0.8 of a step every 4 verifications adds 0.2 to each, 2 tokens for 2.0 steps, 1.0x, short
    of DRAFT_MARGIN: never probed, not even at the first step. A rejected probe also pays a whole choice (it follows
    own steps), which lengthens the wait between probes where drafting could pay."""
    verify = (1.0, 1.3)
    bare = SpeculationLength("costed", ceiling=1, own_steps=True)
    bare.price(StepCosts(verify, 0.5), {False: DEFAULT_PRIOR})
    assert bare.payable == (False,) and bare.drafting
    chosen = SpeculationLength("costed", ceiling=1, own_steps=True)
    chosen.price(StepCosts(verify, 0.5, proposer_selection=0.8, proposer_refresh=4), {False: DEFAULT_PRIOR})
    assert StepCosts(verify, 0.5, proposer_selection=0.8, proposer_refresh=4).round(False) == pytest.approx(0.2)
    assert chosen.payable == ()
    steps = feed_costed(chosen, 100, accepts=lambda n, i: n)
    assert all(n == 0 for n, _ in steps)
    cheap = SpeculationLength("costed", ceiling=1, own_steps=True)
    cheap.price(StepCosts(verify, 0.01, proposer_selection=0.2, proposer_refresh=8), {False: DEFAULT_PRIOR})
    assert cheap.payable == (False,)
    assert cheap.probe_base == 26  # a rejected probe: 0.01 + 0.2 + 1.3 - 1.0 = 0.51 steps, 2% of 25.5


def test_costed_keeps_a_shortcut_that_found_nothing_where_the_proposer_could_never_pay():
    """A shortcut (an n-gram) that found nothing is asked again at the next drafting step where the proposer's drafts
    could not pay even if always accepted (a retrieval tier at 7K), rather than turning to them; where they could,
    back to the proposer as under the other policies."""
    only_shortcut = costed(FLAT, draft=1.0, shortcut=0.01)
    assert only_shortcut.payable == (True,) and only_shortcut.drafting
    only_shortcut.use_shortcut = True
    only_shortcut.record(0, 0, 0.0, 0.0)
    assert only_shortcut.use_shortcut
    both = costed(FLAT, draft=0.01, shortcut=0.01)
    assert set(both.payable) == {False, True}
    both.use_shortcut = True
    both.record(0, 0, 0.0, 0.0)
    assert not both.use_shortcut


def test_costed_probes_only_the_source_that_could_pay():
    """The proposer drafts at the price of a plain step, so its drafts could never pay; the shortcut's could, and
    are never accepted: every probe drafts from the shortcut."""
    length = costed(SLOPE, draft=1.0, shortcut=0.01)
    assert length.payable == (True,)
    steps = feed_costed(length, 100, accepts=lambda n, i: 0)
    drafting = [(n, shortcut) for n, shortcut in steps if n]
    assert len(drafting) >= 4 and all(shortcut for _, shortcut in drafting)


def test_costed_drafts_that_are_never_accepted_are_probed_ever_less_often():
    steps = feed_costed(costed(SLOPE), 200, accepts=lambda n, i: 0)
    assert sum(1 for n, _ in steps if n) <= 7


def test_costed_drafting_that_always_pays_drafts_every_step_at_the_ceiling():
    steps = feed_costed(costed(FLAT), 200, accepts=lambda n, i: n)
    assert all(n == 4 for n, _ in steps)


def test_costed_drafting_resumes_soon_after_the_text_turns_repetitive():
    """Nothing accepted for 100 steps, then everything: a probe within one longest wait, which pays for itself, so
    the next comes after the shortest wait, and drafting stays from then on, up to the ceiling."""
    length = costed(SLOPE)
    steps = feed_costed(length, 200, accepts=lambda n, i: 0 if i < 100 else n)
    first = next(i for i in range(100, 200) if steps[i][0])
    assert first <= 100 + MAX_PROBE_WAIT
    assert all(n for n, _ in steps[first + length.probe_base + 1 :]) and steps[-1][0] == 4


def test_costed_drafting_that_stops_paying_is_dropped_after_a_few_verifications():
    """Everything accepted for 20 steps, then nothing: the estimate forgets by drafts, so own steps come within
    about a dozen verifications, each shorter than the last, and then only probes draft."""
    steps = feed_costed(costed(SLOPE), 60, accepts=lambda n, i: n if i < 20 else 0)
    assert all(n for n, _ in steps[:20])
    dropped = next(i for i in range(20, 60) if steps[i][0] == 0)
    lengths = [n for n, _ in steps[20:dropped]]
    assert dropped <= 35 and lengths == sorted(lengths, reverse=True)
    assert sum(1 for n, _ in steps[dropped:] if n) <= 3


def test_costed_probes_take_turns_between_the_sources():
    """Neither source's drafts accepted: the first step drafts from the shortcut, which the prior says pays as it
    drafts cheaper; after it, probes alternate between the shortcut and the proposer, one draft each."""
    steps = feed_costed(costed(SLOPE, draft=0.5, shortcut=0.01), 100, accepts=lambda n, i: 0)
    drafting = [(n, shortcut) for n, shortcut in steps if n]
    assert drafting == [(1, True), (1, True), (1, False), (1, True)]


def probes_with_set_up(length: SpeculationLength, rounds: int) -> list[tuple[int, bool]]:
    """(step, source) of every probe in `rounds` steps whose drafts are never accepted, each source's set-up
    running at its first drafts, as ModelTier says to the policy."""
    probes = []
    for i in range(rounds):
        if length.current == 0:
            length.record_own_step(1.0)
            continue
        probes.append((i, length.use_shortcut))
        length.set_up_due = tuple(source for source in length.set_up_due if source != length.use_shortcut)
        length.record(length.current, 0, 1.0, 1.0)
    return probes


def test_costed_probes_a_source_with_a_set_up_once_own_steps_pay_for_it():
    """A drafter at 0.2 of a plain step (drafting does not pay from the prior) whose prefill costs 0.6: a rejected
    first probe loses that, its draft and a verification of one draft (1.2) for the one token a plain step gives,
    1.0 in all, which is 2% of 50 plain steps: the first probe comes after 50 own steps, not at the first; later
    ones wait as without a set-up (20 own steps, then 40)."""
    length = SpeculationLength("costed", ceiling=4, own_steps=True)
    length.price(StepCosts(SLOPE, 0.2, proposer_set_up=0.6), {False: DEFAULT_PRIOR}, set_up_due=(False,))
    assert length.current == 0 and length.own_steps_left == length.set_up_wait == 50
    note = TierCosts("target", {0: 1000.0}, own_steps=40, priced=True, set_up_wait=length.set_up_wait).note
    assert "first probed after 50 own steps" in note and "every draft accepted" not in note
    assert [step for step, _ in probes_with_set_up(length, 120)] == [50, 71, 112]
    free = SpeculationLength("costed", ceiling=4, own_steps=True)
    free.price(StepCosts(SLOPE, 0.2, proposer_set_up=0.6), {False: DEFAULT_PRIOR})  # set up already
    assert [step for step, _ in probes_with_set_up(free, 70)] == [0, 21, 62]


def test_costed_probes_an_ngram_before_a_drafter_at_once_and_sets_the_drafter_up_later():
    """The same drafter behind an n-gram, which drafts without its prefill: probed at the first step, and again
    after the shortest wait where it found nothing to draft; the drafter's prefill may run only once the own steps
    pay for it (50)."""
    length = SpeculationLength("costed", ceiling=4, own_steps=True)
    costs = StepCosts(SLOPE, 0.2, proposer_set_up=0.6)
    length.price(costs, {False: DEFAULT_PRIOR}, set_up_due=(False,), drafts_before_set_up=(False,))
    assert length.current == 1 and not length.may_set_up(False)
    length.record(0, 0, 0.0, 0.0)  # the n-gram found nothing
    assert length.current == 0 and length.own_steps_left == length.probe_base == 20
    for _ in range(50):
        length.record_own_step(1.0)
    assert length.may_set_up(False)


def test_an_ngram_accepted_before_a_drafter_sets_it_up_only_once_the_tokens_pay_for_it():
    """The drafter behind an n-gram, its prefill priced at 0.6 of a plain step: the n-gram's drafts all accepted
    make drafting pay, which says nothing of the drafter's; its prefill waits until the tokens committed pay for
    it (41: the prefill, a draft and a verification of one draft lose 0.81 of a plain step, 2% of 40.5), whatever
    the n-gram earns meanwhile."""
    length = SpeculationLength("costed", ceiling=4, own_steps=True)
    costs = StepCosts(SLOPE, 0.01, proposer_set_up=0.6)
    length.price(costs, {False: DEFAULT_PRIOR}, set_up_due=(False,), drafts_before_set_up=(False,))
    wait = length._set_up_wait(False)
    assert wait == 41
    while length.tokens_taken + length.current + 1 < wait:
        length.record(length.current, length.current, 0.0, 0.0)  # every n-gram draft accepted
        assert length.drafting and length._pays() and not length.may_set_up(False)
    length.record(length.current, length.current, 0.0, 0.0)
    assert length.tokens_taken >= wait and length.may_set_up(False)


def test_the_proposer_paying_does_not_set_up_a_drafter_behind_the_shortcut():
    """The target drafting from the retrieval tier, which pays from its prior (32K), with an n-gram before the
    drafter as its shortcut, the drafter's prefill priced at 6 plain steps and forwards priced as measured there
    (a verification of one draft 1.42 plain steps, of two 2.1): the proposer's drafts paying lets the proposer
    draft, not the drafter's prefill run; the shortcut's n-gram drafts alone until the tokens committed pay for the
    prefill (_tokens_pay_set_up), as a retry's do."""
    length = SpeculationLength("costed", ceiling=4, own_steps=True, has_shortcut=True)
    costs = StepCosts((1.0, 1.42, 2.1, 2.8, 3.5), proposer=0.18, shortcut=0.05, shortcut_set_up=6.0)
    priors = {False: prior_acceptance("retrieval"), True: DEFAULT_PRIOR}
    length.price(costs, priors, set_up_due=(True,), drafts_before_set_up=(True,))
    rates = {source: rate for source, (rate, _) in length._options().items()}
    assert rates[False] >= DRAFT_MARGIN / costs.own > rates[True]  # the proposer's drafts pay, the shortcut's not
    assert length.may_set_up(False) and not length.may_set_up(True)
    wait = length._set_up_wait(True)
    for _ in range(wait):  # each verification commits a token at least
        shortcut = length.use_shortcut
        assert length.current > 0  # the proposer's drafts pay: the policy drafts throughout
        length.record(length.current, 0 if shortcut else length.current, 0.0, 0.0)  # the shortcut's drafts rejected
        if length.tokens_taken >= wait:
            break
        assert not length.may_set_up(True)
    assert length.tokens_taken >= wait and length.may_set_up(True)


def test_costed_probes_the_source_without_a_set_up_first():
    """The shortcut would be probed first, but its set-up is due: the proposer, which has none, is probed instead
    until a probe's turn comes after the own steps pay for the set-up (0.85 + 0.2 + 0.2: 63 steps; the third
    probe comes after 60), then the probes take turns as without a set-up; the waits are 20, 40, then 64 steps."""
    length = SpeculationLength("costed", ceiling=4, own_steps=True, has_shortcut=True)
    costs = StepCosts(SLOPE, proposer=0.3, shortcut=0.2, shortcut_set_up=0.85)
    length.price(costs, {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}, set_up_due=(True,))
    probes = probes_with_set_up(length, 300)
    assert probes == [(0, False), (21, False), (62, False), (127, True), (192, False), (257, True)]


def test_costed_starts_drafting_where_the_prior_says_it_pays():
    """The retrieval tier's prior (the target agreeing with itself on part of its cache) and forwards that cost
    little more for more tokens: the first step drafts long, no probe needed."""
    length = SpeculationLength("costed", ceiling=6, own_steps=True)
    length.price(
        StepCosts((1.0, 1.05, 1.1, 1.15, 1.2, 1.25, 1.3), proposer=0.3), {False: prior_acceptance("retrieval")}
    )
    assert length.current > 1
    length.record(length.current, length.current, 0.0, 0.0)
    assert length.current > 1  # it keeps drafting
    plain = SpeculationLength("costed", ceiling=6, own_steps=True)
    plain.price(StepCosts((1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2), proposer=0.6), {False: prior_acceptance("drafter")})
    assert plain.current == 1  # a drafter at 60% of a step: a probe of one draft first
    plain.record(1, 1, 0.0, 0.0)
    assert plain.current == 0  # one accepted draft does not make it pay: own steps


def test_costed_choices_follow_acceptance_not_the_clock():
    """The same acceptances with every time reported at random: the same lengths and sources, step for step."""
    rng = random.Random(0)
    outcomes = [rng.random() < 0.5 for _ in range(300)]

    def accepts(n, i):
        return n if outcomes[i] else 0

    traces = [
        feed_costed(costed(SLOPE, draft=0.2, shortcut=0.05), 300, accepts, seconds=random.Random(seed).random)
        for seed in (1, 2)
    ]
    assert traces[0] == traces[1]
    assert len({n for n, _ in traces[0]}) > 2  # the trace moves: own steps and more than one length


def seeded_tokens(monkeypatch, policy: str, clock_seed: int, mode: str = "triforce") -> tuple[list[int], list]:
    """A seeded run at temperature 1 with every time the clock gives random (drawn from clock_seed): its tokens and
    acceptance statistics."""
    rng = random.Random(clock_seed)
    monkeypatch.setattr(DeviceClock, "mark", lambda self: rng.random())
    drafting_could_pay(monkeypatch)
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, seed=7)
    config = engine_config(mode, sampling=sampling, gamma_policy=policy, **COMBOS["b32-r3-g3x4"])
    result = Engine(rich_model(0).loaded, config).generate(prompt_for(0))
    return result.token_ids, result.stats.acceptance


@pytest.mark.parametrize("mode", ["streaming", "triforce"])
def test_a_seeded_sampled_run_repeats_whatever_the_clock(monkeypatch, mode):
    first, acceptance = seeded_tokens(monkeypatch, "auto", clock_seed=1, mode=mode)
    second, _ = seeded_tokens(monkeypatch, "auto", clock_seed=2, mode=mode)
    assert first == second
    assert acceptance[0].verifications > 0  # the runs drafted: their choices had something to follow


def test_the_seeded_run_check_sees_a_policy_that_follows_the_clock(monkeypatch):
    """Guard for the test above: under throughput, the same random clocks change the tokens."""
    first, _ = seeded_tokens(monkeypatch, "throughput", clock_seed=1)
    second, _ = seeded_tokens(monkeypatch, "throughput", clock_seed=2)
    assert first != second


def drafting_could_pay(monkeypatch) -> None:
    """Price forwards as on a CPU: on the full cache 1 s and a fifth of that more for each further token, on the
    retrieval cache half of it, on the drafter's 50 ms a token: drafting pays where enough drafts are accepted."""
    scales = {FullCache: 1.0, RetrievalCache: 0.5, StreamingCache: 0.05}
    monkeypatch.setattr(
        step_costs,
        "forward_seconds",
        lambda model, cache, tokens, balance: scales[type(cache)] * (1.0 + 0.2 * (tokens - 1)),
    )


def drafting_pays(monkeypatch) -> None:
    """Price a forward at 1 s on the full cache, 0.1 s on the retrieval cache and 1 ms on the drafter's, whatever
    its tokens: verifying more costs nothing more, so drafting pays at every tier from the priors on."""
    prices = {FullCache: 1.0, RetrievalCache: 0.1, StreamingCache: 1e-3}
    monkeypatch.setattr(step_costs, "forward_seconds", lambda model, cache, tokens, balance: prices[type(cache)])


@pytest.mark.parametrize("pays", [False, True])
@pytest.mark.parametrize("mode", ["retrieval", "streaming", "triforce"])
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_with_costed_lengths_equals_autoregressive(monkeypatch, seed, mode, pays):
    """As priced for this machine (the tiny models' forwards cost about the same whatever they read: drafting
    hardly pays), and priced so that it always pays, where every tier drafts."""
    if pays:
        drafting_pays(monkeypatch)
    engine = Engine(rich_model(seed).loaded, engine_config(mode, gamma_policy="costed", **COMBOS["b32-r3-g3x4"]))
    result = engine.generate(prompt_for(seed))
    assert result.token_ids == list(autoregressive_tokens(seed))
    if pays:
        for stats in result.stats.acceptance:
            assert stats.verifications > 0 and stats.mean_drafted > 1, stats


def recorded_set_ups(monkeypatch) -> list[int]:
    """The number of ids each drafter set-up (its StreamingLLM prefill) runs on, in order, as generations go."""
    calls = []
    set_up = Engine._set_up_drafter

    def recording(self, streaming, ids, on_prefill=None):
        calls.append(len(ids))
        set_up(self, streaming, ids, on_prefill)

    monkeypatch.setattr(Engine, "_set_up_drafter", recording)
    return calls


def drafter_engine(mode: str, **overrides) -> Engine:
    target, drafter = rich_model(0), rich_model(50, num_layers=1, name="drafter")
    config = engine_config(mode, gamma_policy="costed", **COMBOS["b32-r3-g3x4"], **overrides)
    return Engine(target.loaded, config, drafter=drafter.loaded)


def drafting_pays_less_than_own_steps(monkeypatch) -> None:
    """Price forwards as drafting_could_pay does, but the drafter's at 0.2 s and 10 ms more a further token: one
    draft at the prior's acceptance does not pay for its verification, so the first step does not draft, and a
    drafter's prefill (sinks and two windows, 36 tokens) costs 0.55 s."""
    scales = {FullCache: 1.0, RetrievalCache: 0.5}
    monkeypatch.setattr(
        step_costs,
        "forward_seconds",
        lambda model, cache, tokens, balance: (
            0.2 + 0.01 * (tokens - 1)
            if isinstance(cache, StreamingCache)
            else scales[type(cache)] * (1.0 + 0.2 * (tokens - 1))
        ),
    )


@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("mode", ["streaming", "triforce"])
def test_a_drafter_is_prefilled_where_it_first_drafts(monkeypatch, mode, ngram):
    """Where drafting does not pay from the priors, the drafter's cache is prefilled only when a probe of it is
    due, with the sequence so far but its last token: in streaming mode after 48 own steps (its prefill, its draft
    and a verification of one draft lose 0.55 + 0.2 + 0.2, 2% of 47.5 plain steps); in triforce mode also where
    the retrieval tier first probes it. An answer shorter than that never prefills it; where drafting pays from
    the start, it is prefilled with the prompt, before the first token. With the n-gram before the drafter, the
    n-gram's drafts are probed from the first step all the same, the drafter's prefill waiting as without it.
    Greedy output equals plain decoding every time."""
    calls = recorded_set_ups(monkeypatch)
    drafting_pays_less_than_own_steps(monkeypatch)
    asked = []  # the sequence's length wherever the n-gram was asked to draft
    ask = NGramProposer.propose
    monkeypatch.setattr(NGramProposer, "propose", lambda self, seq, n: asked.append(len(seq)) or ask(self, seq, n))
    verified = []  # drafts a verification judged
    verify = speculative.verify_draft
    monkeypatch.setattr(speculative, "verify_draft", lambda d, *args: verified.append(len(d)) or verify(d, *args))
    short = drafter_engine(mode, max_new_tokens=20, ngram=ngram)
    result = short.generate(prompt_for(0))
    assert result.token_ids == list(autoregressive_tokens(0))[:20]
    assert calls == [] and short._caches.streaming.length == 0
    if ngram and mode == "streaming":  # the first step probes the n-gram, which drafts without the drafter
        assert asked[0] == PROMPT_TOKENS + 1
    assert 0 not in verified  # where the n-gram found nothing, the tier took its own step: no verification of none
    assert drafter_engine(mode, ngram=ngram).generate(prompt_for(0)).token_ids == list(autoregressive_tokens(0))
    # triforce with the n-gram: the probes take turns with the retrieval tier, the n-gram's first one (at the
    # second turn) too early for the prefill, its next one past the answer's end
    assert len(calls) == (0 if ngram and mode == "triforce" else 1)
    assert all(PROMPT_TOKENS < n < PROMPT_TOKENS + NEW_TOKENS for n in calls)
    if mode == "streaming" and not ngram:
        assert calls == [PROMPT_TOKENS + 48]
    calls.clear()
    drafting_pays(monkeypatch)
    result = drafter_engine(mode, ngram=ngram).generate(prompt_for(0))
    assert result.token_ids == list(autoregressive_tokens(0)) and calls == [PROMPT_TOKENS]
    assert result.stats.acceptance[-1].verifications > 0


def test_greedy_with_ngram_and_costed_lengths_equals_autoregressive(monkeypatch):
    drafting_pays(monkeypatch)
    engine = Engine(rich_model(0).loaded, engine_config("triforce", ngram=True, gamma_policy="costed"))
    assert engine.generate(prompt_for(0)).token_ids == list(autoregressive_tokens(0))


def test_costed_retries_the_other_source_with_one_draft_while_drafting_pays():
    steps = feed_costed(costed(SLOPE, draft=0.01, shortcut=0.5), 40, accepts=lambda n, i: n)
    retries = [(i, n) for i, (n, shortcut) in enumerate(steps) if shortcut]
    assert [i for i, _ in retries] == list(range(SHORTCUT_RETRY - 1, 40, SHORTCUT_RETRY))
    assert all(n == 1 for _, n in retries) and all(n == 4 for n, shortcut in steps[4:] if not shortcut)


def retries_committing(length: SpeculationLength, rounds: int) -> list[tuple[int, int]]:
    """(verification, tokens committed before it) of each retry of the shortcut over `rounds` verifications whose
    drafts are all accepted, the shortcut's set-up running at its first drafts, as ModelTier says to the policy."""
    retries, committed = [], 0
    for i in range(rounds):
        n = length.current
        if length.use_shortcut:
            retries.append((i, committed))
            length.set_up_due = ()
        length.record(n, n, 0.0, 0.0)
        committed += n + 1
    assert length.tokens_taken == committed
    return retries


def test_costed_retries_a_source_with_a_set_up_due_once_the_tokens_so_far_pay_for_it():
    """Drafting from the proposer pays, every draft accepted; the shortcut, retried every SHORTCUT_RETRY-th
    verification, has a set-up of 0.6 plain steps due: with its draft (0.5) and a verification of one (1.2) for the
    token a plain step gives, 1.3, which is 2% of 65 tokens. No retry comes before the tier has committed 65
    tokens; then they come SHORTCUT_RETRY verifications apart, as for a shortcut with nothing to set up."""
    costs = StepCosts(SLOPE, proposer=0.01, shortcut=0.5, shortcut_set_up=0.6)
    priors = {False: DEFAULT_PRIOR, True: DEFAULT_PRIOR}
    length = SpeculationLength("costed", ceiling=4, own_steps=True, has_shortcut=True)
    length.price(costs, priors, set_up_due=(True,))
    assert length.current > 0 and not length.use_shortcut  # drafting pays from the prior, from the proposer
    retries = retries_committing(length, 40)
    assert len(retries) >= 2 and retries[0][1] >= 65
    assert retries[1][0] - retries[0][0] == SHORTCUT_RETRY
    free = SpeculationLength("costed", ceiling=4, own_steps=True, has_shortcut=True)
    free.price(costs, priors)  # nothing to set up: retried from the start
    assert [i for i, _ in retries_committing(free, 20)] == [SHORTCUT_RETRY - 1, 2 * SHORTCUT_RETRY - 1]


@pytest.mark.parametrize("pays", [False, True])
def test_pipeline_is_exact_under_the_costed_policy(monkeypatch, pays):
    """Seeded runs at temperature 1 under the default policy: as priced here (own steps at the top and middle
    tiers, probes), and priced so that every tier drafts; the first two tokens follow the target's distribution."""
    if pays:
        drafting_pays(monkeypatch)
    pairs = pipeline_pairs("triforce", PIPELINE_TRIALS, gamma_policy="auto")
    first, second = target_joint()
    assert joint_chi_square(pairs, first, second) > P_THRESHOLD


FREE_PRICES = StepCosts((1.0, 1.2, 1.4, 1.6, 1.8), proposer=0.0)  # a CPU's slope; the proposer's drafts free too


def test_free_drafts_taken_where_their_estimate_pays_and_probed_where_it_does_not():
    """Under costed, with plain steps chosen: free drafts whose estimate pays are verified at their best length
    (offered 4: all 4 at an acceptance near 1); with an estimate that does not pay, the first offer is a probe of
    one draft and the next are declined until the wait after a losing probe (4 offers) is spent."""
    costly = StepCosts(FREE_PRICES.forward, proposer=10.0)  # a proposer never worth drafting from: own steps
    length = SpeculationLength("costed", costly.ceiling, own_steps=True)
    length.price(costly, {False: 0.4})
    assert not length.drafting
    for _ in range(20):
        length.free_counts.record(4, 4)
    assert length.free_length(4) == 4 and length.free_length(2) == 2
    length.free_counts = AcceptanceCounts()
    for _ in range(20):
        length.free_counts.record(1, 0)
    assert length.free_length(3) == 1  # the probe: free_wait starts at one offer
    length.record_free(1, 0)
    assert [length.free_length(3) for _ in range(4)] == [0, 0, 0, 1] and length.free_wait == 4


def test_a_free_probe_is_judged_against_the_drafting_it_replaced():
    """While the tier drafts from its own source at a high rate, a probe of free drafts that beats plain steps but
    not that drafting has not paid: its wait doubles, so free probes do not crowd out the better rounds."""
    length = SpeculationLength("costed", FREE_PRICES.ceiling, own_steps=True)
    length.price(FREE_PRICES, {False: 0.95})
    assert length.drafting
    for _ in range(20):
        length.free_counts.record(1, 0)
    assert length.free_length(1) == 1  # a probe
    length.record_free(1, 1)  # 2 tokens for 1.2 plain steps: more than plain steps give, less than 4 drafts at 0.95
    assert length.free_wait == 4
    length.free_bar = 1.0 / FREE_PRICES.own  # had plain steps been chosen, the same probe would have paid
    length.record_free(1, 1)
    assert length.free_wait == 1
