"""What one generation returns: tokens, text and the measurements the CLI and bench render, and as_record, which
turns such measurements into the dicts written as JSON and CSV."""

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from triforce_cli.decoding.speculative import AcceptanceStats, TierCosts


class StopReason(StrEnum):
    """Why a generation ended (GenerationStats.stop_reason)."""

    MAX_NEW_TOKENS = "max_new_tokens"  # it wrote as many tokens as it was allowed
    EOS = "eos"  # the model wrote an end-of-sequence token
    INTERRUPTED = "interrupted"  # Ctrl-C (interrupts.py)
    CANCELLED = "cancelled"  # the caller's should_stop: a server's client gone, a stop string written


def summary_of(values: str, reduce: Callable[[list[float]], float]) -> property:
    """A read-only property reducing the list attribute named values (its median, min or max) for a record."""
    return property(lambda measurement: reduce(getattr(measurement, values)), doc=f"{reduce.__name__} of {values}")


def as_record(measurement) -> dict[str, Any]:
    """A dataclass instance as a plain dict, as dataclasses.asdict makes it, followed by the derived properties its
    class names in DERIVED; a class that names the attributes of its record (fields or properties) in RECORD gets
    those, in that order, instead. A key is the attribute's name, unless the class's RECORD_KEYS renames it.
    Dataclasses nested in it, also inside lists, tuples and dicts, become records too (with their derived
    properties)."""
    keys = getattr(measurement, "RECORD_KEYS", {})
    names = getattr(measurement, "RECORD", None)
    if names is None:
        names = [f.name for f in dataclasses.fields(measurement)] + list(getattr(measurement, "DERIVED", ()))
    return {keys.get(name, name): _record_value(getattr(measurement, name)) for name in names}


def _record_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_record(value)
    if isinstance(value, (list, tuple)):
        return [_record_value(item) for item in value]
    if isinstance(value, dict):
        return {key: _record_value(item) for key, item in value.items()}
    return value


@dataclass
class GenerationStats:
    mode: str
    drafter: str | None
    prompt_tokens: int
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_chunk_seconds: list[float] = field(default_factory=list)  # the target's, per prefill chunk
    compile_seconds: float = 0.0  # compiling decode steps (decoding/warm_up.py), in neither prefill nor decode time
    decode_seconds: float = 0.0
    round_seconds: list[float] = field(default_factory=list)  # one entry per step of the top tier
    round_tokens: list[int] = field(default_factory=list)  # tokens that step committed
    acceptance: list[AcceptanceStats] = field(default_factory=list)
    tier_costs: list[TierCosts] = field(default_factory=list)  # each adaptive tier's measured costs and decisions
    stop_reason: StopReason = StopReason.MAX_NEW_TOKENS
    prompt_cached: bool = False  # the prompt's KV cache was restored instead of prefilled
    reused_tokens: int = 0  # prompt positions kept from the previous prompt's prefill (a shared prefix)

    DERIVED: ClassVar[tuple[str, ...]] = ("ms_per_token", "median_ms_per_token", "tokens_per_second")

    @property
    def decoded_tokens(self) -> int:
        """Tokens of the decode loop; the first new token comes with the prefill."""
        return sum(self.round_tokens)

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.decode_seconds / self.decoded_tokens if self.decoded_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.decoded_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def median_ms_per_token(self) -> float:
        """Median over top-tier steps of that step's time divided by the tokens it committed."""
        per_token = [1000 * s / n for s, n in zip(self.round_seconds, self.round_tokens) if n]
        return statistics.median(per_token) if per_token else 0.0


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: GenerationStats
