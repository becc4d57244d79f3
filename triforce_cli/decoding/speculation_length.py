"""How many tokens a tier asks of its proposer per verification: fixed, or adapted after every verification.

The configured gamma is the ceiling in every policy (it also sizes the caches' headroom); adaptive policies move
between 1 and that ceiling. None of them changes what is generated, only how much is drafted. A tier drafting for
the tier above it asks for fewer where that tier wants fewer tokens (see ModelTier.step).

- ``fixed``: always gamma.
- ``heuristic``: the rule of transformers' assisted generation (``num_assistant_tokens_schedule="heuristic"``):
  two more after a verification that accepted every draft, one fewer otherwise.
- ``throughput``: the expected-tokens-per-second stride scheduler of RaLMSpec (Zhang et al., 2024,
  arXiv 2401.14021). With acceptance rate a per draft, a verification of s drafts yields
  (1 - a^(s+1)) / (1 - a) tokens (Leviathan et al., 2023) and costs s draft steps plus one verification; it picks
  the s with the highest rate. Acceptance and drafting cost are averages over this generation's drafts in which
  older verifications fade (see DraftSource); the verification cost is a running average kept per s, since
  verifying more tokens costs more on a CPU, so the first verifications try every s once, longest first. A tier
  whose caller wants fewer tokens drafts fewer (ModelTier.step); a length not measured yet is costed like the
  nearest measured one below it, so it is still tried where acceptance promises it pays. Its choices follow the
  clock, so a seeded sampled run may draft differently from one run to the next (the output distribution stays
  exact; greedy output is unchanged).

  A tier may also have a shortcut: its proposer's own proposer (the drafter under the retrieval tier). Under the
  throughput policy the tier then keeps acceptance and drafting cost for both sources, the verification cost by
  length being shared, and drafts from whichever promises more tokens per second: the middle tier of TriForce is
  skipped where verifying at it costs more than it saves (short contexts, where a retrieval forward costs most of
  a full one) and kept where it pays. The source not in use is tried again every SHORTCUT_RETRY verifications,
  so its averages follow the generation. Which source drafts depends only on what came before, so every
  verification stays exact.

  The top tier may also draft nothing (length 0, ``own_steps``): it then samples its own tokens, one forward each,
  which is plain decoding with every tier below dropped. Its measured costs are whole rounds (what the engine does
  between two verifications included), so length 0 wins wherever drafting, all overheads counted, yields fewer
  tokens per second than plain steps: speculation is never slower than decoding without it by more than what the
  policy spends finding that out. Drafting is retried after DRAFT_RETRY own steps, and after twice as many each
  time a retry loses (up to MAX_DRAFT_RETRY), so a stretch of text where drafts pay again is found; a retry
  judges drafting by its own drafts, not by averages from before the text moved on.
- ``costed`` (the default, ``auto``): the same expected-tokens-per-second choice, from costs known before the first
  step instead of timed as it goes. Throughput learns what a verification of s drafts costs by verifying s drafts,
  every s once, longest first: on a CPU, where 6 tokens cost about 2.3 forwards of 1, that exploration alone
  costs several plain steps, paid within the answer, and more where drafting does not pay. Here every tier's
  forwards are priced once, before decoding (StepCosts, from decoding/step_costs.py: a forward of n tokens on the
  tier's cache, predicted from the model, the cache and the machine's kept rates), and only the acceptance is
  learnt: per source, counts of judged and accepted drafts that forget by drafts (AcceptanceCounts), beside a
  prior (PRIOR_ACCEPTANCE: the retrieval tier, the target on part of its own cache, 0.85; a drafter or the n-gram
  proposer, DEFAULT_PRIOR) weighing PRIOR_DRAFTS drafts. The tier drafts with the source and length of the most
  expected tokens per second wherever that promises DRAFT_MARGIN times the rate of its own steps; every tier with
  a proposer may take own steps (the middle tier then samples from the retrieval cache, the drafter idle). Where
  own steps win, drafting is probed, at its best length (one draft, as a rule), at the first step and then after
  a wait of own steps, twice as long after each probe that did not pay for itself (up to MAX_PROBE_WAIT), and as
  short again after one that did. The shortest wait makes what a rejected probe loses (its draft, the source's
  choice of chunks where it has one, and a verification of one draft, against the own step it replaces) at most
  PROBE_SHARE of the own steps before it, and no shorter than PROBE_WAIT: on a 2-core CPU at 7K, where that
  verification costs 1.3 plain steps, 25 steps, so that where drafting never pays a 128-token answer holds three
  probes, about 2% of its time. With a shortcut the probes take turns between the two sources, the shortcut first.
  A source whose drafts would not pay even were every one accepted is never probed: no acceptance could make it
  pay. That is the retrieval tier where its forward costs most of a full one, at short contexts: on a 2-core CPU at
  7K its choice of chunks, made every refresh_interval verifications and priced as a share of each
  (StepCosts.round), leaves every draft accepted promising 0.96x the tokens a second of own steps, so the target
  takes its own steps from the first. A source with a set-up still to run (a drafter whose cache is
  prefilled only where it first drafts) is first probed once the own steps before the probe pay for that set-up
  too at PROBE_SHARE: at 7K on a 2-core CPU 1,100-1,200 steps, so that a short answer never prefills a drafter whose
  drafts would not have paid. An n-gram before such a drafter drafts without it, so it is probed as any source,
  the drafter behind it waiting the same; a probe that finds nothing to draft goes back to own steps. Where
  drafting pays from the priors (long contexts, whose full forwards cost most), the first step drafts, and a
  set-up runs with the prefill. With a shortcut, the source that promises less drafts one token every
  SHORTCUT_RETRY-th verification while drafting pays, so that its estimate follows the text; where its set-up is
  still due, only once the tokens the tier committed pay for it as the own steps before a probe would. (A tier not
  priced drafts its ceiling, as under fixed.)

  Free drafts (the n-gram lookup's, which cost nothing to draft) are offered to the top tier at every step where
  the lookup finds a continuation and the host has read the sequence so far (ModelTier.lookup; on a GPU a round
  queued ahead of a plain step's read, rounds.decode, is not offered them): the tier verifies the best number of them at their own
  estimated acceptance (AcceptanceCounts beside DEFAULT_PRIOR) wherever that promises DRAFT_MARGIN times the rate
  of own steps and no less than the tier's own choice for the step, whatever that choice (own steps, drafting, a
  wait before a probe). Where they do not pay, one of them is verified all the same at the first offer and then
  after a wait of offers, twice as long after each such probe that did not pay for itself (up to MAX_PROBE_WAIT),
  so that a stretch of text that repeats is found again.

  Every choice follows the prices, fixed before decoding, and the acceptance counts, never the clock, so a seeded
  sampled run repeats its tokens exactly from run to run and gets the same protection as any other. The prices
  are predicted rather than timed after the prefill: timed forwards would price more closely, but differently in
  every run (rounding them coarsely would still flip a choice wherever a cost lies near a boundary), and timing
  every length would cost more than a short answer can lose. The prediction errs towards verification costing
  more, so towards plain steps (step_costs.py says by how much).
"""

