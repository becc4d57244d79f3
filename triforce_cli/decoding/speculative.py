"""Hierarchical speculative decoding as a composition of tiers.

A tier is a model reading one cache, optionally with a proposer below it. ``propose(prefix, n)`` returns n tokens
that continue ``prefix`` distributed exactly as the tier's own model-with-cache, together with that model's
probabilities for each of them, which the tier above uses as its draft distribution. With a proposer, a tier
produces its tokens by speculative sampling of the proposer's drafts (see sampling.py); without one it samples
autoregressively. Two tiers give classic speculative decoding, three give TriForce (Sun et al., 2024,
arXiv 2404.11912): drafter@StreamingLLM -> target@retrieval -> target@full.
"""

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from triforce_cli.cache import KVCache
from triforce_cli.decoding.clock import DeviceClock, Mark
from triforce_cli.decoding.sampling import SamplingConfig, probabilities, sample, verify_draft
from triforce_cli.decoding.speculation_length import SpeculationLength
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.parallel import from_rank_zero


@dataclass
class Proposal:
    """Tokens proposed to (or committed by) the tier above.

    A tier that samples its tokens itself (the drafter) leaves them on the device, unread: reading them would make
    the host wait for the device at every drafted token. A verifying tier knows its tokens on the host from its
    verification's one read, and so does the n-gram proposer.
    """

    tokens: list[int] | torch.Tensor  # host ids, or (n,) long ids on the device
    probs: torch.Tensor  # (n, V): the proposing tier's distribution at each token's position
    origins: list[str]  # name of the tier that sampled each token

    def __len__(self) -> int:
        return len(self.origins)

    def ids(self, device: torch.device) -> torch.Tensor:
        """The tokens as (n,) long ids on device."""
        if isinstance(self.tokens, torch.Tensor):
            return self.tokens.to(device)
        return torch.tensor(self.tokens, dtype=torch.long, device=device)  # host-to-device copy

    def host_tokens(self) -> list[int]:
        """The tokens on the host; tokens on the device are read (a wait for the device)."""
        return self.tokens.tolist() if isinstance(self.tokens, torch.Tensor) else list(self.tokens)


@dataclass
class AcceptanceStats:
    """How a tier's proposals fared with the tier above it."""

    proposer: str
    verifier: str
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    rejections: int = 0  # verifications that rejected a draft

    # the properties stats.as_record writes beside the counts
    DERIVED: ClassVar[tuple[str, ...]] = (
        "acceptance_rate",
        "judged_acceptance_rate",
        "mean_drafted",
        "mean_accepted_length",
    )

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def judged_acceptance_rate(self) -> float:
        """Accepted drafts among those the verifier decided on: the accepted ones and the rejected one. Drafts
        after a rejection are never decided on, so this, not acceptance_rate, estimates the per-draft acceptance
        (alpha of Leviathan et al., 2023) where a pass drafts more than one token."""
        judged = self.accepted + self.rejections
        return self.accepted / judged if judged else 0.0

    @property
    def mean_drafted(self) -> float:
        """Drafts per verification: gamma, or less on average under an adaptive policy or where the tier above
        wanted fewer tokens."""
        return self.drafted / self.verifications if self.verifications else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens gained per verification: accepted drafts plus the verifier's own token."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0


@dataclass
class TierCosts:
    """What a tier's speculation-length policy measured and decided in one generation."""

    tier: str
    step_ms: dict[int, float]  # a step's cost by drafts verified, latest running average; 0: an own step
    own_steps: int = 0  # steps where the tier drafted nothing and sampled itself (tiers below it dropped)
    drops: int = 0  # times the policy dropped drafting because own steps yielded more tokens per second

    DERIVED: ClassVar[tuple[str, ...]] = ("note",)  # written by stats.as_record beside the fields

    @property
    def note(self) -> str | None:
        """One line saying that drafting was dropped and why, or None where it never was."""
        if not self.drops:
            return None
        drafting = {n: ms for n, ms in self.step_ms.items() if n}
        costs = ", ".join(f"{n} drafts {ms:.1f} ms" for n, ms in sorted(drafting.items()))
        return (
            f"{self.tier}: drafting dropped {self.drops}x, {self.own_steps} steps without it: own steps"
            f" ({self.step_ms[0]:.1f} ms a token) yielded more tokens per second than verifying drafts ({costs})"
        )


