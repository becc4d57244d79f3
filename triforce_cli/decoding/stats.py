"""What one generation returns: tokens, text and the measurements the CLI and bench render."""

import statistics
from dataclasses import dataclass, field

from triforce_cli.decoding.speculative import AcceptanceStats


@dataclass
class GenerationStats:
    mode: str
    drafter: str | None
    prompt_tokens: int
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    round_seconds: list[float] = field(default_factory=list)  # one entry per step of the top tier
    round_tokens: list[int] = field(default_factory=list)  # tokens that step committed
    acceptance: list[AcceptanceStats] = field(default_factory=list)
    stop_reason: str = "max_new_tokens"  # or "eos", "interrupted"
    prompt_cached: bool = False  # the prompt's KV cache was restored instead of prefilled

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

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "drafter": self.drafter,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prompt_cached": self.prompt_cached,
            "decode_seconds": self.decode_seconds,
            "ms_per_token": self.ms_per_token,
            "median_ms_per_token": self.median_ms_per_token,
            "tokens_per_second": self.tokens_per_second,
            "stop_reason": self.stop_reason,
            "acceptance": [a.as_dict() for a in self.acceptance],
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    stats: GenerationStats
