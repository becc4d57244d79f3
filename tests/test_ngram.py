"""The training-free n-gram proposer: what it proposes, how it follows a changing sequence, and exactness."""

import torch
from conftest import random_prompt, rich_model

from triforce_cli.config import EngineConfig
from triforce_cli.engine import Engine
from triforce_cli.ngram import NGramProposer
from triforce_cli.sampling import SamplingConfig


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


def test_proposal_is_one_hot_and_as_long_as_what_matched():
    proposal = NGramProposer(vocab_size=12).propose([1, 2, 3, 1, 2], 5)
    assert proposal.tokens == [3, 1, 2]
    assert proposal.probs.shape == (3, 12)
    assert torch.equal(proposal.probs.argmax(dim=-1), torch.tensor([3, 1, 2]))
    assert torch.equal(proposal.probs.sum(dim=-1), torch.ones(3))
    assert proposal.origins == ["ngram"] * 3
    empty = NGramProposer(vocab_size=12).propose([1, 2, 3], 5)
    assert empty.tokens == [] and empty.probs.shape == (0, 12)


def test_greedy_ngram_modes_equal_autoregressive_and_accept_drafts():
    model = rich_model(3)
    prompt = random_prompt(120, 32, seed=3) * 2  # a repeated prompt gives the proposer matches
    greedy = SamplingConfig(temperature=0)
    reference = Engine(model.loaded, EngineConfig(mode="autoregressive", max_new_tokens=60, sampling=greedy))
    expected = reference.generate(prompt).token_ids
    for mode in ("streaming", "triforce"):
        config = EngineConfig(mode=mode, ngram=True, budget=64, chunk_size=8, max_new_tokens=60, sampling=greedy)
        engine = Engine(model.loaded, config)
        result = engine.generate(prompt)
        assert result.token_ids == expected
        ngram_stats = next(a for a in result.stats.acceptance if a.proposer == "ngram")
        assert ngram_stats.drafted > 0 and ngram_stats.accepted > 0
