"""Rich rendering for the CLI: prefill progress, tier-coloured token stream and the closing summary."""

from typing import Self

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from transformers import PreTrainedTokenizerBase

from triforce_cli.decoding.stats import GenerationStats
from triforce_cli.distill.trainer import DistillProgress

TIER_STYLES = {"ngram": "magenta", "drafter": "green", "retrieval": "yellow", "target": "cyan"}


def tier_legend() -> Text:
    legend = Text("tokens by tier: ")
    for tier, style in TIER_STYLES.items():
        legend.append(f"{tier} ", style=style)
    return legend


class TokenStream:
    """Prints newly accepted tokens as text, each coloured by the tier that sampled it.

    The whole generated sequence is decoded each time, so multi-token characters and merged spaces come out
    right; text is held back while it ends in an incomplete character.
    """

    def __init__(self, console: Console, tokenizer: PreTrainedTokenizerBase):
        self.console = console
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, tokens: list[int], origins: list[str]) -> None:
        for token, origin in zip(tokens, origins):
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if text.endswith("\ufffd") or len(text) <= self.printed:
                continue
            self.console.print(Text(text[self.printed :], style=TIER_STYLES.get(origin, "")), end="", soft_wrap=True)
            self.printed = len(text)

    def finish(self) -> None:
        self.console.print()


class PrefillProgress:
    """A progress bar per model while the prompt is prefilled."""

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("prefill {task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.completed}/{task.total} tokens"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, name: str, done: int, total: int) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=total)
        self.progress.update(self.tasks[name], completed=done)
        if done >= total:
            self.progress.stop()


DISTILL_PHASES = {"self-generate": "target writes windows", "teacher": "target top-K", "train": "train drafter"}


class DistillBar:
    """One progress bar per distillation phase; training shows the loss and the held-out acceptance."""

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self.tasks: dict[str, int] = {}
        self.loss = ""
        self.acceptance = ""

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, event: DistillProgress) -> None:
        if event.phase not in self.tasks:
            self.tasks[event.phase] = self.progress.add_task(DISTILL_PHASES[event.phase], total=event.total, metrics="")
        if event.loss is not None:
            self.loss = f"loss {event.loss:.3f}"
        if event.acceptance is not None:
            self.acceptance = f"held-out acceptance {event.acceptance:.1%} (greedy {event.greedy_acceptance:.1%})"
        metrics = "  ".join(part for part in (self.loss, self.acceptance) if part)
        self.progress.update(self.tasks[event.phase], completed=event.done, metrics=metrics)


def summary_table(stats: GenerationStats) -> Table:
    table = Table(title="generation", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("mode", stats.mode),
        ("drafter", stats.drafter or "-"),
        ("prompt tokens", str(stats.prompt_tokens)),
        (
            "prefill",
            f"{stats.prefill_seconds:.2f} s" + (" (restored from the prompt cache)" if stats.prompt_cached else ""),
        ),
        ("new tokens", str(stats.new_tokens)),
        ("per-token latency", f"{stats.ms_per_token:.1f} ms (median step {stats.median_ms_per_token:.1f} ms)"),
        ("throughput", f"{stats.tokens_per_second:.1f} tokens/s"),
        ("stopped by", stats.stop_reason),
    ]
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


def acceptance_table(stats: GenerationStats) -> Table | None:
    if not stats.acceptance:
        return None
    table = Table(title="acceptance per tier", title_justify="left")
    columns = (
        "proposer",
        "verifier",
        "passes",
        "drafted",
        "accepted",
        "rate",
        "α",  # per judged draft, see AcceptanceStats.judged_acceptance_rate
        "drafts per pass",
        "mean accepted length",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("proposer", "verifier") else "right")
    for a in stats.acceptance:
        table.add_row(
            Text(a.proposer, style=TIER_STYLES.get(a.proposer)),
            Text(a.verifier, style=TIER_STYLES.get(a.verifier)),
            str(a.verifications),
            str(a.drafted),
            str(a.accepted),
            f"{a.acceptance_rate:.1%}",
            f"{a.judged_acceptance_rate:.1%}",
            f"{a.mean_drafted:.2f}",
            f"{a.mean_accepted_length:.2f}",
        )
    return table


def print_summary(console: Console, stats: GenerationStats) -> None:
    console.print(summary_table(stats))
    table = acceptance_table(stats)
    if table is not None:
        console.print(table)
