"""Rich rendering for the CLI: prefill progress, the tier-coloured token stream, summaries and bench tables.

Every table fits an 80-column terminal.
"""

from typing import Self

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from transformers import PreTrainedTokenizerBase

from triforce_cli.bench.forward_costs import ForwardCost
from triforce_cli.bench.qa import QARow
from triforce_cli.bench.report import acceptance_text
from triforce_cli.bench.runner import BenchRow, OverPrompts, over_prompts
from triforce_cli.cli.console import print_note
from triforce_cli.decoding.sizing import MemoryPlan
from triforce_cli.decoding.speculative import Tier
from triforce_cli.decoding.stats import GenerationStats
from triforce_cli.distill.trainer import DistillProgress
from triforce_cli.runtime.forms import WeightForm
from triforce_cli.runtime.gguf_weights import describe_types, expanded_types
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.store import human_size

TIER_STYLES = {Tier.NGRAM: "magenta", Tier.DRAFTER: "green", Tier.RETRIEVAL: "yellow", Tier.TARGET: "cyan"}


def memory_plan_line(plan: MemoryPlan) -> str:
    """What a generation holds, and where, as one line: the device's items, then the host's."""
    parts = []
    for where, total, items in (
        (plan.device, plan.device_bytes, [(name, device) for name, device, _ in plan.items]),
        ("host", plan.host_bytes, [(name, host) for name, _, host in plan.items]),
    ):
        held = ", ".join(f"{name} {human_size(size)}" for name, size in items if size)
        if held:
            parts.append(f"{where} {human_size(total)} ({held})")
    return "memory: " + "; ".join(parts)


