"""Hierarchical speculative decoding as a composition of tiers.

A tier is a model reading one cache, optionally with a proposer below it. ``propose(sequence, n)`` returns n tokens
that continue ``sequence`` distributed exactly as the tier's own model-with-cache, together with that model's
probabilities for each of them, which the tier above uses as its draft distribution. With a proposer, a tier
produces its tokens by speculative sampling of the proposer's drafts (see sampling.py); without one it samples
autoregressively. Two tiers give classic speculative decoding, three give TriForce (Sun et al., 2024,
arXiv 2404.11912): drafter@StreamingLLM -> target@retrieval -> target@full.

The sequence lives on the device (TokenSequence), so a round copies no token from the host: drafts, samples and
verified tokens stay device tensors, and the host waits for the device once per verification, for its outcome.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol

import torch

from triforce_cli.cache import KVCache
from triforce_cli.decoding.clock import DeviceClock, Mark
from triforce_cli.decoding.sampling import SamplingConfig, probabilities, sample, verify_draft
from triforce_cli.decoding.speculation_length import SpeculationLength, StepCosts, prior_acceptance
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.parallel import from_rank_zero


class Tier(StrEnum):
    """What proposes or verifies tokens, as token origins and statistics name it."""

    DRAFTER = "drafter"  # a small model (or the target itself) on a StreamingLLM cache
    RETRIEVAL = "retrieval"  # the target on the retrieval cache: TriForce's middle tier
    TARGET = "target"  # the target on its full cache: every token comes out of it
    NGRAM = "ngram"  # prompt lookup, drafting without a model (ngram.py)


@dataclass
class TokenSequence:
    """The ids of a generation's sequence: on the device, in a buffer written in place as the sequence grows, and on
    the host as far as they are known there without a read.

    Tiers read the sequence from the device, so no token list crosses from the host while decoding: only the prompt,
    once. The host copy serves the n-gram proposer, which looks its drafts up there, and grows from what the
    verifications read anyway. The buffer past length is scratch: a tier's steps append their tokens while it
    proposes, and it truncates the sequence back before the tier above verifies them.
    """

    ids: torch.Tensor  # (capacity,) long on the device; the sequence is ids[:length]
    length: int
    host: list[int]  # ids[: len(host)] on the host, len(host) <= length: the ones known there without a read

    @classmethod
    def of(cls, tokens: list[int], device: torch.device | str, capacity: int = 0) -> "TokenSequence":
        """tokens (a prompt) copied to the device once, in a buffer of max(capacity, len(tokens)) ids."""
        ids = torch.empty(max(capacity, len(tokens)), dtype=torch.long, device=device)
        ids[: len(tokens)] = torch.tensor(tokens, dtype=torch.long)  # the one host-to-device copy
        return cls(ids, len(tokens), list(tokens))

    def __len__(self) -> int:
        return self.length

    def append(self, ids: torch.Tensor, host: list[int] | None = None) -> None:
        """Write ids (n,) on the device after the sequence (the buffer grown where they do not fit); host: the same
        ids on the host, where known there (a host copy lagging behind the device stays so)."""
        end = self.length + ids.shape[0]
        if end > self.ids.shape[0]:
            grown = self.ids.new_empty(max(end, 2 * self.ids.shape[0]))
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown
        self.ids[self.length : end] = ids
        if host is not None and len(self.host) == self.length:
            self.host += host
        self.length = end

    def learn(self, ids: list[int]) -> None:
        """ids, read from the device, are the next of the sequence after its host copy: the host copy grows by them
        where they are already in the sequence."""
        if len(self.host) + len(ids) <= self.length:
            self.host += ids

    def truncate(self, length: int) -> None:
        """Forget the ids from position length on."""
        self.length = length
        del self.host[length:]

    def host_ids(self) -> list[int]:
        """The sequence on the host (the list itself, appended to in place): the ids not known there are read from
        the device first (a wait for it)."""
        if len(self.host) < self.length:
            self.host += self.ids[len(self.host) : self.length].tolist()
        return self.host


@dataclass
class Proposal:
    """Tokens proposed to (or committed by) the tier above.

    The ids live on the device. A tier that samples its tokens itself (the drafter) leaves them unread there:
    reading them would make the host wait for the device at every drafted token. A verifying tier learns its tokens
    from its verification's one read, and the n-gram proposer finds them on the host: both keep that host copy.
    """

    ids: torch.Tensor  # (n,) long ids on the device
    probs: torch.Tensor  # (n, V): the proposing tier's distribution at each token's position
    origins: list[str]  # the tier that sampled each token (a Tier)
    host: list[int] | None = None  # the ids on the host, where they are known there without a read

    def __len__(self) -> int:
        return len(self.origins)

    @property
    def tokens(self) -> list[int]:
        """The ids on the host: the host copy, else read from the device (a wait for it)."""
        return self.host if self.host is not None else self.ids.tolist()


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
    # a step's cost by drafts verified, latest running average (throughput) or as priced (costed); 0: an own step
    step_ms: dict[int, float]
    own_steps: int = 0  # steps where the tier drafted nothing and sampled itself (tiers below it dropped)
    drops: int = 0  # times the policy dropped drafting because own steps yielded more tokens per second
    priced: bool = False  # step_ms are prices fixed before decoding (costed policy), not measured
    # costed: own steps before the first probe, where every source whose drafts could pay had a set-up to pay for
    # first (SpeculationLength.set_up_wait); 0 where a probe could come at once or no drafts could pay
    set_up_wait: int = 0

    DERIVED: ClassVar[tuple[str, ...]] = ("note",)  # written by stats.as_record beside the fields

    @property
    def note(self) -> str | None:
        """One line saying that drafting was dropped and why, or None where it never was."""
        if not self.drops:
            if self.priced and self.own_steps and self.set_up_wait:
                return (
                    f"{self.tier}: {self.own_steps} steps without drafting: a drafter whose drafts could pay is"
                    f" first probed after {self.set_up_wait} own steps, which pay for its prefill"
                )
            if self.priced and self.own_steps:
                own = f"own steps (priced {self.step_ms[0]:.1f} ms a token)"
                return (
                    f"{self.tier}: {self.own_steps} steps without drafting: {own} yield more tokens per second than"
                    " its proposer's drafts could, even with every draft accepted"
                )
            return None
        drafting = {n: ms for n, ms in self.step_ms.items() if n}
        costs = ", ".join(f"{n} drafts {ms:.1f} ms" for n, ms in sorted(drafting.items()))
        if self.priced:
            return (
                f"{self.tier}: drafting dropped {self.drops}x, {self.own_steps} steps without it: own steps (priced"
                f" {self.step_ms[0]:.1f} ms a token) promised more tokens per second, at the acceptance seen, than"
                f" verifying drafts ({costs})"
            )
        return (
            f"{self.tier}: drafting dropped {self.drops}x, {self.own_steps} steps without it: own steps"
            f" ({self.step_ms[0]:.1f} ms a token) yielded more tokens per second than verifying drafts ({costs})"
        )


class Proposer(Protocol):
    """What drafts for a tier: a tier below it, the n-gram lookup, or one of them falling back on the other."""

    name: str

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        """n tokens (fewer, or none, where it finds no more) to follow sequence, with their draft probabilities;
        the sequence is left as it was found."""
        ...

    def rollback(self, length: int) -> None:
        """The tier above finished a step and the sequence is now length tokens long: forget what lies past it."""
        ...


class Lookup(Proposer, Protocol):
    """A proposer whose drafts cost nothing to draft and are known on the host first (the n-gram lookup)."""

    def continuation(self, prefix: list[int], n: int) -> list[int]:
        """Up to n tokens it would propose after prefix (host ids), found without touching the device."""
        ...


@dataclass
class FallbackProposer:
    """Drafts from ``first`` where it offers any token, else from ``fallback``, for the same tier above.

    The n-gram proposer costs microseconds but finds a continuation only where the text repeats itself; a model
    drafter costs a forward per token but always drafts. Which one drafts depends on the sequence alone, so the
    tier above still verifies exactly against the distribution the tokens were drawn from.
    """

    first: Proposer
    fallback: Proposer

    @property
    def name(self) -> str:
        return f"{self.first.name}/{self.fallback.name}"

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        """The first's drafts, else the fallback's; none where the fallback's set-up is still to run (the tier
        above runs it once its policy lets it: ModelTier.step)."""
        proposal = self.first.propose(sequence, n)
        if len(proposal) or set_up_tier(self.fallback, next_step=False) is not None:
            return proposal
        return self.fallback.propose(sequence, n)

    def rollback(self, length: int) -> None:
        self.first.rollback(length)
        self.fallback.rollback(length)


@dataclass(kw_only=True)
class ModelTier:
    """A model reading one cache, drafted for by a proposer (or sampling alone, without one).

    TriForce is three of them, each the proposer of the one above (decoding.tiers.build_tiers):
    ``ModelTier(name=TARGET, cache=full, proposer=ModelTier(name=RETRIEVAL, cache=retrieval,
    proposer=ModelTier(name=DRAFTER, cache=streaming)))``. A round is the top tier's ``step``.
    """

    name: Tier
    model: Transformer
    cache: KVCache
    sampling: SamplingConfig
    generator: torch.Generator | None
    proposer: Proposer | None = None
    gamma: int = 1  # drafts asked per verification, fewer where fewer are wanted; the ceiling if adaptive
    gamma_policy: str = "fixed"  # see speculation_length.py
    shortcut: Proposer | None = None  # the proposer's own proposer, drafting here directly when that pays more
    # free drafts (the n-gram lookup) offered at every step, verified here directly where they pay (costed policy)
    lookup: Lookup | None = None
    # the policy may drop drafting for the tier's own steps: the top tier under throughput, every tier that has a
    # proposer under costed
    own_steps: bool = False
    # the retrieval tier: steps of the tier above between two selections of its chunks (EngineConfig.refresh_interval)
    refresh_interval: int | None = None
    # a drafter tier whose cache is filled where it first drafts: called once with the sequence's ids but its last
    # (and optionally a PrefillCallback), then dropped (Engine: the drafter's StreamingLLM prefill)
    set_up: Callable[..., None] | None = None
    stats: AcceptanceStats | None = None
    shortcut_stats: AcceptanceStats | None = None
    lookup_stats: AcceptanceStats | None = None
    length: SpeculationLength = field(init=False)
    clock: DeviceClock = field(init=False)  # times drafting and verification for the adaptive lengths
    last_end: Mark | None = field(init=False, default=None)  # where the previous step ended, with own_steps
    steps_since_selection: int = field(init=False, default=0)  # with refresh_interval

    def __post_init__(self) -> None:
        self.clock = DeviceClock(self.model.device)
        if self.proposer is not None and self.stats is None:
            self.stats = AcceptanceStats(self.proposer.name, self.name)
        if self.shortcut is not None and self.shortcut_stats is None:
            self.shortcut_stats = AcceptanceStats(self.shortcut.name, self.name)
        if self.lookup is not None and self.lookup_stats is None:
            self.lookup_stats = AcceptanceStats(self.lookup.name, self.name)
        self.length = SpeculationLength(
            self.gamma_policy,
            self.gamma,
            has_shortcut=self.shortcut is not None,
            own_steps=self.proposer is not None
            and (self.gamma_policy == "costed" or self.own_steps and self.gamma_policy == "throughput"),
        )

    def price(self, costs: StepCosts) -> None:
        """Give the costed policy this tier's costs (decoding/step_costs.py); its priors follow the sources'
        names."""
        priors = {False: prior_acceptance(self.proposer.name)}
        if self.shortcut is not None:
            priors[True] = prior_acceptance(self.shortcut.name)
        self.length.price(costs, priors, *self._set_up_due())

    def _set_up_due(self) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """The sources (True: the shortcut) whose drafts would first run a set-up (set_up_tier), and those of them
        that draft without it all the same (an n-gram before the drafter: FallbackProposer)."""
        sources = {False: self.proposer, True: self.shortcut}
        due = tuple(shortcut for shortcut, source in sources.items() if set_up_tier(source, next_step=False))
        return due, tuple(shortcut for shortcut in due if isinstance(sources[shortcut], FallbackProposer))

    def _note_set_up(self) -> None:
        """Tell the policy which sources' set-ups are still due (any tier may have run one since); a set-up once run
        stays run, so where none was due nothing is looked up."""
        length = self.length
        if length.set_up_due:
            length.set_up_due, length.drafts_before_set_up = self._set_up_due()

    def run_set_up(self, ids: list[int], *args) -> None:
        """Run this tier's set-up (set_up) on ids, the sequence but its last token, once."""
        set_up, self.set_up = self.set_up, None
        set_up(ids, *args)

    @property
    def uses_shortcut_next(self) -> bool:
        """Whether the next verification drafts from the shortcut, leaving the proposer idle."""
        return self.shortcut is not None and self.length.use_shortcut

    def costs(self) -> TierCosts:
        """What this tier's policy measured and decided so far."""
        length = self.length
        step_ms = {n: round(1000 * seconds, 3) for n, seconds in sorted(length.verify_seconds.items())}
        priced = length.costs is not None
        return TierCosts(self.name, step_ms, length.own_steps_taken, length.dropped, priced, length.set_up_wait)

    def step(self, sequence: TokenSequence, limit: int | None = None) -> Proposal:
        """One round of this tier after sequence: its next tokens, exactly distributed as its own model on its own
        cache. The sequence is left as it was found; the caller appends the tokens it keeps.

        With a proposer that drafts (speculative sampling, Leviathan et al., 2023):
          1. draft: the proposer proposes up to gamma tokens. For the top tier of TriForce the proposer is the
             retrieval tier, whose propose runs its own steps on the drafter's drafts;
          2. verify: one forward of this tier over the drafts, then speculative sampling (sampling.verify_draft)
             with one read of the device: the accepted drafts and one token of this tier's own, on the device and
             on the host;
          3. learn: the acceptance and the timings steer the next speculation length;
          4. roll back this tier's cache and every cache below it to the accepted length.
        Without one (or where it would not pay, or where the caller wants one token) it samples one token from its
        own forward, left on the device.

        limit: the most tokens the caller will use. Drafts are asked for no more than limit - 1, since a
        verification adds a token of its own, and a limit of 1 samples from this tier's own forward, so no token
        is computed only to be thrown away.
        """
        if self.lookup is not None and limit != 1:
            free = self._free_step(sequence, limit)
            if free is not None:
                return free
        if self.proposer is None or limit == 1 or not self.length.drafting:
            return self._own_step(sequence, chosen=self.proposer is not None and limit != 1)
        started = self._round_start()
        shortcut = self.uses_shortcut_next
        proposer, stats = (self.shortcut, self.shortcut_stats) if shortcut else (self.proposer, self.stats)
        # 1. draft (a set-up behind the n-gram runs first where the policy lets it; the drafter's own runs as it
        # drafts, ModelTier._forward)
        behind = set_up_tier(proposer, next_step=False)
        if isinstance(proposer, FallbackProposer) and behind is not None and self.length.may_set_up(shortcut):
            behind.run_set_up(sequence.host_ids()[: len(sequence) - 1])
        wanted = self.length.current if limit is None else min(self.length.current, limit - 1)
        draft = proposer.propose(sequence, wanted)
        if len(draft) == 0 and self.length.policy == "costed":
            # nothing to draft (an n-gram without a match, its drafter not set up): the token comes from the tier's
            # own forward, without a verification of nothing
            self.length.record_nothing_drafted()
            return self._own_step(sequence, chosen=False)
        drafted = self.clock.mark()
        # 2. verify, 4. roll back
        verdict, probs = self._verify(sequence, draft, stats)
        verified = self.last_end = self.clock.mark()  # after the verification's read: its work is done
        # 3. learn
        self._note_set_up()
        seconds = self.clock.seconds(started, drafted), self.clock.seconds(drafted, verified)
        self.length.record(len(draft), verdict.accepted, *seconds)
        return self._verified(draft, verdict, probs)

    def _free_step(self, sequence: TokenSequence, limit: int | None) -> Proposal | None:
        """A round on the lookup's drafts where it finds some and the policy verifies them (free_length); None
        otherwise, leaving the step to the tier's own choice. The drafts are verified here directly, the proposer
        idle; its cache catches up on the accepted tokens when it next drafts (_forward). Where the host has not
        read the sequence's last tokens yet (a round queued ahead of that read, rounds.decode on a GPU), no lookup:
        it would wait for the device."""
        if len(sequence.host) < len(sequence):
            return None
        ceiling = self.length.ceiling if limit is None else min(self.length.ceiling, limit - 1)
        take = self.length.free_length(len(self.lookup.continuation(sequence.host_ids(), ceiling)))
        if not take:
            return None
        draft = self.lookup.propose(sequence, take)
        verdict, probs = self._verify(sequence, draft, self.lookup_stats)
        self.last_end = self.clock.mark()
        self.length.record_free(len(draft), verdict.accepted)
        return self._verified(draft, verdict, probs)

    def _verify(self, sequence: TokenSequence, draft: Proposal, stats: AcceptanceStats):
        """One forward of this tier over draft's tokens after sequence, speculative sampling of them (with one read
        of the device), the outcome counted in stats, and this tier's cache and every one below rolled back to what
        was accepted. Returns (the verdict, this tier's distributions (len(draft) + 1, V))."""
        probs = self._forward(sequence, draft.ids)  # (len(draft) + 1, V)
        verdict = verify_draft(draft.ids, draft.probs.to(self.model.device), probs, self.generator, from_rank_zero)
        stats.drafted += len(draft)
        stats.accepted += verdict.accepted
        stats.verifications += 1
        stats.rejections += verdict.accepted < len(draft)
        kept = len(sequence) + verdict.accepted
        self.cache.rollback(kept)
        self._roll_back_proposers(kept)
        return verdict, probs

    def _verified(self, draft: Proposal, verdict, probs: torch.Tensor) -> Proposal:
        """The accepted drafts and this tier's own next token, as the round's proposal to the tier above."""
        origins = draft.origins[: verdict.accepted] + [self.name]
        return Proposal(verdict.ids, probs[: verdict.accepted + 1], origins, verdict.tokens)

    def _own_step(self, sequence: TokenSequence, chosen: bool) -> Proposal:
        """One token sampled from this tier's own forward, left on the device, unread. chosen: the policy chose it
        over drafting (not the caller's limit, nor a tier without a proposer), so its cost is weighed."""
        started = self._round_start() if chosen else None
        probs = self._forward(sequence, torch.empty(0, dtype=torch.long, device=self.model.device))
        token = from_rank_zero(sample(probs, self.generator))
        if chosen:  # the caller reads the token next: timing it waits for nothing more
            self.last_end = self.clock.mark()
            self._note_set_up()
            self.length.record_own_step(self.clock.seconds(started, self.last_end))
        self._roll_back_proposers(len(sequence) + 1)
        return Proposal(token, probs, [self.name])  # (1,) on the device, unread

    def propose(self, sequence: TokenSequence, n: int) -> Proposal:
        """n tokens after sequence from this tier's steps, each step's tokens appended to the sequence the next
        step continues, and truncated again at the end. The retrieval tier first brings its cache up to date
        (_refresh)."""
        if self.refresh_interval is not None:
            self._refresh()
        start, taken = len(sequence), 0
        steps: list[Proposal] = []
        while taken < n:
            tokens = self.step(sequence, limit=n - taken)
            sequence.append(tokens.ids, tokens.host)
            steps.append(tokens)
            taken += len(tokens)
        sequence.truncate(start)
        origins = [origin for tokens in steps for origin in tokens.origins]
        known = all(tokens.host is not None for tokens in steps)
        host = [token for tokens in steps for token in tokens.host] if known else None
        ids, probs = torch.cat([tokens.ids for tokens in steps]), torch.cat([tokens.probs for tokens in steps])
        return Proposal(ids, probs, origins, host)

    def rollback(self, length: int) -> None:
        """The tier above finished a step (Proposer.rollback): forget what lies past length here and below, and
        count the step towards the retrieval tier's next selection."""
        self.cache.rollback(length)
        self._roll_back_proposers(length)
        self.steps_since_selection += 1

    def _refresh(self) -> None:
        """The retrieval tier, before it drafts for a step of the tier above: choose its chunks again where
        refresh_interval steps went by since the last choice, else copy the positions verified since then."""
        if self.steps_since_selection >= self.refresh_interval:
            self.cache.select_chunks()
            self.steps_since_selection = 0
        else:
            self.cache.sync_recent()

    def _roll_back_proposers(self, length: int) -> None:
        for proposer in (self.proposer, self.shortcut, self.lookup):
            if proposer is not None:
                proposer.rollback(length)

    def _round_start(self) -> Mark:
        """Where the step's timing starts: with own_steps, where the previous step ended, so that what the caller
        did in between (handing tokens out) is a cost of the round; else now."""
        return self.last_end if self.own_steps and self.last_end is not None else self.clock.mark()

    def _forward(self, sequence: TokenSequence, drafts: torch.Tensor) -> torch.Tensor:
        """Distributions (len(drafts) + 1, V) at the positions after the sequence's last token and after each draft;
        drafts are (n,) ids on the device.

        Tokens of the sequence the cache has not seen yet (drafted by a proposer beside this tier) are fed first, in
        writes no larger than the cache takes; the last token of the sequence always stays with the drafts. Under
        the throughput policy that catching up counts as drafting time of the tier it serves.
        """
        length = len(sequence)
        if self.set_up is not None:
            self.run_set_up(sequence.host_ids()[: length - 1])
        start = min(self.cache.length, length - 1)
        self.cache.rollback(start)
        most = self.cache.max_write
        while most is not None and length - start + len(drafts) > most and length - 1 - start > 0:
            unseen = sequence.ids[start : start + min(most, length - 1 - start)]
            self.model(unseen, start, self.cache, num_logits=1)
            start += len(unseen)
        tokens = torch.cat([sequence.ids[start:length], drafts])
        logits = self.model(tokens, start, self.cache, num_logits=len(drafts) + 1)
        return probabilities(logits, self.sampling)


def set_up_tier(proposer: Proposer | None, next_step: bool = True) -> ModelTier | None:
    """The tier whose set-up (ModelTier.set_up) drafts from proposer would run first, or None.

    next_step: follow the tiers' current choices down (a tier that takes its own step next reaches no further, nor
    an n-gram whose tier does not let the set-up behind it run yet); False: only proposer itself, or the model
    behind an n-gram. Where the set-up may run, the n-gram is not counted on to draft: its lookup finds nothing
    where the text does not repeat.
    """
    if isinstance(proposer, FallbackProposer):
        return set_up_tier(proposer.fallback, next_step)
    if not isinstance(proposer, ModelTier):
        return None
    if proposer.set_up is not None:
        return proposer
    if not next_step or proposer.proposer is None or not proposer.length.drafting:
        return None
    shortcut = proposer.uses_shortcut_next
    source = proposer.shortcut if shortcut else proposer.proposer
    if isinstance(source, FallbackProposer) and not proposer.length.may_set_up(shortcut):
        return None  # the n-gram drafts alone until the policy lets the set-up behind it run
    return set_up_tier(source)