class Proposer(Protocol):
    name: str

    def propose(self, prefix: list[int], n: int) -> Proposal: ...

    def rollback(self, length: int) -> None: ...


@dataclass
class FallbackProposer:
    """Drafts from ``first`` where it offers any token, else from ``fallback``, for the same tier above.

    The n-gram proposer costs microseconds but finds a continuation only where the text repeats itself; a model
    drafter costs a forward per token but always drafts. Which one drafts depends on the prefix alone, so the
    tier above still verifies exactly against the distribution the tokens were drawn from.
    """

    first: Proposer
    fallback: Proposer

    @property
    def name(self) -> str:
        return f"{self.first.name}/{self.fallback.name}"

    def propose(self, prefix: list[int], n: int) -> Proposal:
        proposal = self.first.propose(prefix, n)
        return proposal if len(proposal) else self.fallback.propose(prefix, n)

    def rollback(self, length: int) -> None:
        self.first.rollback(length)
        self.fallback.rollback(length)


@dataclass
class ModelTier:
    name: str
    model: Transformer
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator | None
    proposer: Proposer | None = None
    gamma: int = 1  # drafts asked per verification, fewer where fewer are wanted; the ceiling if adaptive
    gamma_policy: str = "fixed"  # see speculation_length.py
    shortcut: Proposer | None = None  # the proposer's own proposer, drafting here directly when that pays more
    own_steps: bool = False  # the policy may drop drafting for the tier's own steps (top tier, throughput policy)
    stats: AcceptanceStats | None = field(default=None)
    shortcut_stats: AcceptanceStats | None = field(default=None)
    length: SpeculationLength = field(init=False)
    clock: DeviceClock = field(init=False)  # times drafting and verification for the adaptive lengths
    last_end: Mark | None = field(init=False, default=None)  # where the previous step ended, with own_steps

    def __post_init__(self) -> None:
        self.clock = DeviceClock(self.model.inv_freq.device)
        if self.proposer is not None and self.stats is None:
            self.stats = AcceptanceStats(self.proposer.name, self.name)
        if self.shortcut is not None and self.shortcut_stats is None:
            self.shortcut_stats = AcceptanceStats(self.shortcut.name, self.name)
        self.length = SpeculationLength(
            self.gamma_policy,
            self.gamma,
            has_shortcut=self.shortcut is not None,
            own_steps=self.own_steps and self.proposer is not None and self.gamma_policy == "throughput",
        )

    @property
    def uses_shortcut_next(self) -> bool:
        """Whether the next verification drafts from the shortcut, leaving the proposer idle."""
        return self.shortcut is not None and self.length.use_shortcut

    @property
    def proposer_drafts_next(self) -> bool:
        """Whether the next step asks the proposer for drafts (not the shortcut, not an own step)."""
        return self.proposer is not None and self.length.drafting and not self.uses_shortcut_next

    def costs(self) -> TierCosts:
        """What this tier's policy measured and decided so far."""
        length = self.length
        step_ms = {n: round(1000 * seconds, 3) for n, seconds in sorted(length.verify_seconds.items())}
        return TierCosts(self.name, step_ms, length.own_steps_taken, length.dropped)

    def _round_start(self) -> Mark:
        """Where the step's timing starts: with own_steps, where the previous step ended, so that what the caller
        did in between (the retrieval cache's upkeep, handing tokens out) is a cost of the round; else now."""
        return self.last_end if self.own_steps and self.last_end is not None else self.clock.mark()

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)
        for proposer in (self.proposer, self.shortcut):
            if proposer is not None:
                proposer.rollback(length)

    def propose(self, prefix: list[int], n: int) -> Proposal:
        """n tokens after prefix, each step's tokens joining the sequence the next step continues: on the host
        while they are known there, else on the device, unread."""
        known = list(prefix)
        pending: list[torch.Tensor] = []  # ids on the device, after known
        probs: list[torch.Tensor] = []
        origins: list[str] = []
        while len(origins) < n:
            unread = torch.cat(pending) if pending else None
            step = self.step(known, limit=n - len(origins), pending=unread)
            if isinstance(step.tokens, torch.Tensor) or pending:
                pending.append(step.ids(self.model.inv_freq.device))
            else:
                known += step.tokens
            probs.append(step.probs)
            origins += step.origins
        tokens = known[len(prefix) :]
        if pending:  # ids (n,) on the device: the host-known ones first (never, in the tiers built here)
            head = torch.tensor(tokens, dtype=torch.long, device=pending[0].device)
            return Proposal(torch.cat([head, *pending]), torch.cat(probs), origins)
        return Proposal(tokens, torch.cat(probs), origins)  # each step returns at most the tokens still wanted

    def _forward(self, prefix: list[int], pending: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
        """Distributions (len(drafts) + 1, V) at the positions after the sequence's last token and after each draft;
        the sequence is prefix (host) followed by pending (ids on the device), drafts are (n,) ids on the device.

        Committed tokens the cache has not seen yet (drafted by a proposer beside this tier) are fed first, in
        writes no larger than the cache takes; the last token of the sequence always stays with the drafts. Under
        the throughput policy that catching up counts as drafting time of the tier it serves.
        """
        unread = 0 if pending is None else pending.shape[0]
        length = len(prefix) + unread
        start = min(self.cache.length, length - 1)
        self.cache.rollback(start)
        device = self.model.inv_freq.device
        step = self.cache.max_write
        while step is not None and length - start + len(drafts) > step and len(prefix) - 1 - start > 0:
            unseen = prefix[start : start + min(step, len(prefix) - 1 - start)]
            self.model(torch.tensor(unseen, dtype=torch.long, device=device), start, self.cache, num_logits=1)
            start += len(unseen)
        pieces = [drafts]
        if unread:
            pieces.insert(0, pending[max(0, start - len(prefix)) :])
        if start < len(prefix):
            pieces.insert(0, torch.tensor(prefix[start:], dtype=torch.long, device=device))  # host-to-device copy
        logits = self.model(torch.cat(pieces), start, self.cache, num_logits=len(drafts) + 1)
        return probabilities(logits, self.sampling)

    def step(self, prefix: list[int], limit: int | None = None, pending: torch.Tensor | None = None) -> Proposal:
        """The next tokens of this tier after prefix and pending (ids on the device, unread, after prefix): one
        sampled token, left on the device, or verified drafts plus one, read on the host.

        limit: the most tokens the caller will use. Drafts are asked for no more than limit - 1, since a
        verification adds a token of its own, and a limit of 1 samples from this tier's own forward, so no token
        is computed only to be thrown away.
        """
        device = self.model.inv_freq.device
        if self.proposer is None or limit == 1 or not self.length.drafting:
            chosen = self.proposer is not None and limit != 1  # an own step the policy chose: its cost is weighed
            started = self._round_start() if chosen else None
            probs = self._forward(prefix, pending, torch.empty(0, dtype=torch.long, device=device))
            token = from_rank_zero(sample(probs, self.generator))
            if chosen:  # the caller reads the token next: timing it waits for nothing more
                self.last_end = self.clock.mark()
                self.length.record_own_step(self.clock.seconds(started, self.last_end))
            return Proposal(token, probs, [self.name])  # (1,) on the device, unread
        if pending is not None:  # a verifying tier's own tokens are read; none is left pending before a draft
            prefix, pending = prefix + pending.tolist(), None
        started = self._round_start()
        proposer, stats = self.proposer, self.stats
        if self.uses_shortcut_next:
            proposer, stats = self.shortcut, self.shortcut_stats
        asked = self.length.current if limit is None else min(self.length.current, limit - 1)
        draft = proposer.propose(prefix, asked)
        drafted = self.clock.mark()
        draft_ids = draft.ids(device)
        probs = self._forward(prefix, None, draft_ids)  # (len(draft) + 1, V)
        verdict = verify_draft(draft_ids, draft.probs.to(device), probs, self.generator, from_rank_zero)  # one read
        verified = self.clock.mark()  # after that read, so the verification's work is done
        self.last_end = verified
        stats.drafted += len(draft)
        stats.accepted += verdict.accepted
        stats.verifications += 1
        stats.rejections += verdict.accepted < len(draft)
        seconds = self.clock.seconds(started, drafted), self.clock.seconds(drafted, verified)
        self.length.record(len(draft), verdict.accepted, *seconds)
        kept = len(prefix) + verdict.accepted
        self.rollback(kept)
        return Proposal(verdict.tokens, probs[: verdict.accepted + 1], draft.origins[: verdict.accepted] + [self.name])
