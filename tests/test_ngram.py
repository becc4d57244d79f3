"""The training-free n-gram proposer: what it proposes, how it follows a changing sequence, and exactness."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from helpers import full_cache_for, random_prompt, rich_model
from triforce_cli.cache import FullCache, StreamingCache

from triforce_cli.decoding import clock
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.sampling import SamplingConfig, probabilities
from triforce_cli.decoding.speculative import FallbackProposer, ModelTier, Proposal, Tier, TokenSequence


def test_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NGramProposer(vocab_size=100, max_ngram=3)
    #            0  1  2  3  4  5  6  7  8  9 10 11
    sequence = [7, 1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    assert proposer.continuation(sequence, 4) == [5, 1, 2, 3]  # the later of the two (1, 2, 3) matches wins


def test_falls_back_to_shorter_suffixes_and_to_nothing():
    proposer = NGramProposer(vocab_size=100, max_ngram=3)
    assert proposer.continuation([5, 6, 8, 6], 2) == [8, 6]  # only the 1-gram (6,) occurred before
    assert NGramProposer(vocab_size=100).continuation([1, 2, 3, 4], 3) == []
    assert NGramProposer(vocab_size=100, min_ngram=2).continuation([5, 6, 8, 6], 2) == []


def test_never_matches_the_suffix_itself():
    assert NGramProposer(vocab_size=10).continuation([3], 2) == []
    assert NGramProposer(vocab_size=10).continuation([4, 4], 3) == [4]


def test_follows_a_sequence_whose_tail_was_rolled_back():
    proposer = NGramProposer(vocab_size=100, max_ngram=2)
    assert proposer.continuation([1, 2, 3, 1, 2], 1) == [3]
    # the tail [1, 2] was rejected and replaced by [8, 9, 1]; the index must not keep (1, 2) -> 3 at position 3
    assert proposer.continuation([1, 2, 3, 8, 9, 1], 2) == [2, 3]
    assert proposer.continuation([1, 2, 3, 8, 9, 1, 8], 2) == [9, 1]


def latest_continuation_start(prefix: list[int], max_ngram: int, min_ngram: int = 1) -> int:
    """The proposer's answer by brute force: after the latest earlier occurrence, followed by a token, of the
    longest suffix of max_ngram..min_ngram tokens; len(prefix) where none occurred."""
    for size in range(min(max_ngram, len(prefix) - 1), min_ngram - 1, -1):
        suffix = prefix[-size:]
        for start in range(len(prefix) - size - 1, -1, -1):
            if prefix[start : start + size] == suffix:
                return start + size
    return len(prefix)


@pytest.mark.parametrize("vocab_size, max_ngram", [(7, 3), (49152, 3), (49152, 5)])  # (49152, 5): codes past 64 bits
def test_a_long_prompt_indexed_in_bulk_answers_as_a_search_would(vocab_size, max_ngram):
    """A 2,000-token prompt (indexed in bulk where codes fit 64 bits, one by one where not), then a tail drafted,
    rolled back and drafted again: every continuation is the brute-force search's."""
    generator = torch.Generator().manual_seed(vocab_size + max_ngram)
    alphabet = torch.randint(0, vocab_size, (7,), generator=generator)  # few distinct tokens: many repeats
    prompt = alphabet[torch.randint(0, 7, (2000,), generator=generator)].tolist()
    proposer = NGramProposer(vocab_size=vocab_size, max_ngram=max_ngram)
    assert proposer._codes_fit == (max_ngram == 3)
    proposer.continuation_span(prompt)
    latest = {}  # every n-gram followed by a token -> its latest start, one by one
    for start in range(len(prompt)):
        for size in range(1, min(max_ngram, len(prompt) - 1 - start) + 1):
            latest[proposer._code(prompt[start : start + size])] = start
    assert proposer._starts == latest  # no stale entry for the lookup's scan to repair
    sequence = list(prompt)
    for step in range(60):
        assert proposer.continuation_span(sequence)[0] == latest_continuation_start(sequence, max_ngram), step
        if step % 7 == 6:
            del sequence[-3:]  # a rejected tail
        sequence.append(alphabet[step % 7].item())