import math
from dataclasses import dataclass, field
from enum import StrEnum


class GammaPolicy(StrEnum):
    """How speculation lengths are chosen (EngineConfig.gamma_policy)."""

    AUTO = "auto"  # costed, seeded or not (EngineConfig.speculation_policy)
    FIXED = "fixed"  # gamma1 and gamma2 as given
    HEURISTIC = "heuristic"  # +2 after a verification that accepted every draft, -1 after one that did not
    THROUGHPUT = "throughput"  # the length of the most expected tokens per second, costs timed as it goes
    COSTED = "costed"  # the same from prices fixed before decoding, plain steps unless drafting pays


POLICIES = (GammaPolicy.FIXED, GammaPolicy.HEURISTIC, GammaPolicy.THROUGHPUT, GammaPolicy.COSTED)  # AUTO resolved
SOURCE_POLICIES = (GammaPolicy.THROUGHPUT, GammaPolicy.COSTED)  # may draft from a tier's shortcut, take own steps
SMOOTHING = 0.3  # weight of the newest measurement in the running verification costs
MEMORY = 0.9  # weight a draft source keeps for its earlier drafts at each of its verifications
SHORTCUT_RETRY = 8  # verifications between two tries of the draft source not in use
DRAFT_RETRY = 8  # own steps (length 0) before drafting is tried again
MAX_DRAFT_RETRY = 64  # the longest wait, after retries that kept losing
# costed policy
PRIOR_DRAFTS = 2  # judged drafts the prior acceptance weighs as, beside the source's own (AcceptanceCounts)
DRAFT_MEMORY = 0.88  # weight a judged draft keeps at each newer one: the estimate remembers about 8 drafts
PRIOR_ACCEPTANCE = {"retrieval": 0.85}  # by the source's name: the target on the retrieval cache agrees with itself
DEFAULT_PRIOR = 0.4  # a drafter model, the n-gram proposer
DRAFT_MARGIN = 1.05  # drafting must promise this many times the tokens per second of own steps
PROBE_WAIT = 4  # own steps before a probe of drafting, at the least; doubled after each probe that loses
PROBE_SHARE = 0.02  # what a probe that loses may cost, at most, as a share of the own steps waited before it
MAX_PROBE_WAIT = 64


