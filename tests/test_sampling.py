"""Sampling distributions and speculative acceptance, with stub distributions and a chi-square exactness test."""

import numpy as np
import pytest
import torch
from helpers import wrong_verify_draft

from triforce_cli.decoding import sampling as sampling_module
from triforce_cli.decoding.sampling import (
    SamplingConfig,
    Verdict,
    nucleus,
    probabilities,
    sample,
    verify_draft,
    verify_on_device,
    verify_on_host,
)

P_THRESHOLD = 1e-3


@pytest.fixture(autouse=True, params=["extension", "torch ops"])
def sampling_ops(request, monkeypatch):
    """Every test here on both of decoding.sampling's ways: the CPU extension's (kernels.sampling, where it is
    loaded) and the torch ops, which CUDA runs."""
    if request.param == "torch ops":
        monkeypatch.setattr(sampling_module, "sampling_kernels_available", lambda x: False)
    return request.param


# --- probabilities ---------------------------------------------------------------------------------------------


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 4.0, 3.0, 2.0], [-3.0, -2.0, -1.0, -1.5]])
    probs = probabilities(logits, SamplingConfig(temperature=0))
    assert probs.dtype == torch.float32
    assert torch.equal(probs, torch.eye(4)[[1, 0, 2]])


def test_temperature_scales_logits():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0]])
    for temperature in (0.5, 1.0, 2.0):
        probs = probabilities(logits, SamplingConfig(temperature=temperature, top_p=1.0))
        torch.testing.assert_close(probs, (logits / temperature).softmax(dim=-1))
    sharp = probabilities(logits, SamplingConfig(temperature=0.25, top_p=1.0))
    flat = probabilities(logits, SamplingConfig(temperature=4.0, top_p=1.0))
    assert sharp.max() > flat.max()


def test_top_k_keeps_k_best():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=1.0, top_k=2))
    assert (probs > 0).sum(dim=-1).tolist() == [2, 2]
    expected0 = torch.zeros(5)
    expected0[[2, 4]] = torch.tensor([2.0, 1.0]).softmax(dim=0)
    torch.testing.assert_close(probs[0], expected0)
    assert probs[1, :2].sum().item() == pytest.approx(1.0)
    # top_k >= vocab keeps everything
    full = probabilities(logits, SamplingConfig(temperature=1.0, top_p=1.0, top_k=5))
    torch.testing.assert_close(full, logits.softmax(dim=-1))


def test_min_p_drops_tokens_below_a_share_of_the_likeliest():
    logits = torch.tensor([[0.0, -1.0, 2.0, -3.0, 1.0]])
    plain = logits.softmax(dim=-1)
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=1.0, min_p=0.3))
    kept = plain[0] >= 0.3 * plain.max()  # tokens 2 and 4: e^-1 of the likeliest is 0.37
    assert kept.tolist() == [False, False, True, False, True]
    torch.testing.assert_close(probs[0], torch.where(kept, plain[0], 0) / plain[0][kept].sum())
    torch.testing.assert_close(probabilities(logits, SamplingConfig(temperature=1.0, top_p=1.0, min_p=0.0)), plain)


def test_top_p_keeps_the_minimal_nucleus():
    base = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5 (1), 0.3 (3), 0.15 (2), 0.05 (0)
    logits = base.log()[None]
    cases = {0.4: {1}, 0.75: {1, 3}, 0.9: {1, 3, 2}, 0.99: {0, 1, 2, 3}, 1e-6: {1}}
    for top_p, kept in cases.items():
        probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=top_p))[0]
        assert set(torch.nonzero(probs).flatten().tolist()) == kept, top_p
        expected = torch.zeros(4)
        idx = sorted(kept)
        expected[idx] = base[idx] / base[idx].sum()
        torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize(
    "vocab, scale",
    [(12, 2.0), (5000, 0.5)],  # 5000 flat tokens: nuclei of thousands, beyond the first top-k probes
)
def test_top_p_random_rows_are_minimal_and_sufficient(vocab, scale):
    g = torch.Generator().manual_seed(0)
    logits = scale * torch.randn(50, vocab, generator=g)
    full = logits.softmax(dim=-1)
    for top_p in (0.3, 0.6, 0.9):
        probs = probabilities(logits, SamplingConfig(temperature=1.0, top_p=top_p))
        for row in range(50):
            kept = probs[row] > 0
            mass = full[row][kept].sum().item()
            smallest = full[row][kept].min().item()
            assert mass >= top_p - 1e-6  # enough mass
            assert mass - smallest < top_p + 1e-6  # and no token more than needed
            assert kept[full[row].argmax()]  # the top token always stays
            # kept tokens are the most likely ones
            assert full[row][~kept].max().item() <= smallest if (~kept).any() else True
            torch.testing.assert_close(probs[row][kept], full[row][kept] / mass)


