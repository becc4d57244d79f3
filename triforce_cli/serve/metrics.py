"""The counters behind GET /metrics, in Prometheus' text exposition format (version 0.0.4), written by hand: a
few counters need no client library."""

import threading
from collections import Counter

from triforce_cli.decoding.stats import GenerationStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (type, help); a name's samples may carry labels
FAMILIES = {
    "triforce_requests_total": ("counter", "Requests by route and outcome: ok, invalid, rejected, cancelled, failed."),
    "triforce_prompt_tokens_total": ("counter", "Prompt tokens of the generations run."),
    "triforce_generation_tokens_total": ("counter", "Tokens generated."),
    "triforce_prefill_seconds_total": ("counter", "Seconds spent prefilling prompts (first token included)."),
    "triforce_decode_seconds_total": ("counter", "Seconds spent in the decoding loop."),
    "triforce_prefix_tokens_reused_total": ("counter", "Prompt tokens kept from the previous prefill (prefix reuse)."),
    "triforce_prompt_cache_hits_total": ("counter", "Prompts whose whole prefill came from --prompt-cache."),
    "triforce_proposed_tokens_total": ("counter", "Tokens a tier proposed to the tier above it."),
    "triforce_accepted_tokens_total": ("counter", "Proposed tokens the tier above accepted."),
    "triforce_acceptance_ratio": ("gauge", "Accepted over proposed tokens since the start, per pair of tiers."),
    "triforce_queue_waiting": ("gauge", "Requests waiting for the model."),
    "triforce_generating": ("gauge", "1 while a generation runs."),
}
TOTALS = (  # families of one sample each, summed over the generations
    "triforce_prompt_tokens_total",
    "triforce_generation_tokens_total",
    "triforce_prefill_seconds_total",
    "triforce_decode_seconds_total",
    "triforce_prefix_tokens_reused_total",
    "triforce_prompt_cache_hits_total",
)


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    escaped = (str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for value in labels.values())
    return "{" + ",".join(f'{key}="{value}"' for key, value in zip(labels, escaped)) + "}"


class Metrics:
    """Counts requests (on the event loop) and generations (on the worker's thread), under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()  # (route, outcome)
        self._totals: Counter[str] = Counter()
        self._proposed: Counter[tuple[str, str]] = Counter()  # (proposer, verifier)
        self._accepted: Counter[tuple[str, str]] = Counter()

    def request(self, route: str, outcome: str) -> None:
        with self._lock:
            self._requests[route, outcome] += 1

    def generation(self, stats: GenerationStats) -> None:
        """One generation's tokens, times, reuse and acceptance per pair of tiers."""
        with self._lock:
            self._totals["triforce_prompt_tokens_total"] += stats.prompt_tokens
            self._totals["triforce_generation_tokens_total"] += stats.new_tokens
            self._totals["triforce_prefill_seconds_total"] += stats.prefill_seconds
            self._totals["triforce_decode_seconds_total"] += stats.decode_seconds
            self._totals["triforce_prefix_tokens_reused_total"] += stats.reused_tokens
            self._totals["triforce_prompt_cache_hits_total"] += int(stats.prompt_cached)
            for pair in stats.acceptance:
                self._proposed[pair.proposer, pair.verifier] += pair.drafted
                self._accepted[pair.proposer, pair.verifier] += pair.accepted

    def render(self, *, waiting: int, generating: bool) -> str:
        """Every family, in the text format; waiting and generating: the worker's state now."""
        with self._lock:
            samples: dict[str, list[tuple[str, float]]] = {name: [] for name in FAMILIES}
            for (route, outcome), count in sorted(self._requests.items()):
                samples["triforce_requests_total"].append((_labels(route=route, outcome=outcome), count))
            for name in TOTALS:
                samples[name].append(("", self._totals[name]))
            for pair in sorted(self._proposed):
                labels = _labels(proposer=pair[0], verifier=pair[1])
                proposed, accepted = self._proposed[pair], self._accepted[pair]
                samples["triforce_proposed_tokens_total"].append((labels, proposed))
                samples["triforce_accepted_tokens_total"].append((labels, accepted))
                samples["triforce_acceptance_ratio"].append((labels, accepted / proposed if proposed else 0.0))
            samples["triforce_queue_waiting"].append(("", waiting))
            samples["triforce_generating"].append(("", int(generating)))
        lines = []
        for name, (kind, help_text) in FAMILIES.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {value}" for labels, value in samples[name]]
        return "\n".join(lines) + "\n"
