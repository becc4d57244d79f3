"""`triforce info`: the machine, the versions, and what a run would choose on each device, and why."""

import json
from dataclasses import asdict

from rich.table import Table
from rich.text import Text

from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.decoding.tuning import Tuning, remembered_tunings
from triforce_cli.plan.rates import MachineRates, remembered_rates
from triforce_cli.runtime.environment import describe_environment
from triforce_cli.runtime.store import human_size

NOT_THERE = {"cuda": "none (a CPU build of torch)"}


def info(json_output: o.JsonOutput = False) -> None:
    """Devices, memory, versions, the attention kernels, dtype and weights each device would use, and the cache."""
    with command_console(json_output=json_output):
        facts = describe_environment()
        facts["tuned"] = [asdict(kept) for kept in remembered_tunings()]
        rates = remembered_rates()
        facts["rates"] = None if rates is None else asdict(rates)
        if json_output:
            print(json.dumps(facts))
            return
        out = StdoutConsole(highlight=False)
        cpu = facts["cpu"]
        machine = Table(title="machine", show_header=False, title_justify="left")
        machine.add_column(style="bold")
        machine.add_column(overflow="fold")
        rows = [
            ("CPU", f"{cpu['model']}, {cpu['cores']} cores ({', '.join(cpu['features']) or 'no AVX2'})"),
            ("torch threads", str(cpu["torch_threads"])),
            ("memory", human_size(facts["memory_bytes"]) if facts["memory_bytes"] else "-"),
            *((f"GPU {gpu['index']}", f"{gpu['name']}, {human_size(gpu['memory_bytes'])}") for gpu in facts["cuda"]),
            ("GPU", "none found" if not facts["cuda"] else f"CUDA {facts['versions']['cuda']}"),
            *((name, version or NOT_THERE.get(name, "not installed")) for name, version in facts["versions"].items()),
            ("embedded model", facts["embedded_model"]),
            ("cache", f"{facts['cache_folder']}: {human_size(facts['cache_bytes'])}, limit "
             + (human_size(facts["cache_limit_bytes"]) if facts["cache_limit_bytes"] else "none")),
        ]  # fmt: skip
        for name, value in rows:
            machine.add_row(name, Text(value))
        out.print(machine)
        runs = Table(title="what a run picks with every setting at auto", title_justify="left")
        for column in ("device", "dtype", "weights", "attention", "steps"):
            runs.add_column(column)
        for run in facts["runs"]:
            runs.add_row(run["device"], run["dtype"], run["weights"], run["attention"], run["steps"])
        out.print(runs)
        for run in facts["runs"]:
            out.print(Text(f"{run['device']}: attention {run['attention']}: {run['attention_reason']}", style="dim"))
        for run in facts["runs"]:
            out.print(Text(f"{run['device']}: steps {run['steps_reason']}", style="dim"))
        if facts["tuned"]:
            out.print(
                Text("measured fastest on this CPU (what --weights auto and an unset --threads use):", style="bold")
            )
        for kept in map(Tuning.from_record, facts["tuned"]):
            out.print(Text(f"{kept.target}: {kept.choice.label}"))
            print_note(out, f"  {kept.conditions}")
            candidates = "; ".join(f"{label} {ms:g}" for label, ms in kept.ms_per_token.items())
            print_note(out, f"  ms/token of plain decoding: {candidates}")
        if not facts["tuned"]:
            out.print(
                Text("nothing measured yet: a target's first run on the CPU measures its fastest set-up", style="dim")
            )
        if facts["rates"] is None:
            out.print(
                Text(
                    "rates for the floors not measured yet: `triforce bench --forward-costs` measures them", style="dim"
                )
            )
        else:
            rates = MachineRates(**facts["rates"])
            out.print(Text("this CPU's rates for the floors of `triforce bench --forward-costs`:", style="bold"))
            out.print(Text(rates.label))
            print_note(out, f"  {rates.conditions}")