def heuristic_length(current: int, all_accepted: bool, ceiling: int) -> int:
    """The +2/-1 rule: two more after a verification that accepted every draft, else one fewer."""
    if all_accepted:
        return min(ceiling, current + 2)
    return max(1, current - 1)


def expected_tokens(acceptance: float, length: int) -> float:
    """Tokens one verification of `length` drafts commits when each draft is accepted with this probability."""
    if acceptance >= 1.0:
        return float(length + 1)
    return (1.0 - acceptance ** (length + 1)) / (1.0 - acceptance)


def throughput_rate(acceptance: float, draft_seconds: float, verify_seconds: float, length: int) -> float:
    """Expected tokens per second of verifications of `length` drafts."""
    seconds = length * draft_seconds + verify_seconds
    return expected_tokens(acceptance, length) / seconds if seconds > 0 else float("inf")


def verification_cost(verify_seconds: dict[int, float], length: int) -> float:
    """Seconds to verify `length` drafts: as measured, else as the longest measured length below it (the shortest
    measured one where there is none below)."""
    if length in verify_seconds:
        return verify_seconds[length]
    below = [n for n in verify_seconds if n < length]
    return verify_seconds[max(below) if below else min(verify_seconds)]


def throughput_length(acceptance: float, draft_seconds: float, verify_seconds: dict[int, float], ceiling: int) -> int:
    """The length in 1..ceiling with the most expected tokens per second.

    draft_seconds: cost of one drafted token; verify_seconds: cost of a verification, by the lengths measured.
    """
    return max(
        range(1, ceiling + 1),
        key=lambda n: throughput_rate(acceptance, draft_seconds, verification_cost(verify_seconds, n), n),
    )


