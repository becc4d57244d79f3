"""Pure sampling and speculative-acceptance functions.

Speculative sampling (Leviathan et al., 2023, arXiv 2211.17192; Chen et al., 2023, arXiv 2302.01318): accept a
draft token x with probability min(1, p(x)/q(x)); at the first rejection sample from norm(max(p - q, 0)); when
every draft is accepted sample a bonus token from p. Temperature, top-k, min-p and top-p shape p and q identically, and
temperature 0 turns both into one-hot argmax distributions, so greedy decoding runs through the same code.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from triforce_cli.kernels.sampling import sample_rows, sampling_kernels_available, sampling_probabilities

NUCLEUS_PROBE = 64  # tokens ranked first when looking for a top-p nucleus; see nucleus


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.6
    top_p: float = 0.9
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0  # tokens less likely than min_p times the likeliest one are dropped; 0 keeps every token
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Sampling distribution (N, V) in float32 for logits (N, V): on the CPU by the extension in one call a row
    (kernels.sampling), elsewhere by the torch ops below, its reference."""
    logits = logits.float()
    if cfg.greedy:  # one-hot argmax by a scatter: F.one_hot reads its indices' range back on a CPU
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if sampling_kernels_available(logits):
        return sampling_probabilities(logits, cfg.temperature, cfg.top_k, cfg.min_p, cfg.top_p)
    return probabilities_reference(logits, cfg)


