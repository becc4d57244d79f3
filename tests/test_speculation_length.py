"""Adaptive speculation lengths: the policies as pure functions, and the pipeline staying exact under them."""

import pytest
from conftest import rich_model
from test_speculative import (
    COMBOS,
    MIDDLE_TRIALS,
    P_THRESHOLD,
    TEMPERATURE_1,
    MiddleTier,
    autoregressive_tokens,
    engine_config,
    joint_chi_square,
    prompt_for,
)

from triforce_cli.config import EngineConfig
from triforce_cli.engine import Engine
from triforce_cli.errors import ConfigError
from triforce_cli.sampling import SamplingConfig
from triforce_cli.speculation_length import (
    SpeculationLength,
    expected_tokens,
    heuristic_length,
    throughput_length,
)


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


def test_fixed_policy_never_moves():
    length = SpeculationLength("fixed", ceiling=3)
    length.record(3, 0, 1.0, 1.0)
    assert length.current == 3


def test_auto_is_throughput_except_for_seeded_sampling():
    def resolved(policy="auto", **sampling):
        return EngineConfig(gamma_policy=policy, sampling=SamplingConfig(**sampling)).speculation_policy

    assert resolved(temperature=0.6) == "throughput"
    assert resolved(temperature=0.6, seed=3) == "fixed"  # a seeded sampled run must repeat exactly
    assert resolved(temperature=0, seed=3) == "throughput"  # greedy output does not depend on the lengths
    assert resolved("heuristic", temperature=0.6, seed=3) == "heuristic"


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
    for stats in result.stats.acceptance:
        # the length moved: below the ceiling on average, yet above 1
        assert 1 < stats.mean_drafted < ceilings[stats.verifier], stats


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