def test_top_k_then_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.7))
    top3 = torch.tensor([4.0, 3.0, 2.0]).softmax(dim=0)  # 0.665, 0.245, 0.09: top-p 0.7 keeps two
    expected = torch.zeros(5)
    expected[:2] = top3[:2] / top3[:2].sum()
    torch.testing.assert_close(probs[0], expected)


def test_sample_follows_rows():
    g = torch.Generator().manual_seed(0)
    probs = torch.eye(5)[[3, 0, 4]]
    assert sample(probs, g).tolist() == [3, 0, 4]


def test_sample_frequencies_follow_the_distribution():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    draws = sample(probs.expand(20_000, -1), g)
    counts = torch.bincount(draws, minlength=len(probs))
    assert counts[probs == 0].sum() == 0  # zero-probability tokens are never drawn
    support = probs > 0
    chisquare = pytest.importorskip("scipy.stats").chisquare  # the test extra
    assert chisquare(counts[support].numpy(), 20_000 * probs[support].numpy()).pvalue > P_THRESHOLD


# --- verify_draft with stub distributions ----------------------------------------------------------------------


def one_hot(*ids, vocab=5):
    return torch.eye(vocab)[list(ids)]


def test_never_accept_resamples_from_residual():
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.tensor([[0.7, 0.3, 0.0, 0.0, 0.0], [0.2] * 5])
    target_probs = torch.tensor([[0.0, 0.5, 0.2, 0.3, 0.0], [0.2] * 5, [0.2] * 5])
    seen = set()
    for _ in range(300):
        verdict = verify_draft(torch.tensor([0, 1]), draft_probs, target_probs, g)
        assert verdict.accepted == 0
        seen.add(verdict.next_token)
    # residual max(p - q, 0) = [0, 0.2, 0.2, 0.3, 0]: token 1 keeps some mass, 0 and 4 none
    assert seen == {1, 2, 3}


