"""Rendering and writing `triforce bench` results: a Rich table, JSON or CSV files, and a latency plot."""

import csv
import json
import os
import platform
import sys
from pathlib import Path

import torch
from rich.table import Table
from rich.text import Text

from triforce_cli.bench.forward_costs import ForwardCost
from triforce_cli.bench.runner import BenchRow
from triforce_cli.errors import ConfigError


def machine_description() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def _acceptance_text(row: BenchRow) -> str:
    return ", ".join(
        f"{a['proposer']}→{a['verifier']} {a['acceptance_rate']:.0%} of {a['mean_drafted']:.1f}"
        f" (α {a['judged_acceptance_rate']:.0%}, len {a['mean_accepted_length']:.2f}, {a['verifications']} passes)"
        if a["verifications"]
        else f"{a['proposer']}→{a['verifier']} no passes"
        for a in row.acceptance
    )


def _ratio(value: float | None) -> str:
    return f"{value:.2f}×" if value is not None else "-"


def bench_table(rows: list[BenchRow]) -> Table:
    table = Table(title=Text("per-token decode latency (median over repeats, [min-max])"), title_justify="left")
    for column in (
        "prompt",
        "context",
        "mode",
        "budget/chunk",
        "gammas",
        "prefill s",
        "ms/token",
        "tok/s",
        "vs ours AR",
        "vs HF",
        "greedy = AR",
        "acceptance",
    ):
        table.add_column(column, justify="left" if column in ("prompt", "mode", "acceptance") else "right")
    for row in rows:
        match = {True: "yes", False: "[red]NO[/]", None: "-"}[row.matches_autoregressive]
        table.add_row(
            Text(row.prompt),
            str(row.context),
            row.mode,
            f"{row.budget or 'auto'}/{row.chunk_size}" if row.chunk_size else "-",
            row.gamma_policy or "-",
            f"{row.prefill_seconds:.1f}" + (" (cached)" if row.prompt_cached else ""),
            f"{row.median_ms:.1f} [{min(row.ms_per_token):.1f}-{max(row.ms_per_token):.1f}]",
            f"{row.tokens_per_second:.1f}",
            _ratio(row.speedup_vs_autoregressive),
            _ratio(row.speedup_vs_hf),
            match,
            _acceptance_text(row),
        )
    return table


RESULT_SUFFIXES = (".json", ".csv")


def check_results_path(path: Path | None) -> None:
    """Refuse an --out file of an unknown kind before the bench runs, not after."""
    if path is not None and path.suffix not in RESULT_SUFFIXES:
        raise ConfigError(f"--out must end in .json or .csv, not {path.suffix or 'nothing'}")


def forward_cost_table(costs: list[ForwardCost]) -> Table:
    """One line per prompt, context and cache; the cost of T tokens also as a multiple of one token's."""
    table = Table(title=Text("one target forward of T new tokens (median over repeats, [min-max])"))
    for column in ("prompt", "context", "cache", "T", "ms", "vs T=1"):
        table.add_column(column, justify="left" if column in ("prompt", "cache") else "right")
    single = {(c.prompt, c.context, c.cache): c.median_ms for c in costs if c.tokens == 1}
    for cost in costs:
        one = single.get((cost.prompt, cost.context, cost.cache))
        table.add_row(
            Text(cost.prompt),
            str(cost.context),
            cost.cache,
            str(cost.tokens),
            f"{cost.median_ms:.1f} [{min(cost.ms):.1f}-{max(cost.ms):.1f}]",
            _ratio(cost.median_ms / one if one else None),
        )
    return table


def write_results(rows: list[BenchRow], path: Path, command: str, forward_costs: list[ForwardCost] = ()) -> None:
    """JSON (rows and forward costs with the command and machine) or CSV (one flat line per row), by suffix."""
    check_results_path(path)
    if path.suffix == ".json":
        payload = {
            "command": command,
            "machine": machine_description(),
            "rows": [r.as_dict() for r in rows],
            "forward_costs": [c.as_dict() for c in forward_costs],
        }
        path.write_text(json.dumps(payload, indent=2))
    else:
        with path.open("w", newline="") as handle:
            flat = [{**r.as_dict(), "acceptance": _acceptance_text(r), "repeats_ms_per_token": ""} for r in rows]
            writer = csv.DictWriter(handle, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)


def pyplot():
    """matplotlib's pyplot drawing to files; asked for before a bench runs, so a missing package fails early."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    return plt


def plot_latency(rows: list[BenchRow], path: Path) -> None:
    """PNG of median per-token latency against context length, one line per mode."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r.mode for r in rows):
        points = sorted((r.context, r.median_ms) for r in rows if r.mode == mode)
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("median decode latency (ms/token)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