def test_follows_the_sequence_it_drafts_for_as_it_is_truncated_and_appended_to():
    """The proposer reads the sequence's host list itself, which changes in place between its calls."""
    proposer = NGramProposer(vocab_size=100, max_ngram=2)
    sequence = TokenSequence.of([1, 2, 3, 1, 2], "cpu")
    assert proposer.propose(sequence, 1).tokens == [3]
    sequence.truncate(3)
    sequence.append(torch.tensor([8, 9, 1]), [8, 9, 1])
    assert proposer.propose(sequence, 2).tokens == [2, 3]
    sequence.append(torch.tensor([8]))  # known on the device alone: read once, for the lookup
    proposal = proposer.propose(sequence, 2)
    assert proposal.tokens == proposal.ids.tolist() == [9, 1]
    assert sequence.host == [1, 2, 3, 8, 9, 1, 8]


def test_proposal_is_one_hot_and_as_long_as_what_matched():
    proposal = NGramProposer(vocab_size=12).propose(TokenSequence.of([1, 2, 3, 1, 2], "cpu"), 5)
    assert proposal.tokens == proposal.ids.tolist() == [3, 1, 2]
    assert proposal.probs.shape == (3, 12)
    assert torch.equal(proposal.probs.argmax(dim=-1), torch.tensor([3, 1, 2]))
    assert torch.equal(proposal.probs.sum(dim=-1), torch.ones(3))
    assert proposal.origins == ["ngram"] * 3
    empty = NGramProposer(vocab_size=12).propose(TokenSequence.of([1, 2, 3], "cpu"), 5)
    assert empty.tokens == [] and empty.probs.shape == (0, 12)


def test_greedy_ngram_modes_equal_autoregressive_and_accept_drafts():
    model = rich_model(3)
    prompt = random_prompt(120, 32, seed=3) * 2  # a repeated prompt gives the proposer matches
    greedy = SamplingConfig(temperature=0)
    reference = Engine(model.loaded, EngineConfig(mode="autoregressive", max_new_tokens=60, sampling=greedy))
    expected = reference.generate(prompt).token_ids
    for mode in ("streaming", "triforce"):
        # fixed lengths: under throughput the clock decides how many drafts each tier asks for, and a tier drafts
        # no more than the tokens still wanted, so the n-gram's few drafts on random weights could all miss; every
        # match proposes (ngram_min_match 1): random weights rarely continue a repeat far enough for the gate
        config = EngineConfig(
            mode=mode,
            ngram=True,
            ngram_min_match=1,
            budget=64,
            chunk_size=8,
            max_new_tokens=60,
            sampling=greedy,
            gamma_policy="fixed",
        )
        engine = Engine(model.loaded, config)
        result = engine.generate(prompt)
        assert result.token_ids == expected
        ngram_stats = next(a for a in result.stats.acceptance if a.proposer == "ngram")
        assert ngram_stats.drafted > 0 and ngram_stats.accepted > 0


# --- the n-gram first, a model drafter where it finds nothing ------------------------------------------------------


class StubProposer:
    def __init__(self, name: str, tokens: list[int], vocab: int = 12):
        self.name, self.tokens, self.vocab = name, tokens, vocab
        self.calls: list[tuple[int, int]] = []
        self.rolled_back_to: int | None = None

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        self.calls.append((len(sequence), n))
        tokens = self.tokens[:n]
        probs = torch.full((len(tokens), self.vocab), 1 / self.vocab)
        return Proposal(torch.tensor(tokens, dtype=torch.long), probs, [self.name] * len(tokens), tokens)

    def rollback(self, length: int) -> None:
        self.rolled_back_to = length