def test_always_accept_when_target_covers_draft():
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.tensor([[0.5, 0.5, 0, 0, 0], [0, 0.2, 0.8, 0, 0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    target_probs = torch.cat([draft_probs, one_hot(3)])
    target_probs[1] = torch.tensor([0, 0.1, 0.9, 0, 0])  # p(x) >= q(x) for the drafted token 2
    for _ in range(200):
        verdict = verify_draft(torch.tensor([1, 2, 4]), draft_probs, target_probs, g)
        assert verdict == Verdict(3, 3)  # all three accepted, bonus from p at position 3


def test_rejection_stops_acceptance_even_if_later_drafts_match():
    g = torch.Generator().manual_seed(0)
    draft_probs = one_hot(1, 2, 3)
    target_probs = one_hot(1, 4, 3, 0)  # position 1 disagrees, position 2 would agree
    for _ in range(50):
        assert verify_draft(torch.tensor([1, 2, 3]), draft_probs, target_probs, g) == Verdict(1, 4)


def test_greedy_acceptance_is_argmax_matching():
    g = torch.Generator().manual_seed(0)
    target = one_hot(2, 0, 4, 1)
    assert verify_draft(torch.tensor([2, 0, 4]), one_hot(2, 0, 4), target, g) == Verdict(3, 1)
    assert verify_draft(torch.tensor([3, 0, 4]), one_hot(3, 0, 4), target, g) == Verdict(0, 2)
    assert verify_draft(torch.tensor([2, 0, 3]), one_hot(2, 0, 3), target, g) == Verdict(2, 4)


def test_sometimes_accept_with_rate_p_over_q():
    g = torch.Generator().manual_seed(0)
    draft_probs = torch.tensor([[0.8, 0.2, 0.0, 0.0, 0.0]])
    target_probs = torch.tensor([[0.2, 0.2, 0.6, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 0.0]])
    trials = 4000
    verdicts = [verify_draft(torch.tensor([0]), draft_probs, target_probs, g) for _ in range(trials)]
    accepted = sum(v.accepted for v in verdicts)
    assert abs(accepted / trials - 0.25) < 0.03  # min(1, 0.2 / 0.8)
    assert {v.next_token for v in verdicts if v.accepted == 1} == {3}  # bonus
    assert {v.next_token for v in verdicts if v.accepted == 0} == {2}  # residual [0, 0, 0.6, 0, 0]


# --- statistical exactness -------------------------------------------------------------------------------------

VOCAB = 6
P = torch.tensor(
    [
        [0.05, 0.30, 0.10, 0.25, 0.20, 0.10],
        [0.40, 0.05, 0.05, 0.20, 0.10, 0.20],
        [0.10, 0.10, 0.50, 0.05, 0.15, 0.10],
    ]
)
Q = torch.tensor(
    [
        [0.50, 0.05, 0.30, 0.02, 0.03, 0.10],
        [0.05, 0.60, 0.20, 0.05, 0.05, 0.05],
    ]
)


def run_trials(verify, trials: int, seed: int, device: str = "cpu") -> list[list[int]]:
    """Emitted token sequences (accepted drafts + next token) for `trials` two-token drafts drawn from Q, verified
    on device."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.stack([torch.multinomial(Q[i], trials, replacement=True, generator=g) for i in range(2)], dim=1)
    verifying = torch.Generator(device=device).manual_seed(seed)
    q, p = Q.to(device), P.to(device)
    out = []
    for draft in drafts:
        verdict = verify(draft.to(device), q, p, verifying)
        out.append(draft[: verdict.accepted].tolist() + [verdict.next_token])
    return out


def chi_square_p(tokens: list[int], probs: torch.Tensor) -> float:
    observed = np.bincount(tokens, minlength=probs.shape[0]).astype(float)
    expected = probs.double().numpy() * len(tokens)
    expected *= observed.sum() / expected.sum()
    chisquare = pytest.importorskip("scipy.stats").chisquare  # the test extra
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module", params=[verify_on_host, verify_on_device], ids=["host", "device"])
def exact_trials(request):
    """verify_draft's two paths on the CPU: the host's (what a CPU runs) and the device's (what a GPU runs)."""
    return run_trials(request.param, 20000, seed=1234)


def test_host_and_device_verifications_agree_draw_for_draw():
    """The same generator state gives the same verdict on both paths: they draw the same numbers in the same order."""
    on_host, on_device = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for i in range(500):
        draft = torch.tensor([i % VOCAB, i // VOCAB % VOCAB])
        a, b = verify_on_host(draft, Q, P, on_host), verify_on_device(draft, Q, P, on_device)
        assert a == b and a.tokens == b.tokens and torch.equal(a.ids, b.ids)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_verify_draft_is_exact(exact_trials, position):
    """Token at each position (draft, residual resample or bonus) follows p exactly."""
    tokens = [seq[position] for seq in exact_trials if len(seq) > position]
    assert len(tokens) > 1000
    assert chi_square_p(tokens, P[position]) > P_THRESHOLD


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("position", [0, 1, 2])
def test_verify_draft_is_exact_on_a_gpu(position):
    tokens = [seq[position] for seq in run_trials(verify_draft, 20000, seed=1234, device="cuda") if len(seq) > position]
    assert chi_square_p(tokens, P[position]) > P_THRESHOLD


def test_acceptance_rate_matches_theory(exact_trials):
    """P(first draft accepted) = sum_x min(p(x), q(x))."""
    expected = torch.minimum(P[0], Q[0]).sum().item()
    rate = sum(len(seq) > 1 for seq in exact_trials) / len(exact_trials)
    assert abs(rate - expected) < 0.015


def test_chi_square_detects_resampling_from_p():
    """The same test rejects the inexact variant: the exactness test has power."""
    trials = run_trials(wrong_verify_draft, 20000, seed=1234)
    tokens = [seq[0] for seq in trials]
    assert chi_square_p(tokens, P[0]) < P_THRESHOLD


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_nucleus_ranks_the_same_at_once_as_by_growing_probes(top_p):
    """The GPU's one-pass ranking (no device read per probe) keeps exactly the CPU's nucleus."""
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(7)) * 3
    probs = logits.softmax(dim=-1)
    whole, probed = nucleus(probs.clone(), top_p, probe=5000), nucleus(probs.clone(), top_p)
    torch.testing.assert_close(whole, probed, rtol=0, atol=1e-7)


def test_no_draft_samples_the_next_token_from_the_target():
    target = torch.tensor([[0.0, 1.0, 0.0]])
    verdict = verify_draft(
        torch.zeros(0, dtype=torch.long), torch.zeros(0, 3), target, torch.Generator().manual_seed(0)
    )
    assert verdict == Verdict(0, 1)
