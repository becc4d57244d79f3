"""This CPU's rates for the floors of `triforce bench --forward-costs`, measured once and kept beside the measured
set-ups (decoding.tuning: the same folder and machine key; `triforce cache clear --measurements` forgets both).

- read bandwidth: plan.measure.read_bandwidth, the best of a few sums over a 256 MiB float32 tensor on huge pages;
- arithmetic rate: plan.measure.peak_flops, the best of a few runs of independent float32 FMA chains (the most
  arithmetic the vector units do: every kernel of a CPU forward, GGUF and half weights included, computes in
  float32), and beside it plan.measure.matmul_flops, the best of a few float32 products of two 2048 x 2048 matrices
  (what torch's GEMM reaches); a floor divides by the peak where the extension measured it, else by the product's;
all on every physical core, and the FMA peak on one core too. Rates taken while other programs used more than
tuning.BUSY_SHARE of the CPU, or while the cores together computed less than SHARED_CORES of their number times one
core's peak (something this system does not see, another virtual machine on the same host, took part of them: its
processes use no CPU here), serve the run that measured them and are not kept.
"""

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from triforce_cli.decoding.tuning import BUSY_SHARE, measured_conditions
from triforce_cli.plan.measure import matmul_flops, peak_flops, read_bandwidth
from triforce_cli.runtime.environment import (
    cpu_description,
    cpu_sample,
    load_average,
    others_share,
    physical_cores,
    torch_threads,
)
from triforce_cli.runtime.loading import StatusCallback
from triforce_cli.runtime.measurements import MACHINE_RATES_FILE, kept_machine_rates, machine_key, tuning_folder
from triforce_cli.runtime.store import mark_used, write_atomically

SHARED_CORES = 0.8  # the cores' FMA peak together under this share of their number times one core's: not kept


@dataclass
class MachineRates:
    """What a forward's floor divides by: this CPU's read bandwidth and float32 arithmetic rate, and the conditions
    they were measured in."""

    cpu: str
    machine: str  # tuning.machine_key() where they were measured
    read_bandwidth: float  # bytes/s
    flops: float  # float32 FLOP/s of a matrix product
    peak_flops: float | None  # float32 FLOP/s of FMA chains (plan.measure.peak_flops), None without the extension
    core_peak_flops: float | None  # the same on one core
    threads: int  # torch threads while measuring: every physical core
    measured: str  # UTC date and time
    load: float | None  # one-minute load average when the measurement began
    others_share: float | None  # share of the CPU other programs used while measuring

    @property
    def arithmetic_rate(self) -> float:
        """What a forward's arithmetic floor divides by: the FMA peak where measured, else the matrix product's rate."""
        return self.flops if self.peak_flops is None else self.peak_flops

    @property
    def busy_reason(self) -> str | None:
        """Why the machine was too busy for these rates to be kept, or None."""
        if self.others_share is not None and self.others_share > BUSY_SHARE:
            return f"other programs used {self.others_share:.0%} of the CPU"
        if self.peak_flops and self.core_peak_flops and self.threads > 1:
            scaling = self.peak_flops / (self.threads * self.core_peak_flops)
            if scaling < SHARED_CORES:
                return (
                    f"its {self.threads} cores computed {scaling:.0%} of {self.threads} times one core's rate:"
                    " something outside this system was using them"
                )
        return None

    @property
    def label(self) -> str:
        """The rates in words."""
        peak = "" if self.peak_flops is None else f"float32 FMA peak {self.peak_flops / 1e9:.1f} GFLOP/s, "
        return (
            f"read bandwidth {self.read_bandwidth / 1e9:.1f} GB/s, {peak}float32 matrix product"
            f" {self.flops / 1e9:.1f} GFLOP/s, {self.threads} thread{'s' * (self.threads > 1)}"
        )

    @property
    def conditions(self) -> str:
        return measured_conditions(self.measured, self.load, self.others_share)


def rates_path() -> Path:
    return tuning_folder() / MACHINE_RATES_FILE


def remembered_rates() -> MachineRates | None:
    """The kept rates of this machine, torch and tool, or None (none kept, unreadable, or another machine's)."""
    kept = kept_machine_rates()
    try:
        rates = None if kept is None else MachineRates(**kept)
    except TypeError:
        return None
    if rates is not None:
        mark_used(rates_path())
    return rates


def measure_rates() -> MachineRates:
    """This CPU's rates, measured now on every physical core (the module docstring), and how busy it was."""
    load = load_average()
    before = cpu_sample()
    with torch_threads(physical_cores()):
        bandwidth, flops, peak = read_bandwidth(), matmul_flops(), peak_flops()
        threads = physical_cores()
    with torch_threads(1):
        core_peak = peak_flops()
    share = others_share(before, cpu_sample())
    return MachineRates(
        cpu_description()[0],
        machine_key(),
        bandwidth,
        flops,
        peak,
        core_peak,
        threads,
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        None if load is None else round(load, 2),
        None if share is None else round(share, 3),
    )


def machine_rates(status: StatusCallback | None = None) -> MachineRates:
    """The kept rates of this machine, measuring them the first time; rates measured on a busy machine
    (MachineRates.busy_reason) serve this run and are measured again by the next."""
    kept = remembered_rates()
    if kept is not None:
        return kept
    if status is not None:
        status("measuring this CPU's read bandwidth and arithmetic rate, once (triforce info shows them)")
    rates = measure_rates()
    busy = rates.busy_reason
    if busy is None:
        try:
            rates_path().parent.mkdir(parents=True, exist_ok=True)
            write_atomically(rates_path(), lambda partial: partial.write_text(json.dumps(asdict(rates), indent=2)))
        except OSError:
            pass  # a read-only cache: measured again next time
    elif status is not None:
        status(f"the machine was busy while measuring ({busy}): the rates serve this run and are not kept")
    return rates