def test_fallback_proposer_asks_the_model_only_where_the_first_finds_nothing():
    model = StubProposer("drafter", [7, 8, 9])
    found = FallbackProposer(StubProposer("ngram", [4, 5]), model)
    assert found.name == "ngram/drafter"
    assert found.propose(TokenSequence.of([1, 2, 3], "cpu"), 3).tokens == [4, 5]
    assert model.calls == []
    nothing = FallbackProposer(StubProposer("ngram", []), model)
    proposal = nothing.propose(TokenSequence.of([1, 2, 3], "cpu"), 2)
    assert (proposal.tokens, proposal.origins) == ([7, 8], ["drafter", "drafter"])
    assert model.calls == [(3, 2)]
    nothing.rollback(5)
    assert model.rolled_back_to == 5 and nothing.first.rolled_back_to == 5


def test_greedy_ngram_with_a_model_drafter_equals_autoregressive_and_uses_both():
    # The drafter has the target's weights, so its drafts pass; a vocabulary of 64 leaves the n-gram without a
    # match now and then (with 32 it nearly always finds one, and then the drafter is never asked).
    model, drafter = rich_model(3, vocab_size=64), rich_model(3, vocab_size=64, name="drafter")
    prompt = random_prompt(60, 64, seed=3) * 2
    greedy = SamplingConfig(temperature=0)
    reference = Engine(model.loaded, EngineConfig(mode="autoregressive", max_new_tokens=60, sampling=greedy))
    expected = reference.generate(prompt).token_ids
    for mode in ("streaming", "triforce"):
        # prefill_block 16 bounds the drafter's writes, so catching up after n-gram drafts takes several forwards
        config = EngineConfig(
            mode=mode, ngram=True, budget=64, chunk_size=8, max_new_tokens=60, prefill_block=16, sampling=greedy,
            gamma_policy="fixed",  # the throughput policy follows the clock: on a busy machine it may skip a tier
            ngram_min_match=1,  # every match proposes: random weights rarely continue a repeat far enough for the gate
        )  # fmt: skip
        engine = Engine(model.loaded, config, drafter=drafter.loaded)
        assert engine.drafter_description == "n-gram prompt lookup (training-free), else drafter"
        origins: list[str] = []
        result = engine.generate(prompt, on_tokens=lambda tokens, tiers, seen=origins: seen.extend(tiers))
        assert result.token_ids == expected
        assert {"ngram", "drafter"} <= set(origins), mode
        stats = next(a for a in result.stats.acceptance if a.proposer == "ngram/drafter")
        assert stats.accepted > 0


UNSCALED = SamplingConfig(temperature=1.0, top_p=1.0)


def tier_writing_at_most_4(model) -> ModelTier:
    """A tier whose StreamingLLM cache (4 sinks, a window of 64) takes at most 4 positions per forward."""
    cfg = model.config
    cache = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 64, 4, torch.float32)
    return ModelTier(
        name=Tier.DRAFTER, model=model, cache=cache, sampling=UNSCALED, generator=torch.Generator().manual_seed(0)
    )


def assert_matches_one_forward(model, ids: list[int], probs: torch.Tensor) -> None:
    """probs are the distributions after the last len(probs) tokens of ids, as one forward over ids gives them, on a
    float32 cache as the tier's (tier_writing_at_most_4)."""
    cfg = model.config
    cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 256, torch.float32)
    reference = model(torch.tensor(ids), 0, cache)[-len(probs) :]
    torch.testing.assert_close(probs, probabilities(reference, UNSCALED), atol=1e-5, rtol=1e-4)


def test_a_tier_catches_up_in_writes_its_cache_takes():
    model = rich_model(3).loaded.model
    ids = random_prompt(40, 32, seed=7)
    tier = tier_writing_at_most_4(model)
    tier.step(TokenSequence.of(ids[:10], "cpu"))  # 10 unseen tokens
    assert_matches_one_forward(model, ids, tier.step(TokenSequence.of(ids, "cpu")).probs)  # 30 more


