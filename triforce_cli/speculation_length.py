"""How many tokens a tier asks of its proposer per verification: fixed, or adapted after every verification.

The configured gamma is the ceiling in every policy (it also sizes the caches' headroom); adaptive policies move
between 1 and that ceiling. None of them changes what is generated, only how much is drafted:

- ``fixed``: always gamma.
- ``heuristic``: the rule of transformers' assisted generation (``num_assistant_tokens_schedule="heuristic"``):
  two more after a verification that accepted every draft, one fewer otherwise.
- ``throughput``: the expected-tokens-per-second stride scheduler of RaLMSpec (Zhang et al., 2024,
  arXiv 2401.14021). With acceptance rate a per draft, a verification of s drafts yields
  (1 - a^(s+1)) / (1 - a) tokens (Leviathan et al., 2023) and costs s draft steps plus one verification; it picks
  the s with the highest rate. Acceptance and costs are running averages of what this generation measured. The
  verification cost is kept per s, since verifying more tokens costs more on a CPU, so every s is tried once
  first, longest first. Its choices follow the clock, so a seeded sampled run may draft differently from one run
  to the next (the output distribution stays exact; greedy output is unchanged).
"""

from dataclasses import dataclass, field

POLICIES = ("fixed", "heuristic", "throughput")
SMOOTHING = 0.3  # weight of the newest measurement in the running averages


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


def throughput_length(acceptance: float, draft_seconds: float, verify_seconds: dict[int, float], ceiling: int) -> int:
    """The length in 1..ceiling with the most expected tokens per second.

    draft_seconds: cost of one drafted token; verify_seconds: cost of a verification, by length.
    """

    def rate(length: int) -> float:
        seconds = length * draft_seconds + verify_seconds[length]
        return expected_tokens(acceptance, length) / seconds if seconds > 0 else float("inf")

    return max(range(1, ceiling + 1), key=rate)


def _smooth(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value


@dataclass
class SpeculationLength:
    """A tier's current speculation length and what its policy has measured so far."""

    policy: str
    ceiling: int
    current: int = field(init=False)  # starts at the ceiling
    acceptance: float | None = None
    draft_seconds: float | None = None  # per drafted token
    verify_seconds: dict[int, float] = field(default_factory=dict)  # per verification, by length

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown speculation-length policy '{self.policy}'")
        self.current = self.ceiling

    def record(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Account for one verification of `drafted` tokens, `accepted` of them accepted, and pick the next length.

        A proposer may offer fewer tokens than asked (the n-gram proposer: none when nothing matches); a
        verification of no drafts tells nothing about acceptance and changes nothing.
        """
        if drafted == 0:
            return
        if self.policy == "heuristic":
            self.current = heuristic_length(self.current, accepted == drafted, self.ceiling)
        elif self.policy == "throughput":
            self.acceptance = _smooth(self.acceptance, accepted / drafted)
            self.draft_seconds = _smooth(self.draft_seconds, draft_seconds / drafted)
            self.verify_seconds[drafted] = _smooth(self.verify_seconds.get(drafted), verify_seconds)
            untried = [n for n in range(self.ceiling, 0, -1) if n not in self.verify_seconds]
            if untried:
                self.current = untried[0]
            else:
                self.current = throughput_length(self.acceptance, self.draft_seconds, self.verify_seconds, self.ceiling)