def _smooth(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value


def choose_source(rates: dict[bool, float], since_retry: int) -> tuple[bool, int]:
    """(use the shortcut?, verifications since the last retry) for the next verification.

    rates: expected tokens per second by source (True: the shortcut), for the sources measured so far. The faster
    source drafts, except every SHORTCUT_RETRY-th verification, which goes to the other one (the first of them
    to the shortcut while it is unmeasured).
    """
    faster = max(rates, key=rates.get)
    since_retry += 1
    if since_retry >= SHORTCUT_RETRY:
        return not faster, 0
    return faster, since_retry


@dataclass(frozen=True)
class StepCosts:
    """What a tier's steps cost, fixed before decoding: the costed policy's prices (decoding/step_costs.py predicts
    them), in seconds.

    forward[n - 1] is a forward of n tokens on the tier's cache, n = 1..ceiling + 1: an own step is forward[0], a
    verification of s drafts forward[s]. proposer and shortcut are the seconds per token drafted from each source;
    proposer_set_up and shortcut_set_up what each source costs once before its first draft (a drafter's cache
    prefilled where it first drafts, ModelTier.set_up), 0 for none; proposer_selection and shortcut_selection what
    a source's choice of chunks costs (a retrieval tier's, step_costs.selection_seconds; 0 for none), made every
    proposer_refresh (shortcut_refresh) verifications while it drafts, and before a probe after own steps.
    """

    forward: tuple[float, ...]
    proposer: float
    shortcut: float = 0.0
    proposer_set_up: float = 0.0
    shortcut_set_up: float = 0.0
    proposer_selection: float = 0.0
    shortcut_selection: float = 0.0
    proposer_refresh: int = 1
    shortcut_refresh: int = 1

    @property
    def own(self) -> float:
        return self.forward[0]

    @property
    def ceiling(self) -> int:
        """The most drafts a verification priced here may hold."""
        return len(self.forward) - 1

    def verify(self, drafts: int) -> float:
        return self.forward[min(drafts, self.ceiling)]

    def draft(self, shortcut: bool) -> float:
        return self.shortcut if shortcut else self.proposer

    def set_up(self, shortcut: bool) -> float:
        return self.shortcut_set_up if shortcut else self.proposer_set_up

    def selection(self, shortcut: bool) -> float:
        """A source's choice of chunks: what a probe after own steps costs besides its drafts and verification."""
        return self.shortcut_selection if shortcut else self.proposer_selection

    def round(self, shortcut: bool) -> float:
        """What each verification of a source's drafts costs besides them: its choice of chunks, shared out over
        the verifications between two."""
        return self.selection(shortcut) / (self.shortcut_refresh if shortcut else self.proposer_refresh)


def prior_acceptance(source: str) -> float:
    """The acceptance the costed policy assumes of drafts from a source (a Proposer's name) before it has any."""
    return PRIOR_ACCEPTANCE.get(source, DEFAULT_PRIOR)


def costed_option(acceptance: float, costs: StepCosts, shortcut: bool, ceiling: int) -> tuple[float, int]:
    """(tokens per second, length) of the best length in 1..ceiling for drafts from one source at this
    acceptance, every cost as priced (a verification's share of the source's choice of chunks included)."""
    rates = [
        (expected_tokens(acceptance, n) / (n * costs.draft(shortcut) + costs.verify(n) + costs.round(shortcut)), n)
        for n in range(1, ceiling + 1)
    ]
    return max(rates, key=lambda rate_length: rate_length[0])


@dataclass
class DraftSource:
    """Acceptance and cost per draft of one way of drafting for a tier.

    Sums over the source's verifications, each earlier one's weight multiplied by MEMORY at every new one, so the
    averages follow the generation and count every draft alike. (A running average per verification with weight
    0.3 remembered about three verifications: at one draft each, its estimate of a 40% acceptance wandered by
    about 0.2.) The acceptance is that of the drafts the verifier decided on: the accepted ones and the first
    rejected one. Drafts after a rejection are never judged, and counting them as rejected would bias the
    per-draft rate that expected_tokens assumes towards short lengths.
    """

    drafted: float = 0.0
    judged: float = 0.0  # accepted drafts plus the rejected one, where there was one
    accepted: float = 0.0
    seconds: float = 0.0  # spent drafting

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.judged if self.judged else None

    @property
    def draft_seconds(self) -> float | None:
        """Seconds per drafted token."""
        return self.seconds / self.drafted if self.drafted else None

    def record(self, drafted: int, accepted: int, draft_seconds: float) -> None:
        self.drafted = MEMORY * self.drafted + drafted
        self.judged = MEMORY * self.judged + accepted + (accepted < drafted)
        self.accepted = MEMORY * self.accepted + accepted
        self.seconds = MEMORY * self.seconds + draft_seconds


@dataclass
class AcceptanceCounts:
    """The costed policy's acceptance of one source: judged and accepted drafts (as DraftSource counts them), each
    earlier draft's weight multiplied by DRAFT_MEMORY at every newly judged draft, so that the estimate forgets by
    drafts, not verifications: after long accepted runs, a few rejections in a row tell that the text moved on."""

    judged: float = 0.0
    accepted: float = 0.0

    def record(self, drafted: int, accepted: int) -> None:
        judged = accepted + (accepted < drafted)
        fade = DRAFT_MEMORY**judged
        # the accepted drafts come first, the rejected one (if any) last
        self.accepted = fade * self.accepted + sum(DRAFT_MEMORY ** (judged - 1 - i) for i in range(accepted))
        self.judged = fade * self.judged + sum(DRAFT_MEMORY**i for i in range(judged))

    def estimate(self, prior: float) -> float:
        """The acceptance with PRIOR_DRAFTS judged drafts at the prior rate counted beside the source's own."""
        return (self.accepted + PRIOR_DRAFTS * prior) / (self.judged + PRIOR_DRAFTS)


@dataclass
class SpeculationLength:
    """A tier's current speculation length, its draft source, and what its policy has measured so far."""

    policy: str
    ceiling: int
    has_shortcut: bool = False  # the tier can draft from its proposer's proposer instead (throughput policy only)
    own_steps: bool = False  # the tier may draft nothing and sample itself (length 0; throughput policy only)
    current: int = field(init=False)  # starts at the ceiling; 0: the tier's own step, nothing drafted
    use_shortcut: bool = field(init=False, default=False)  # where the next drafts come from
    proposer_averages: DraftSource = field(default_factory=DraftSource)
    shortcut_averages: DraftSource = field(default_factory=DraftSource)
    verify_seconds: dict[int, float] = field(default_factory=dict)  # per verification, by length; 0: an own step
    since_retry: int = SHORTCUT_RETRY - 1  # verifications since the last forced retry; the first comes at once
    draft_retry: int = field(init=False, default=DRAFT_RETRY)  # own steps before drafting again, once length 0 wins
    own_steps_left: int = field(init=False, default=0)
    retrying: bool = field(init=False, default=False)  # the current drafts are a retry after own steps
    resume: tuple[int, bool] = field(init=False, default=(1, False))  # (length, use_shortcut) a retry drafts with
    dropped: int = field(init=False, default=0)  # times the policy chose length 0 after drafting
    own_steps_taken: int = field(init=False, default=0)
    costs: StepCosts | None = field(init=False, default=None)  # costed policy: set by price()
    proposer_counts: AcceptanceCounts = field(init=False, default_factory=AcceptanceCounts)  # costed
    shortcut_counts: AcceptanceCounts = field(init=False, default_factory=AcceptanceCounts)  # costed
    priors: dict[bool, float] = field(init=False, default_factory=dict)  # costed: prior acceptance by source
    probe_wait: int = field(init=False, default=PROBE_WAIT)  # costed: own steps after the next drafting that loses
    probe_base: int = field(init=False, default=PROBE_WAIT)  # costed: the shortest such wait (set by price())
    probe_shortcut: bool = field(init=False, default=False)  # costed: the source of the last probe
    # costed: the sources (True: the shortcut) whose drafts would pay were every one accepted; no other is probed
    payable: tuple[bool, ...] = field(init=False, default=())
    # costed: the sources whose one-time set-up is still to run (StepCosts.set_up), as the tier last said, and
    # those of them that draft without it all the same (an n-gram before a drafter not yet prefilled)
    set_up_due: tuple[bool, ...] = field(init=False, default=())
    drafts_before_set_up: tuple[bool, ...] = field(init=False, default=())
    set_up_wait: int = field(init=False, default=0)  # costed: own steps before the first probe, as priced
    tokens_taken: int = field(init=False, default=0)  # costed: tokens the tier committed, own steps and verified
    free_counts: AcceptanceCounts = field(init=False, default_factory=AcceptanceCounts)  # costed: free drafts'
    free_wait: int = field(init=False, default=1)  # costed: offers of free drafts before the next probe of them
    free_offers: int = field(init=False, default=0)  # costed: offers declined since the last verification of them
    free_bar: float = field(init=False, default=0.0)  # costed: tokens a second of the step free drafts last replaced

    @property
    def drafting(self) -> bool:
        """Whether the next step verifies drafts (False: the tier samples its own token)."""
        return self.current > 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation-length policy '{self.policy}'")
        self.current = self.ceiling

    def record(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Account for one verification of `drafted` tokens, `accepted` of them accepted, and pick the next length
        (and, with a shortcut, the next source).

        A proposer may offer fewer tokens than asked (the n-gram proposer: none when nothing matches); a
        verification of no drafts tells nothing about acceptance and changes only the source, back to the proposer
        (under the costed policy only where the proposer's drafts could pay, and ModelTier then takes its own step
        instead of verifying nothing).
        """
        if drafted == 0:
            costed = self.policy == "costed" and self.costs is not None
            if not costed or False in self.payable:
                self.use_shortcut = False  # a shortcut that found nothing waits for its next retry
            # (costed, where the proposer's drafts could never pay: the shortcut is asked again next time)
            if costed and self.own_steps and not self._pays():
                self.current, self.own_steps_left = 0, self.probe_base  # a probe that found nothing to draft
            return
        if self.policy == "heuristic":
            self.current = heuristic_length(self.current, accepted == drafted, self.ceiling)
        elif self.policy == "throughput":
            averages = self.shortcut_averages if self.use_shortcut else self.proposer_averages
            averages.record(drafted, accepted, draft_seconds)
            self.verify_seconds[drafted] = _smooth(self.verify_seconds.get(drafted), verify_seconds)
            self._choose(drafted)
        elif self.policy == "costed" and self.costs is not None:
            self._counts(self.use_shortcut).record(drafted, accepted)
            self.tokens_taken += accepted + 1
            self._plan(drafted, accepted)

    def record_nothing_drafted(self) -> None:
        """Costed: the source drafted nothing, and the tier took its own step instead (ModelTier.step). The step
        counts as one of its own and among the tokens taken; the next source is chosen as after a verification of
        no drafts (record)."""
        self.own_steps_taken += 1
        self.tokens_taken += 1
        self.record(0, 0, 0.0, 0.0)

    def record_own_step(self, seconds: float) -> None:
        """Account for one step in which the tier sampled its own token (length 0) and took `seconds`; once
        own_steps_left is spent, the next step retries drafting."""
        self.own_steps_taken += 1
        self.own_steps_left -= 1
        if self.policy == "costed":
            self.tokens_taken += 1
            if self.own_steps_left <= 0:
                self._probe()
            return
        self.verify_seconds[0] = _smooth(self.verify_seconds.get(0), seconds)
        if self.own_steps_left <= 0:
            self.current, self.use_shortcut = self.resume
            self.retrying = self.dropped > 0  # not after the one step that measured them first
            if self.retrying:  # the text has moved on since: the retry's drafts alone say how drafting does now
                if self.use_shortcut:
                    self.shortcut_averages = DraftSource()
                else:
                    self.proposer_averages = DraftSource()

    def price(
        self,
        costs: StepCosts,
        priors: dict[bool, float],
        set_up_due: tuple[bool, ...] = (),
        drafts_before_set_up: tuple[bool, ...] = (),
    ) -> None:
        """Give the costed policy its costs, the prior acceptance of each source (True: the shortcut), the sources
        whose set-up is due and those of them that draft without it (set_up_due, drafts_before_set_up), and choose
        the first step from them: drafting where the priors promise it pays (a set-up due then runs at once), else
        a probe of it, or own steps where no source that may pay can be probed before its set-up is paid for
        (_set_up_wait)."""
        self.costs, self.priors = costs, priors
        self.set_up_due, self.drafts_before_set_up = set_up_due, drafts_before_set_up
        self.since_retry = 0  # the sources' estimates start from priors: no retry owed yet
        self.verify_seconds = {n: costs.forward[n] for n in range(len(costs.forward))}  # what TierCosts reports
        sources = (True, False) if self.has_shortcut else (False,)
        self.payable = tuple(shortcut for shortcut in sources if self._could_pay(shortcut))
        self.probe_base = self.probe_wait = self._probe_base()
        self.set_up_wait = self._first_set_up_wait()
        self._probe()

    def free_length(self, offered: int) -> int:
        """How many of `offered` free drafts (costing nothing to draft) the tier verifies next: the best number at
        their estimated acceptance where that promises DRAFT_MARGIN times the rate of own steps and no less than the
        tier's own choice for the step; else one where a probe of them is due, or none. Only under the costed
        policy once priced (none otherwise: the tier's own proposer drafts as before)."""
        if self.policy != "costed" or self.costs is None or offered == 0:
            return 0
        acceptance = self.free_counts.estimate(DEFAULT_PRIOR)
        rate, length = max(
            (expected_tokens(acceptance, n) / self.costs.verify(n), n) for n in range(1, min(offered, self.ceiling) + 1)
        )
        own_rate = 1.0 / self.costs.own
        self.free_bar = max(rate for rate, _ in self._options().values()) if self.drafting else own_rate
        if rate >= max(DRAFT_MARGIN * own_rate, self.free_bar):
            return length
        self.free_offers += 1
        return 1 if self.free_offers >= self.free_wait else 0

    def record_free(self, drafted: int, accepted: int) -> None:
        """Account for one verification of `drafted` free drafts, `accepted` of them accepted: their acceptance, and
        the wait before the next probe of them: back to one offer after drafts that paid for themselves (their
        tokens a second, as priced, no fewer than the step they replaced promised: own steps, or the tier's
        drafting from its own sources), else twice as long."""
        self.free_counts.record(drafted, accepted)
        self.tokens_taken += accepted + 1
        paid = (accepted + 1) / self.costs.verify(drafted) >= self.free_bar
        self.free_wait = 1 if paid else min(MAX_PROBE_WAIT, 2 * max(PROBE_WAIT // 2, self.free_wait))
        self.free_offers = 0

    def _counts(self, shortcut: bool) -> AcceptanceCounts:
        """A source's acceptance counts (costed)."""
        return self.shortcut_counts if shortcut else self.proposer_counts

    def _probe_base(self) -> int:
        """Own steps between two probes at the least: PROBE_WAIT, or as many as make what the cheapest probe
        loses where its draft is rejected (a draft, the source's choice of chunks and a verification of one draft,
        for one token an own step would have given) at most PROBE_SHARE of their cost, so that probing where
        drafting never pays costs about that share of an answer whatever a verification costs on this machine and
        context."""
        if not self.payable:
            return MAX_PROBE_WAIT
        costs = self.costs
        loss = min(costs.draft(source) + costs.selection(source) for source in self.payable)
        loss += costs.verify(1) - costs.own
        return min(MAX_PROBE_WAIT, max(PROBE_WAIT, math.ceil(loss / (PROBE_SHARE * costs.own))))

    def _could_pay(self, shortcut: bool) -> bool:
        """Whether drafts from a source, at its best length with every draft accepted, promise DRAFT_MARGIN times
        the tokens per second of own steps: where they do not, no acceptance makes it pay, and probing it would
        only cost (the retrieval tier at short contexts, whose forward costs most of a full one)."""
        best, _ = costed_option(1.0, self.costs, shortcut, self.ceiling)
        return not self.own_steps or best >= DRAFT_MARGIN / self.costs.own

    def _options(self) -> dict[bool, tuple[float, int]]:
        """(tokens per second, length) of the best length of each source, at its estimated acceptance."""
        sources = {False: self.proposer_counts}
        if self.has_shortcut:
            sources[True] = self.shortcut_counts
        return {
            shortcut: costed_option(source.estimate(self.priors[shortcut]), self.costs, shortcut, self.ceiling)
            for shortcut, source in sources.items()
        }

    def _draft_if_it_pays(self) -> bool:
        """Draft with the best source and length where that promises DRAFT_MARGIN times the tokens per second of
        own steps (or where the tier has none); return whether it does. The source not in use drafts one token
        every SHORTCUT_RETRY-th verification (choose_source), so that its estimate follows the text too, once the
        tokens so far pay for its set-up where it has one due (_retry_may_set_up)."""
        if not self._pays():
            return False
        options = self._options()
        best_rate, self.current = max(options.values())
        rates = {
            shortcut: rate
            for shortcut, (rate, _) in options.items()
            if shortcut in self.payable and (rate == best_rate or self._retry_may_set_up(shortcut))
        }
        if len(rates) > 1:
            self.use_shortcut, self.since_retry = choose_source(rates, self.since_retry)
            if self.since_retry == 0:
                self.current = 1
        else:
            self.use_shortcut = max(options, key=lambda shortcut: options[shortcut][0])
        self.probe_wait = self.probe_base
        return True

    def _plan(self, drafted: int, accepted: int) -> None:
        """After a verification under the costed policy: keep drafting where it pays, else take own steps before the
        next probe: probe_base of them after drafting that paid for itself (its tokens cost no more than own steps
        would have), twice as many each time after drafting that did not (up to MAX_PROBE_WAIT)."""
        if self._draft_if_it_pays():
            return
        seconds = drafted * self.costs.draft(self.use_shortcut) + self.costs.verify(drafted)
        seconds += self.costs.round(self.use_shortcut)
        paid = seconds <= (accepted + 1) * self.costs.own
        if paid:
            self.probe_wait = self.probe_base
        self.own_steps_left = self.probe_wait
        if not paid:
            self.probe_wait = min(MAX_PROBE_WAIT, 2 * self.probe_wait)
        self.dropped += 1
        self.current = 0

    def _retry_may_set_up(self, shortcut: bool) -> bool:
        """Whether a retry of the source not in use may draft from it: it drafts without a set-up, or the tokens
        the tier committed so far pay for its set-up as the own steps before a probe do (_set_up_wait). A drafter
        retried under the retrieval tier at 32K would otherwise prefill its cache (about five plain steps) within
        a short answer, to draft one token that verifies no cheaper than the retrieval tier's."""
        return shortcut in self.drafts_before_set_up or self._tokens_pay_set_up(shortcut)

    def _tokens_pay_set_up(self, shortcut: bool) -> bool:
        """Whether the tokens the tier committed so far pay for a source's set-up as the own steps before a probe
        do (_set_up_wait)."""
        return self._set_up_wait(shortcut) <= self.tokens_taken

    def _set_up_wait(self, shortcut: bool) -> int:
        """Own steps the tier takes before the first probe of a source whose set-up is due: as many as make the
        set-up and what the probe loses where its draft is rejected at most PROBE_SHARE of their cost (0 for a
        source with nothing to set up). A drafter's prefill costs ten or more own steps, so where drafting does
        not pay from the priors (short contexts) an answer shorter than that wait never runs it."""
        if shortcut not in self.set_up_due:
            return 0
        costs = self.costs
        loss = costs.set_up(shortcut) + costs.draft(shortcut) + costs.selection(shortcut) + costs.verify(1) - costs.own
        return math.ceil(loss / (PROBE_SHARE * costs.own))

    def _first_set_up_wait(self) -> int:
        """Own steps before the first probe where every source whose drafts could pay has a set-up due
        (_set_up_wait), else 0."""
        waits = (0 if source in self.drafts_before_set_up else self._set_up_wait(source) for source in self.payable)
        return min(waits, default=0)

    def _probe_source(self) -> bool | None:
        """The source the next probe drafts from: the one not probed last time where there are two (the shortcut,
        which costs less, first), else the other, whichever has its set-up paid for by the own steps so far
        (_set_up_wait); None where neither has yet."""
        order = (not self.probe_shortcut, self.probe_shortcut) if len(self.payable) > 1 else self.payable
        return next((source for source in order if self._may_probe(source)), None)

    def _may_probe(self, shortcut: bool) -> bool:
        """Whether a probe may draft from a source now: it drafts without its set-up, or may run it."""
        return shortcut in self.drafts_before_set_up or self.may_set_up(shortcut)

    def may_set_up(self, shortcut: bool) -> bool:
        """Whether drafts from a source may run its set-up now: it has none due, or the own steps so far pay for it
        (_set_up_wait), or drafting from that source pays (from the priors the prefill goes with the prompt's:
        Engine.generate), or the policy is not costed. Another source's paying does not count: at 32K the target
        drafts from the retrieval tier, which pays, and an n-gram retried as its shortcut would otherwise have the
        drafter behind it prefilled (six plain steps) within a short answer, for drafts verified no cheaper than
        the retrieval tier's. A source that drafts before its set-up (an n-gram before a drafter), once drafts
        of it were judged, runs it only once the tokens the tier committed pay for it (_tokens_pay_set_up, as
        retries do): the acceptance it has earned is the n-gram's, which says nothing of the drafter's (an n-gram
        accepted 7 times in 8 at 7K had a drafter prefilled within a 64-token answer, 14 plain steps)."""
        if self.costs is None:
            return True
        if shortcut in self.drafts_before_set_up and self._counts(shortcut).judged:
            return self._tokens_pay_set_up(shortcut)
        return self._set_up_wait(shortcut) <= self.own_steps_taken or self._pays(shortcut)

    def _pays(self, source: bool | None = None) -> bool:
        """Whether drafting (from `source` where given, True the shortcut, else from the best source) promises
        DRAFT_MARGIN times the tokens per second of own steps, at the acceptance estimated so far
        (_draft_if_it_pays), or the tier has no own steps."""
        options = self._options()
        rate = options[source][0] if source is not None else max(rate for rate, _ in options.values())
        return not self.own_steps or rate >= DRAFT_MARGIN / self.costs.own

    def _probe(self) -> None:
        """Draft where it pays; else draft once all the same, a probe, to learn whether drafting pays now, at the
        probed source's best length (_probe_source); where no source may be probed yet, own steps until one
        may."""
        if self._draft_if_it_pays():
            return
        if not self.payable:  # no acceptance would make drafting pay: own steps only
            self.current, self.own_steps_left = 0, MAX_PROBE_WAIT
            return
        source = self._probe_source()
        if source is None:
            self.current, self.own_steps_left = 0, self._first_set_up_wait() - self.own_steps_taken
            return
        self.probe_shortcut = self.use_shortcut = source
        self.current = self._options()[source][1]

    def _choose(self, drafted: int) -> None:
        untried = [n for n in range(drafted - 1, 0, -1) if n not in self.verify_seconds]  # shorter than the last
        if untried:
            self.current, self.use_shortcut = untried[0], False
            return
        sources = {False: self.proposer_averages}
        if self.has_shortcut:
            sources[True] = self.shortcut_averages
        best = {shortcut: self._best(source) for shortcut, source in sources.items() if source.acceptance is not None}
        if self.has_shortcut:
            rates = {shortcut: rate for shortcut, (rate, _) in best.items()}
            self.use_shortcut, self.since_retry = choose_source(rates, self.since_retry)
        # the source just recorded is measured; one not measured yet drafts the measured one's length
        _, self.current = best.get(self.use_shortcut, next(iter(best.values())))
        if self.own_steps:
            self._weigh_own_steps(max(r for r, _ in best.values()))

    def _weigh_own_steps(self, drafting_rate: float) -> None:
        """Switch to own steps (length 0) where they yield more tokens per second than the best drafting; the first
        time, take one own step to measure it."""
        own = self.verify_seconds.get(0)
        retried, self.retrying = self.retrying, False
        if own is not None and 1.0 / own <= drafting_rate:
            self.draft_retry = DRAFT_RETRY
            return
        self.resume = (self.current, self.use_shortcut)
        if own is None:
            self.own_steps_left = 1
        else:
            self.draft_retry = min(MAX_DRAFT_RETRY, 2 * self.draft_retry) if retried else DRAFT_RETRY
            self.own_steps_left = self.draft_retry
            self.dropped += 1
        self.current = 0

    def _best(self, source: DraftSource) -> tuple[float, int]:
        """(tokens per second, length) of the best length for drafts from source."""
        length = throughput_length(source.acceptance, source.draft_seconds, self.verify_seconds, self.ceiling)
        seconds = verification_cost(self.verify_seconds, length)
        return throughput_rate(source.acceptance, source.draft_seconds, seconds, length), length
