"""Writing `triforce bench` results (JSON or CSV, with the command and the machine) and plotting them."""

import csv
import json
from pathlib import Path

from triforce_cli.bench.forward_costs import ForwardCost
from triforce_cli.bench.qa import QARow
from triforce_cli.bench.runner import BenchRow, over_prompts
from triforce_cli.decoding.stats import as_record
from triforce_cli.errors import ConfigError
from triforce_cli.plan.plot import pyplot
from triforce_cli.runtime.environment import machine_description
from triforce_cli.runtime.store import check_writable_file


def acceptance_text(row: BenchRow) -> str:
    return ", ".join(
        f"{a['proposer']}→{a['verifier']} {a['acceptance_rate']:.0%} of {a['mean_drafted']:.1f}"
        f" (α {a['judged_acceptance_rate']:.0%}, len {a['mean_accepted_length']:.2f}, {a['verifications']} passes)"
        if a["verifications"]
        else f"{a['proposer']}→{a['verifier']} no passes"
        for a in row.acceptance
    )


RESULT_SUFFIXES = (".json", ".csv")


def write_qa_results(rows: list[QARow], path: Path, command: str, setup: dict) -> None:
    """The qa scenario's rows as JSON, with the command, the machine and what the run resolved its settings to."""
    payload = {
        "command": command,
        "machine": machine_description(),
        "setup": setup,
        "rows": [as_record(r) for r in rows],
    }
    path.write_text(json.dumps(payload, indent=2))


def check_results_path(path: Path | None) -> None:
    """Refuse an --out file of an unknown kind, or one that cannot be written, before the bench runs, not after."""
    if path is not None and path.suffix not in RESULT_SUFFIXES:
        raise ConfigError(f"`out` must end in .json or .csv, not {path.suffix or 'nothing'}")
    check_writable_file(path, "out")


def write_results(
    rows: list[BenchRow], path: Path, command: str, forward_costs: list[ForwardCost] = (), setup: dict | None = None
) -> None:
    """JSON (rows, their ratios to autoregressive over the prompts where there are several, and forward costs, with
    the command, machine and setup) or CSV (one flat line per row, with the CPU's model and vector extensions), by
    suffix. setup: what the run resolved its automatic settings to (the target's weight form, the threads)."""
    check_results_path(path)
    machine = machine_description()
    if path.suffix == ".json":
        payload = {
            "command": command,
            "machine": machine,
            "setup": setup or {},
            "rows": [as_record(r) for r in rows],
            "speedup_vs_autoregressive_over_prompts": [as_record(o) for o in over_prompts(rows)],
            "forward_costs": [as_record(c) for c in forward_costs],
        }
        path.write_text(json.dumps(payload, indent=2))
    else:
        cpu = {"processor": machine["processor"], "cpu_features": " ".join(machine["cpu_features"])}
        with path.open("w", newline="") as handle:
            flat = [
                {
                    **as_record(r),
                    "acceptance": acceptance_text(r),
                    "repeats_ms_per_token": "",
                    "repeats_new_tokens": " ".join(map(str, r.new_tokens)),
                    **cpu,
                }
                for r in rows
            ]
            writer = csv.DictWriter(handle, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)


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