def print_setup(console: Console, plan: MemoryPlan, drafter: str | None) -> None:
    """The lines before a generation: what it holds and where, the drafter (where a tier drafts) and the colour of
    each tier's tokens."""
    print_note(console, memory_plan_line(plan))
    if drafter:
        print_note(console, f"drafter: {drafter}")
    console.print(tier_legend())


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
    """A progress bar per model while the prompt is prefilled, at a terminal: elsewhere a bar that vanishes when done
    would only leave blank lines (one more for every question of a scripted chat)."""

    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("prefill {task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.completed}/{task.total} tokens"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
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


def _prefill_source(stats: GenerationStats) -> str:
    """What the prefill line adds about where the prompt's keys and values came from."""
    if stats.prompt_cached:
        return " (restored from the prompt cache)"
    if stats.reused_tokens:
        return f" ({stats.reused_tokens} prompt tokens kept from an earlier prompt and its answer, the rest prefilled)"
    return ""


def summary_table(stats: GenerationStats) -> Table:
    """The generation's figures, one per row; compiling the decode steps, timed apart, only where it happened."""
    table = Table(title="generation", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("mode", stats.mode),
        ("drafter", stats.drafter or "-"),
        ("prompt tokens", str(stats.prompt_tokens)),
        ("prefill", f"{stats.prefill_seconds:.2f} s" + _prefill_source(stats)),
    ]
    if stats.compile_seconds:
        rows.append(("compile", f"{stats.compile_seconds:.2f} s (decode steps, before the prefill)"))
    rows += [
        ("new tokens", str(stats.new_tokens)),
        ("per-token latency", f"{stats.ms_per_token:.1f} ms (median step {stats.median_ms_per_token:.1f} ms)"),
        ("throughput", f"{stats.tokens_per_second:.1f} tokens/s"),
        ("stopped by", stats.stop_reason),
    ]
    for name, value in rows:
        table.add_row(name, Text(value))
    return table


def tier_pair(proposer: str, verifier: str) -> Text:
    """'drafter → retrieval', each tier in its colour."""
    return Text.assemble((proposer, TIER_STYLES.get(proposer, "")), " → ", (verifier, TIER_STYLES.get(verifier, "")))


def acceptance_table(stats: GenerationStats) -> Table | None:
    """Per pair of tiers: verifications, drafts accepted, the rate, α (per judged draft, see
    AcceptanceStats.judged_acceptance_rate) and the tokens each verification gained."""
    if not stats.acceptance:
        return None
    table = Table(title="acceptance per tier", title_justify="left")
    for column in ("proposer → verifier", "passes", "accepted", "rate", "α", "tokens/pass"):
        table.add_column(column, justify="left" if column.startswith("proposer") else "right")
    for a in stats.acceptance:
        table.add_row(
            tier_pair(a.proposer, a.verifier),
            str(a.verifications),
            f"{a.accepted} of {a.drafted}",
            f"{a.acceptance_rate:.0%}",
            f"{a.judged_acceptance_rate:.0%}",
            f"{a.mean_accepted_length:.2f}",
        )
    return table


def print_summary(console: Console, stats: GenerationStats) -> None:
    """The generation table, the acceptance per tier, and a line for each tier whose policy dropped drafting."""
    console.print(summary_table(stats))
    table = acceptance_table(stats)
    if table is not None:
        console.print(table)
    for note in filter(None, (costs.note for costs in stats.tier_costs)):
        print_note(console, note)


def first_token_seconds(stats: GenerationStats) -> float:
    """How long the generation's first token took: compiling the decode steps (where it happened), the prefill and
    the first sample."""
    return stats.compile_seconds + stats.prefill_seconds


def answer_line(stats: GenerationStats) -> str:
    """One line after a chat answer: its tokens, the wait for the first, the pace after it and why it stopped."""
    pace = f", then {stats.ms_per_token:.1f} ms per token" if stats.decoded_tokens else ""
    first = first_token_seconds(stats)
    return f"{stats.new_tokens} tokens: the first after {first:.2f} s{pace}; stopped by {stats.stop_reason}"


FLOOR_BOUNDS = {"read": "read", "arithmetic": "arith"}  # what sets a floor, in its column


def _figure(value: float) -> str:
    """One decimal, or two significant digits below 1 (a tiny model's floor)."""
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def _ratio(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None else "-"


def bench_header(machine: dict, target: LoadedModel) -> Text:
    """The lines above the bench tables: the CPU, its vector extensions and the threads (from machine_description);
    the target, its weight form and, for a GGUF file, the types its weight matrices hold."""
    features = ", ".join(machine["cpu_features"]) or "none (no AVX2)"
    line = f"CPU: {machine['processor']}, vector extensions {features}; {machine['torch_threads']} threads"
    weights = f"target: {target.name}, {target.weights} weights"
    if target.file_types:
        weights += f"; its GGUF file holds {describe_types(target.file_types)}"
        expanded = expanded_types(target.file_types) if target.weights == WeightForm.GGUF else {}
        if expanded:
            weights += f" ({describe_types(expanded)} computed from float32 copies)"
    return Text(f"{line}\n{weights}")


def bench_tables(rows: list[BenchRow]) -> list[Table]:
    """Per prompt and context, a table of ms per token and one of the seconds a user waits (each fits 80 columns);
    then one of the acceptance per mode; where there are several prompts, one of the ratios to autoregressive over
    them."""
    tables = []
    settings = {}  # mode -> the retrieval settings and policies its rows ran
    for r in rows:
        settings.setdefault(r.mode, set()).add((r.budget, r.chunk_size, r.gamma_policy))
    swept = any(len(variants) > 1 for variants in settings.values())
    for prompt, context in dict.fromkeys((r.prompt, r.context) for r in rows):
        group = [r for r in rows if (r.prompt, r.context) == (prompt, context)]
        tables += [_latency_table(group, swept), _waiting_table(group, swept)]
    accepted = [r for r in rows if r.acceptance]
    if accepted:
        table = Table(title="acceptance per tier (last repeat)", title_justify="left")
        table.add_column("mode")
        table.add_column("tiers: accepted of drafted per pass (α, tokens per pass)")
        for row in accepted:
            table.add_row(_mode_cell(row, swept), Text(acceptance_text(row)))
        tables.append(table)
    summaries = over_prompts(rows)
    if summaries:
        tables.append(_over_prompts_table(summaries, swept))
    return tables


def qa_tables(rows: list[QARow]) -> list[Table]:
    """Per document and context, the seconds to each answer by mode and question (medians over the repeats, with
    their range), what each prompt reused, and the ratios the QA scenario is judged by."""
    tables = []
    for document, context in dict.fromkeys((r.document, r.context) for r in rows):
        group = [r for r in rows if (r.document, r.context) == (document, context)]
        llama_cpp = any(r.answer_vs_llama_cpp is not None for r in group)
        columns = ("mode", "q", "reused", "first s", "answer s", "start", "=AR")
        title = f"{document}, {context} tokens, questions in turn: seconds, median over repeats"
        columns = (*columns[:-1], *(("/llama.cpp",) if llama_cpp else ()), columns[-1])
        table = Table(title=Text(title), title_justify="left")
        for column in columns:
            table.add_column(Text(column), justify="left" if column == "mode" else "right")
        for row in group:
            table.add_row(
                Text(row.mode) if row.question == 1 else Text(""),
                str(row.question),
                str(row.reused_tokens),
                f"{row.median_first_token_seconds:.2f}",
                f"{row.median_answer_seconds:.2f}",
                "-" if row.start_vs_first_answer is None else f"{row.start_vs_first_answer:.1%}",
                *((_ratio(row.answer_vs_llama_cpp),) if llama_cpp else ()),
                {True: "yes", False: Text("NO", style="red"), None: "-"}[row.matches_autoregressive],
            )
        first = "first: seconds to the first token (question 1: the document's prefill too)"
        notes = [f"reused: prompt tokens kept from before; {first}; start: first over question 1's"]
        if llama_cpp:
            notes.append("/llama.cpp: the whole answer's time over llama.cpp's for the same question")
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
        tables.append(table)
    return tables


def _over_prompts_table(summaries: list[OverPrompts], swept: bool) -> Table:
    """Per context and mode, the median over the prompts of the ratio to autoregressive, and its range."""
    prompts = len(dict.fromkeys(p for s in summaries for p in s.prompts))
    table = Table(title=Text(f"×AR, median [min-max] over {prompts} prompts"), title_justify="left")
    for column in ("context", "mode", "×AR", "[min-max]"):
        table.add_column(Text(column), justify="left" if column == "mode" else "right")
    for summary in summaries:
        table.add_row(
            str(summary.context),
            _mode_cell(summary, swept),
            _ratio(summary.median_speedup_vs_autoregressive),
            f"{summary.min_speedup_vs_autoregressive:.2f}-{summary.max_speedup_vs_autoregressive:.2f}",
        )
    return table


def _latency_table(rows: list[BenchRow], swept: bool) -> Table:
    """Median and range of ms per token, and the ratios of the medians; ×llama.cpp where llama.cpp ran."""
    llama_cpp = any(r.speedup_vs_llama_cpp is not None for r in rows)
    title = f"{rows[0].prompt}, {rows[0].context} tokens: ms per token, median [min-max] over repeats"
    table = Table(title=Text(title), title_justify="left")
    columns = ("mode", "ms/token", "[min-max]", "×AR", "×HF", *(("×llama.cpp",) if llama_cpp else ()), "=AR")
    for column in columns:
        table.add_column(Text(column), justify="left" if column == "mode" else "right")  # Text: no markup
    for row in rows:
        table.add_row(
            _mode_cell(row, swept),
            f"{row.median_ms:.1f}",
            f"{row.min_ms:.1f}-{row.max_ms:.1f}",
            _ratio(row.speedup_vs_autoregressive),
            _ratio(row.speedup_vs_hf),
            *((_ratio(row.speedup_vs_llama_cpp),) if llama_cpp else ()),
            {True: "yes", False: Text("NO", style="red"), None: "-"}[row.matches_autoregressive],
        )
    return table


def _waiting_table(rows: list[BenchRow], swept: bool) -> Table:
    """Seconds of prefill, to the first token and to the whole answer; where our prefill was loaded from the prompt
    cache, all three count the load instead, and say so."""
    llama_cpp = any(r.answer_time_vs_llama_cpp is not None for r in rows)
    title = f"{rows[0].prompt}, {rows[0].context} tokens: seconds a user waits, median over repeats"
    table = Table(title=Text(title), title_justify="left")
    columns = ("mode", "prefill s", "first token s", "answer s", *(("vs llama.cpp",) if llama_cpp else ()))
    for column in columns:
        table.add_column(Text(column), justify="left" if column == "mode" else "right")
    for row in rows:
        mark = "*" if row.prompt_cached else ""
        table.add_row(
            _mode_cell(row, swept),
            f"{row.prefill_seconds:.2f}{mark}",
            _seconds(row.time_to_first_token_seconds, mark),
            _seconds(row.time_to_answer_seconds, mark),
            *((_ratio(row.answer_time_vs_llama_cpp),) if llama_cpp else ()),
        )
    notes = []
    if any(r.prompt_cached for r in rows):
        notes.append("* prefill restored from --prompt-cache: the time to load it, not to prefill")
    if llama_cpp:
        notes.append("vs llama.cpp: time to answer as a multiple of llama.cpp's")
    table.caption = "\n".join(notes) or None
    table.caption_justify = "left"
    return table


def _seconds(value: float | None, mark: str) -> str:
    return f"{value:.2f}{mark}" if value is not None else "-"


def _mode_cell(row: BenchRow | OverPrompts, swept: bool) -> Text:
    """The mode, and where budgets, chunk sizes or policies are swept, which of them the row ran."""
    if not swept or not (row.chunk_size or row.gamma_policy):
        return Text(row.mode)
    settings = [f"{row.budget or 'auto'}/{row.chunk_size}" if row.chunk_size else "", row.gamma_policy or ""]
    return Text(f"{row.mode} {' '.join(s for s in settings if s)}")


def forward_cost_table(costs: list[ForwardCost]) -> Table:
    """One line per prompt, context and cache; the cost of T tokens also as a multiple of one token's, and beside
    it the floor (bench.forward_costs.ForwardFloor): the megabytes the forward must read, the floor in ms with what
    sets it (reading them, or the arithmetic), and the cost as a multiple of the floor; then the read bandwidth
    measured beside the forwards and the cost as a multiple of the floor at that rate (ForwardCost.moment_floor)."""
    title = "one forward of T new tokens (the target on the full and retrieval caches, the drafter on its own), ms"
    table = Table(title=Text(f"{title} (median [min-max])"), title_justify="left")
    columns = ("prompt", "context", "cache", "T", "ms", "[min-max]", "×T=1", "MB read", "floor ms", "×floor")
    columns += ("GB/s now", "×floor now")
    for column in columns:
        table.add_column(Text(column), justify="left" if column in ("prompt", "cache") else "right")
    single = {(c.prompt, c.context, c.cache): c.median_ms for c in costs if c.tokens == 1}
    for cost in costs:
        one = single.get((cost.prompt, cost.context, cost.cache))
        floor = cost.floor
        table.add_row(
            Text(cost.prompt),
            str(cost.context),
            cost.cache,
            str(cost.tokens),
            f"{cost.median_ms:.1f}",
            f"{cost.min_ms:.1f}-{cost.max_ms:.1f}",
            _ratio(cost.median_ms / one if one else None),
            "-" if floor is None else _figure((floor.weight_bytes + floor.kv_bytes) / 1e6),
            "-" if floor is None else f"{_figure(floor.ms)} {FLOOR_BOUNDS[floor.bound]}",
            _ratio(cost.over_floor),
            "-" if cost.moment_bandwidth is None else f"{cost.moment_bandwidth / 1e9:.1f}",
            _ratio(cost.over_moment_floor),
        )
    return table