def probabilities_reference(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """probabilities' torch ops for float32 logits (N, V) at a temperature above 0."""
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if cfg.min_p > 0:
        floor = cfg.min_p * probs.amax(dim=-1, keepdim=True)  # (N, 1)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if cfg.top_p < 1.0:
        probs = nucleus(probs, cfg.top_p)
    return probs


def nucleus(probs: torch.Tensor, top_p: float, probe: int | None = None) -> torch.Tensor:
    """probs (N, V) kept on each row's top-p nucleus and renormalised, in probs' own buffer (it is overwritten).

    A token stays when the tokens ranked above it hold less than top_p of the mass, so the top token always stays.
    On a CPU the ranking comes from top-k with k grown eightfold from NUCLEUS_PROBE until every row's nucleus ends
    inside it: a top-k of a few dozen costs a small fraction of sorting a whole vocabulary (see
    docs/performance.md). Each growth check reads the device, so on a GPU (or with probe = V) the whole vocabulary
    is ranked at once instead.
    """
    vocab = probs.shape[-1]
    k = min(probe or (vocab if probs.is_cuda else NUCLEUS_PROBE), vocab)
    while True:
        ranked, order = probs.topk(k, dim=-1)  # (N, k), descending
        mass_before = ranked.cumsum(dim=-1) - ranked
        if k == vocab or bool((mass_before[:, -1] >= top_p).all()):
            break
        k = vocab if k * 8 > vocab // 8 else k * 8  # a nucleus of thousands: rank the whole vocabulary at once
    outside = mass_before >= top_p
    outside[:, 0] = False  # the top token stays, however small top_p is
    kept = ranked.masked_fill(outside, 0.0)
    probs = probs.zero_().scatter_(-1, order, kept)  # probs' own buffer: its values are in `ranked` now
    return probs.div_(probs.sum(dim=-1, keepdim=True))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (N, V) -> (N,), by inverting each row's cumulative distribution.

    A cumulative sum and a binary search take a tenth of torch.multinomial's time on a CPU (see
    docs/performance.md). The sums run in float64 so that even tokens of tiny probability keep their share. On the
    CPU the extension walks each row once (kernels.sampling), the same draw.
    """
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    if sampling_kernels_available(probs):
        return sample_rows(probs, uniform)
    cumulative = probs.cumsum(dim=-1, dtype=torch.float64)  # (N, V)
    tokens = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True)[:, 0]
    return tokens.clamp_max(probs.shape[-1] - 1)


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading draft tokens kept
    next_token: int  # the correction after a rejection, or the bonus token
    drafts: tuple[int, ...] = field(default=(), compare=False)  # the accepted drafts, read with the two above
    ids: torch.Tensor | None = field(default=None, compare=False, repr=False)  # (accepted + 1,) tokens on the device

    @property
    def tokens(self) -> list[int]:
        """What the verification commits: the accepted drafts, then the next token (ids, on the host)."""
        return [*self.drafts[: self.accepted], self.next_token]


def verify_draft(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    """Speculative sampling of n draft tokens (n,) drawn from draft_probs (n, V) against target_probs (n+1, V):
    on the host where the distributions are (verify_on_host), else on their device (verify_on_device). Both draw
    the same random numbers in the same order and take the same decisions from them.

    agree: applied to the outcome (n+2,: how many were accepted, then the committed tokens) before it is read;
    under tensor parallelism, parallel.from_rank_zero, so that every rank goes on with rank 0's.
    """
    verify = verify_on_host if target_probs.device.type == "cpu" else verify_on_device
    return verify(draft_tokens, draft_probs, target_probs, generator, agree)


def verify_on_host(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    """verify_draft where reading a tensor costs nothing (the CPU): the acceptance is read first, so that only the
    row the next token comes from is touched: the normalised residual max(p - q, 0) at the first rejection, or p
    (normalised) after every draft accepted, p itself where the residual is zero everywhere: the device path's
    values, bit for bit."""
    n = draft_tokens.shape[0]
    rows = torch.arange(n)
    uniform = torch.rand(n, generator=generator, device=draft_tokens.device)
    p_x, q_x = target_probs[rows, draft_tokens], draft_probs[rows, draft_tokens]
    accepted = int((uniform * q_x < p_x).int().cumprod(dim=0).sum())
    after_accepted = target_probs[accepted]  # (V,)
    # q is 0 after the last draft: the residual is p there
    residual = after_accepted - draft_probs[accepted] if accepted < n else after_accepted.clone()
    total = residual.clamp_min_(0.0).sum()
    next_probs = after_accepted
    if bool(total > 0):
        next_probs = residual.div_(total.clamp_min(torch.finfo(residual.dtype).tiny))
    next_token = int(sample(next_probs[None], generator)[0])
    outcome = torch.full((n + 2,), next_token, dtype=torch.long, device=draft_tokens.device)  # (n+2,)
    outcome[0] = accepted
    outcome[1 : accepted + 1] = draft_tokens[:accepted]
    return _read_outcome(outcome, agree)


def verify_on_device(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Verdict:
    """verify_draft with everything on the device until one read at the end: how many were accepted and the tokens
    committed (the accepted drafts, which a drafter on the device has not read, and the next token), so a
    verification on a GPU waits for the device once. The committed tokens stay on the device too (Verdict.ids),
    for the sequence to go on with, never copied back from the host."""
    n = draft_tokens.shape[0]
    positions = torch.arange(n + 1, device=draft_tokens.device)
    rows = positions[:n]
    # 1. Accept x with probability min(1, p(x)/q(x)), written as u*q(x) < p(x) with u ~ U[0, 1).
    p_x = target_probs[rows, draft_tokens]
    q_x = draft_probs[rows, draft_tokens]
    uniform = torch.rand(n, generator=generator, device=draft_tokens.device)
    accepted = (uniform * q_x < p_x).int().cumprod(dim=0).sum()  # () on the device
    # 2. Where the first rejection falls, the next token comes from the normalised residual max(p - q, 0) (from p
    #    where p and q agree); where all are accepted, the bonus token comes from p at position n.
    after_drafts = target_probs.new_zeros((1, target_probs.shape[-1]))  # q is 0 after the last draft (or none)
    draft_rows = torch.cat([draft_probs, after_drafts])  # (n+1, V)
    at = accepted.reshape(1)  # rows picked by index_select: indexing with a 0-d tensor reads it to the host
    after_accepted = target_probs.index_select(0, at)[0]  # (V,)
    residual = (after_accepted - draft_rows.index_select(0, at)[0]).clamp_min(0.0)  # (V,)
    total = residual.sum()
    next_probs = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), after_accepted)
    next_token = sample(next_probs[None], generator)[0]
    # 3. The committed tokens: the drafts before position `accepted`, the next token from there on (n+1,).
    committed = torch.where(positions < accepted, torch.cat([draft_tokens, next_token[None]]), next_token)
    outcome = torch.cat([accepted.long()[None], committed])  # (n+2,)
    return _read_outcome(outcome, agree)


def _read_outcome(outcome: torch.Tensor, agree: Callable[[torch.Tensor], torch.Tensor] | None) -> Verdict:
    """The verdict of a verification's outcome (n+2,): how many drafts were accepted, then the committed tokens
    (the accepted drafts, then the next token repeated to the end), agreed on first where agree is given."""
    if agree is not None:
        outcome = agree(outcome)
    accepted_count, *tokens = outcome.tolist()  # the one read of the device
    tokens = tokens[: accepted_count + 1]
    return Verdict(accepted_count, tokens[-1], tuple(tokens[:-1]), outcome[1 : accepted_count + 2])


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Chance (N,) that speculative sampling accepts a token drawn from draft_probs (N, V): sum_x min(p, q)."""
    return torch.minimum(target_probs, draft_probs).sum(dim=-1)
