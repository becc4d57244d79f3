"""Where this machine's measurements are kept and what they hold for: the folder of the measured set-ups
(decoding.tuning) and of the machine's rates (plan.rates), and the key naming the machine they were taken on."""

import json
import os
from pathlib import Path

import torch

from triforce_cli.kernels.memory import huge_pages_available
from triforce_cli.runtime.environment import cpu_description, package_version
from triforce_cli.runtime.store import cache_root

MACHINE_RATES_FILE = "machine.json"  # plan.rates' record beside the measured set-ups, not one of them


def tuning_folder() -> Path:
    return cache_root() / "tuning"


def machine_key() -> str:
    """The machine part of what a measurement holds for: the CPU (model, features, cores), whether its memory comes
    on huge pages (kernels.memory: the weights and caches are read faster), torch and this tool."""
    cpu, features = cpu_description()
    pages = "huge pages" if huge_pages_available() else "small pages"
    return f"{cpu}|{','.join(features)}|{os.cpu_count()}|{pages}|{torch.__version__}|{package_version('triforce-cli')}"


def kept_machine_rates() -> dict | None:
    """The record of this machine's rates that plan.rates keeps (its fields as written), or None: none kept, the
    file unreadable, or another machine's, torch's or version's."""
    try:
        kept = json.loads((tuning_folder() / MACHINE_RATES_FILE).read_text())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and kept.get("machine") == machine_key() else None