def test_catching_up_leaves_room_for_the_drafts():
    model = rich_model(3).loaded.model
    ids = random_prompt(12, 32, seed=8)
    tier = tier_writing_at_most_4(model)
    tier.step(TokenSequence.of(ids[:7], "cpu"))
    # 3 unseen tokens and 2 drafts: more than one write of 4 takes, but the last prefix token stays with the drafts
    assert_matches_one_forward(model, ids, tier._forward(TokenSequence.of(ids[:10], "cpu"), torch.tensor(ids[10:12])))


def test_tokens_left_on_the_device_continue_the_sequence():
    """A drafter's own tokens stay on the device, unread: the sequence goes on with them, its host copy not."""
    model = rich_model(3).loaded.model
    ids = random_prompt(12, 32, seed=8)
    tier = tier_writing_at_most_4(model)
    sequence = TokenSequence.of(ids[:7], "cpu")
    tier.step(sequence)
    sequence.append(torch.tensor(ids[7:10]))  # known on the device alone
    assert len(sequence) == 10 and sequence.host == ids[:7]
    probs = tier._forward(sequence, torch.tensor(ids[10:12]))
    assert_matches_one_forward(model, ids, probs)


def test_a_tier_drafts_no_more_than_the_tokens_still_wanted():
    """Asked for `wanted` tokens, a tier asks its proposer for at most the tokens still wanted less one (its own
    verification adds one), and for one last token samples its own forward: nothing is computed to be dropped."""
    model = rich_model(3).loaded.model
    ids = random_prompt(12, 32, seed=9)
    proposer = StubProposer("stub", [1, 2, 3, 4, 5, 6], vocab=32)
    generator = torch.Generator().manual_seed(0)
    tier = ModelTier(
        name=Tier.TARGET,
        model=model,
        cache=full_cache_for(model),
        sampling=UNSCALED,
        generator=generator,
        proposer=proposer,
        gamma=6,
    )
    for wanted in (1, 2, 3, 5, 8):
        tier.rollback(len(ids))
        proposer.calls.clear()
        assert len(tier.propose(TokenSequence.of(ids, "cpu"), wanted).tokens) == wanted
        for prefix_length, asked in proposer.calls:
            still_wanted = wanted - (prefix_length - len(ids))
            assert asked == min(6, still_wanted - 1) >= 1, (wanted, proposer.calls)
        assert wanted > 1 or proposer.calls == []


def test_by_default_the_ngram_goes_first_only_where_a_model_drafter_can_follow():
    target, drafter = rich_model(3, vocab_size=64), rich_model(4, vocab_size=64, name="drafter")
    ngram = "n-gram prompt lookup (training-free)"
    self_speculation = f"{target.loaded.name} itself on a StreamingLLM cache (self-speculation: no distilled drafter)"
    cases = [  # (mode, ngram setting, drafter given) -> (n-gram drafts, a model drafts, description)
        ("triforce", None, True, True, True, f"{ngram}, else drafter"),
        ("streaming", None, True, True, True, f"{ngram}, else drafter"),
        ("triforce", None, False, False, True, self_speculation),  # --draft self: the target drafts, as asked
        ("triforce", False, True, False, True, "drafter"),
        ("triforce", True, False, True, False, ngram),  # --draft self --ngram: the n-gram alone
        ("retrieval", None, True, False, False, None),
        ("autoregressive", None, True, False, False, None),
    ]
    for mode, setting, with_drafter, uses_ngram, uses_model, description in cases:
        engine = Engine(target.loaded, EngineConfig(mode=mode, ngram=setting), drafter.loaded if with_drafter else None)
        case = (mode, setting, with_drafter)
        assert (engine.uses_ngram, engine.uses_model_drafter) == (uses_ngram, uses_model), case
        assert engine.drafter_description == description, case


# --- own steps: the top tier drops drafting that does not pay ------------------------------------------------------


class ScriptedProposer:
    """Drafts the next tokens of a fixed script (where it is right, every draft passes), else a token that is not
    the greedy continuation (every draft fails): one-hot draft distributions."""

    name = "scripted"

    def __init__(self, script: list[int], right: bool, vocab: int = 32):
        self.script, self.right, self.vocab = script, right, vocab

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        ahead = self.script[len(sequence) : len(sequence) + n]
        tokens = ahead if self.right else [(t + 1) % self.vocab for t in ahead]
        ids = torch.tensor(tokens, dtype=torch.long)
        return Proposal(ids, torch.eye(self.vocab)[ids], [self.name] * len(tokens), tokens)

    def rollback(self, length: int) -> None:
        pass


def generate_with_top_tier(model, prompt: list[int], proposer, new_tokens: int) -> tuple[list[int], ModelTier]:
    """Greedy tokens of a top tier (throughput policy, own steps allowed) over proposer's drafts."""
    tier = ModelTier(
        name=Tier.TARGET,
        model=model,
        cache=full_cache_for(model),
        sampling=SamplingConfig(temperature=0),
        generator=None,
        proposer=proposer,
        gamma=3,
        gamma_policy="throughput",
        own_steps=True,
    )
    sequence = TokenSequence.of(prompt, "cpu")
    while len(sequence) < len(prompt) + new_tokens:
        verified = tier.step(sequence, limit=len(prompt) + new_tokens - len(sequence))
        sequence.append(verified.ids, verified.tokens)
    return sequence.host[len(prompt) :], tier


@pytest.fixture
def ticking_clock(monkeypatch):
    """The tiers' clock reads one millisecond more at every mark: a round costs its marks, not the machine's load,
    so the throughput policy decides the same way on a busy machine (a drafting round takes two marks for up to
    four tokens, an own step one mark for one token)."""
    ticks = itertools.count()
    monkeypatch.setattr(clock, "time", SimpleNamespace(perf_counter=lambda: next(ticks) / 1000))


@pytest.mark.usefixtures("ticking_clock")
def test_drafts_that_never_pass_are_dropped_for_own_steps_and_the_output_stays_greedy():
    model = rich_model(5).loaded
    prompt = random_prompt(24, 32, seed=5)
    reference = Engine(
        model, EngineConfig(mode="autoregressive", max_new_tokens=80, sampling=SamplingConfig(temperature=0))
    )
    expected = reference.generate(prompt).token_ids
    script = prompt + expected
    tokens, tier = generate_with_top_tier(model.model, prompt, ScriptedProposer(script, right=False), 60)
    assert tokens == expected[:60]
    costs = tier.costs()
    assert costs.drops >= 1 and costs.own_steps > 30 and "drafting dropped" in costs.note

    tokens, tier = generate_with_top_tier(model.model, prompt, ScriptedProposer(script, right=True), 60)
    assert tokens == expected[:60]
    assert tier.costs().own_steps <= 1 and tier.costs().note is None  # one own step measures it; drafting stays


def test_min_match_proposes_only_after_long_matches_and_no_further_than_they_go():
    """min_match 3: a match of 2 tokens proposes nothing; one of 4 tokens (3 looked up, 1 more found going back)
    proposes at most 4 - 3 + 1 = 2 tokens, whatever is asked; min_match 1 proposes as before."""
    gated = NGramProposer(vocab_size=100, max_ngram=3, min_match=3)
    assert gated.continuation([1, 2, 7, 8, 9, 5, 2, 7], 4) == []  # "2 7" matched, "1 2 7" did not
    sequence = [5, 1, 2, 3, 7, 8, 9, 10, 11, 6, 1, 2, 3]  # "1 2 3" looked up; "5 1 2 3" against "6 1 2 3": 3
    assert gated.continuation(sequence, 4) == [7]
    longer = [5, 1, 2, 3, 7, 8, 9, 10, 11, 5, 1, 2, 3]  # the occurrence ends alike in 4 tokens
    assert gated.continuation(longer, 4) == [7, 8]
    assert NGramProposer(vocab_size=100, max_ngram=3).continuation(longer, 4) == [7, 8, 9, 10]
    proposal = gated.propose(TokenSequence.of(longer, "cpu"), 4)
    assert proposal.tokens == [7, 8] and proposal.probs.shape == (2, 100)
