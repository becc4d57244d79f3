"""The fastest exact configuration of a target on this CPU: measured the first time, remembered in the cache folder.

Every weight form the target can take here (GGUF blocks, half, dense) computes the same model up to rounding, and
so does every thread count; which is fastest depends on the CPU, its caches and the model. A short measurement
(the target loaded in each form, a prompt prefilled once, plain decoding timed RUNS times at each thread count,
each candidate judged by its fastest run) picks the configuration that `--weights auto` and an unset `--threads`
then use. Compiled steps run dense weights only and
measured slower than eager ones on the CPU (docs/performance.md), so they are measured only where dense weights
come within COMPILE_MARGIN of the best. The choice is kept per CPU, torch and tool version and checkpoint files,
so a changed machine, version or checkpoint is measured anew; `triforce info` lists what is kept; TRIFORCE_TUNING=off uses the
rule of forms.resolve_weights instead.
"""

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.kernels import half_weights_available
from triforce_cli.runtime.environment import (
    cpu_description,
    cpu_sample,
    load_average,
    others_share,
    physical_cores,
)
from triforce_cli.runtime.forms import StepMode, WeightForm, resolve_weights
from triforce_cli.runtime.loading import Checkpoint, StatusCallback, load_model
from triforce_cli.runtime.measurements import MACHINE_RATES_FILE, machine_key, tuning_folder
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.store import content_identity, mark_used, remove, write_atomically

TUNING_ENV = "TRIFORCE_TUNING"  # "off": no measurement, forms.resolve_weights' rule
PROMPT_TOKENS = 512
NEW_TOKENS = 8
# Timed generations per candidate, the thread counts taken in turn. Many short runs judged by their fastest: a quiet
# but jittery machine (a virtual one) slows some runs by a quarter or more, never speeds one up, and leaves most of
# them near the fastest, where a busy program beside the measurement slows most of them.
RUNS = 7
CLEAR_MARGIN = 0.05  # fewer decode threads than cores only where faster by this much in every one of the RUNS
COMPILE_MARGIN = 1.25  # compiled dense steps are measured only where eager dense ones come this close to the best
BUSY_SHARE = 0.15  # other programs using more of the CPU than this while measuring: the measurement is not kept
MAX_SPREAD = 0.25  # the chosen set-up's median run more than this above its fastest (spread): not kept
SLOW_FACTOR = 1.5  # a run's prefill this much slower than the measurement's: a note says so


@dataclass(frozen=True)
class Choice:
    weights: str
    threads: int  # decode threads; prefill runs on every physical core
    compiled: bool = False  # decode steps compiled by inductor (StepMode 'compiled'), else eager

    @property
    def steps(self) -> StepMode:
        """The step mode this choice runs with."""
        return StepMode.COMPILED if self.compiled else StepMode.EAGER

    @property
    def label(self) -> str:
        return f"{self.weights} weights, {self.threads} thread{'s' * (self.threads > 1)}, compile {'on' if self.compiled else 'off'}"


@dataclass
class Tuning:
    """A measurement of one target on this machine: the choice, what each candidate measured, and the conditions."""

    target: str
    cpu: str
    choice: Choice
    ms_per_token: dict[str, float]  # Choice.label -> ms per token of plain decoding, the fastest of RUNS
    measured: str  # UTC date and time
    machine: str  # machine_key() where it was measured
    files: list[str]  # the checkpoint's files it was measured on (gone: the measurement is dropped)
    load: float | None  # one-minute load average when the measurement began
    others_share: float | None  # share of the CPU other programs used while measuring
    spread: float  # the chosen set-up's median of RUNS over its fastest, minus 1 (steady_spread)
    prefill_chunk_ms: list[float]  # the PROMPT_TOKENS prefill in the chosen form, ms per prefill chunk

    @classmethod
    def from_record(cls, record: dict) -> "Tuning":
        return cls(**{**record, "choice": Choice(**record["choice"])})

    @property
    def busy_reason(self) -> str | None:
        """Why the machine was too busy for this measurement to be kept, or None."""
        if self.others_share is not None and self.others_share > BUSY_SHARE:
            return f"other programs used {self.others_share:.0%} of the CPU"
        if self.spread > MAX_SPREAD:
            return f"the median of repeated timings lay {self.spread:.0%} above the fastest"
        return None

    @property
    def conditions(self) -> str:
        """When and under what load it was measured, in words."""
        spread = f", median repeat within {self.spread:.0%} of the fastest"
        return measured_conditions(self.measured, self.load, self.others_share) + spread


def measured_conditions(measured: str, load: float | None, others_share: float | None) -> str:
    """When a measurement was taken and, where known, the load average and other programs' share of the CPU."""
    load_text = "" if load is None else f", load average {load:.2f}"
    others = "" if others_share is None else f", other programs {others_share:.0%} of the CPU"
    return f"measured {measured}{load_text}{others}"


def tuning_enabled() -> bool:
    return os.environ.get(TUNING_ENV, "").lower() not in ("off", "0", "no")


def checkpoint_files(checkpoint: Checkpoint) -> list[Path]:
    return [*checkpoint.weight_files, *([checkpoint.gguf] if checkpoint.gguf else [])]


def tuning_key(checkpoint: Checkpoint) -> str:
    """What a measurement holds for: machine_key and the content of the checkpoint's files (the same file installed
    in two places is one checkpoint)."""
    digest = hashlib.sha256(machine_key().encode())
    for path in checkpoint_files(checkpoint):
        digest.update(f"|{content_identity(path)}".encode())
    return digest.hexdigest()[:24]


def tuning_path(checkpoint: Checkpoint) -> Path:
    """Where the measurement of checkpoint on this machine is kept."""
    return tuning_folder() / f"{tuning_key(checkpoint)}.json"


def checkpoint_paths(checkpoint: Checkpoint) -> list[str]:
    """The checkpoint's files as the measurement records them: resolved paths."""
    return [str(f.resolve()) for f in checkpoint_files(checkpoint)]


def _read(path: Path) -> Tuning | None:
    try:
        return Tuning.from_record(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _keep(path: Path, tuning: Tuning) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda partial: partial.write_text(json.dumps(asdict(tuning), indent=2)))
    except OSError:
        pass  # a read-only cache: measured again next time


def remembered(checkpoint: Checkpoint) -> Tuning | None:
    """The kept measurement for checkpoint on this machine, or None (none kept, or unreadable). A copy of the
    checkpoint found at a path the measurement does not list yet is added to it."""
    path = tuning_path(checkpoint)
    tuning = _read(path)
    if tuning is None:
        return None
    here = checkpoint_paths(checkpoint)
    if not set(here) <= set(tuning.files):
        tuning.files = [*tuning.files, *(f for f in here if f not in tuning.files)]
        _keep(path, tuning)
    mark_used(path)
    return tuning


def remembered_tunings() -> list[Tuning]:
    """Every kept measurement that holds for this machine, torch and tool, newest first. Measurements no run can use
    any more are removed on the way: of checkpoints whose files are all gone, and records that cannot be read (an
    earlier layout)."""
    kept = []
    for path in sorted(tuning_folder().glob("*.json")):
        if path.name == MACHINE_RATES_FILE:
            continue
        tuning = _read(path)
        if tuning is None or not any(Path(f).exists() for f in tuning.files):
            remove(path)
        elif tuning.machine == machine_key():
            kept.append(tuning)
    return sorted(kept, key=lambda t: t.measured, reverse=True)


def thread_counts() -> list[int]:
    cores = physical_cores()
    return sorted({1, max(1, cores // 2), cores})


def weight_forms(checkpoint: Checkpoint) -> list[str]:
    """The forms the target can take on this CPU in float32, most compact first."""
    forms = [WeightForm.GGUF] if checkpoint.gguf is not None and kernel_error() is None else []
    return [*forms, *([WeightForm.HALF] if half_weights_available() else []), WeightForm.DENSE]


def rule_choice(checkpoint: Checkpoint) -> Choice:
    """What a run uses without a kept measurement: forms.resolve_weights' rule, every physical core."""
    weights = resolve_weights("auto", torch.float32, torch.device("cpu"), gguf_source=checkpoint.gguf is not None)
    return Choice(weights, physical_cores())


def _decode_ms(engine: Engine, prompt: list[int], state) -> float:
    """ms per token of plain decoding after the prefilled prompt."""
    return engine.generate(prompt, prompt_state=state).stats.ms_per_token


def steady_spread(times: list[float]) -> float:
    """How far the median of repeated timings lies above the fastest (0.1: 10%); the lower median of an even count.
    Occasional slow runs, which a quiet virtual machine has, leave it small; a program busy beside the measurement,
    which slows most runs, does not."""
    return statistics.median_low(times) / min(times) - 1


def _decode_threads(runs: dict[int, list[float]]) -> int:
    """Decode threads for one weight form, from its RUNS per thread count (taken in turn): every physical core,
    unless fewer were faster by CLEAR_MARGIN in every one of the runs (then the fastest such count by its fastest
    run)."""
    cores = max(runs)
    clear = [
        threads
        for threads, times in runs.items()
        if all(t * (1 + CLEAR_MARGIN) < base for t, base in zip(times, runs[cores], strict=True))
    ]
    return min(clear, key=lambda threads: min(runs[threads]), default=cores)


def measure(spec: str | None, checkpoint: Checkpoint) -> Tuning:
    """Time plain decoding of the target RUNS times in every weight form and thread count (and compiled, where dense
    weights come close): the form whose decode threads (_decode_threads) ran fastest is the choice. Also notes how busy the
    machine was meanwhile (Tuning.busy_reason) and how long the chosen form's prefill took."""
    config = EngineConfig(
        mode="autoregressive", max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=SamplingConfig(temperature=0)
    )
    threads_before = torch.get_num_threads()
    load = load_average()
    before = cpu_sample()
    runs: dict[Choice, list[float]] = {}
    prefill_ms: dict[str, list[float]] = {}
    try:
        for weights in weight_forms(checkpoint):
            loaded = load_model(spec, weights=weights, checkpoint=checkpoint)
            generator = torch.Generator().manual_seed(0)
            cfg = loaded.model.config
            length = min(PROMPT_TOKENS, cfg.max_position_embeddings - NEW_TOKENS)
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=generator).tolist()
            engine = Engine(loaded, config, prefill_threads=physical_cores())
            chunk_seconds: list[float] = []
            state = engine.prefill(prompt, on_chunk=chunk_seconds.append)
            prefill_ms[weights] = [round(seconds * 1e3, 2) for seconds in chunk_seconds]
            for _ in range(RUNS):
                for threads in thread_counts():
                    torch.set_num_threads(threads)
                    runs.setdefault(Choice(weights, threads), []).append(_decode_ms(engine, prompt, state))
            if weights == WeightForm.DENSE:
                best = min(min(times) for times in runs.values())
                dense = {c.threads: times for c, times in runs.items() if c.weights == WeightForm.DENSE}
                threads = _decode_threads(dense)
                if min(dense[threads]) <= COMPILE_MARGIN * best:
                    torch.set_num_threads(threads)
                    loaded.model.compile_steps()
                    engine = Engine(loaded, config)
                    runs[Choice(WeightForm.DENSE, threads, compiled=True)] = [
                        _decode_ms(engine, prompt, state) for _ in range(RUNS)
                    ]
    finally:
        torch.set_num_threads(threads_before)
    after = cpu_sample()
    candidates = [c for c in runs if c.compiled] + [
        Choice(form, _decode_threads({c.threads: t for c, t in runs.items() if c.weights == form and not c.compiled}))
        for form in prefill_ms
    ]
    choice = min(candidates, key=lambda c: min(runs[c]))
    cpu, _ = cpu_description()
    return Tuning(
        checkpoint.name,
        cpu,
        choice,
        {c.label: round(min(t), 2) for c, t in sorted(runs.items(), key=lambda r: min(r[1]))},
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine_key(),
        checkpoint_paths(checkpoint),
        None if load is None else round(load, 2),
        None if (share := others_share(before, after)) is None else round(share, 3),
        round(steady_spread(runs[choice]), 3),
        prefill_ms[choice.weights],
    )


def fastest_configuration(spec: str | None, checkpoint: Checkpoint, status: StatusCallback | None = None) -> Tuning:
    """The kept measurement for the target on this machine, measuring it the first time. A measurement taken while
    the machine was busy (Tuning.busy_reason) is not kept: the run takes rule_choice, and the next run measures
    again."""
    kept = remembered(checkpoint)
    if kept is not None:
        return kept
    if status is not None:
        status(f"measuring the fastest configuration for {checkpoint.name} on this CPU, once (triforce info shows it)")
    tuning = measure(spec, checkpoint)
    busy = tuning.busy_reason
    if busy is None:
        _keep(tuning_path(checkpoint), tuning)
        if status is not None:
            status(f"fastest here: {tuning.choice.label}")
        return tuning
    tuning.choice = rule_choice(checkpoint)
    if status is not None:
        status(
            f"the machine was busy while measuring ({busy}): not kept; this run takes {tuning.choice.label}"
            " by rule, and the next run measures again"
        )
    return tuning


def slower_than_measured(tuning: Tuning, chunk_seconds: list[float]) -> str | None:
    """A note where a run's first prefill chunks took SLOW_FACTOR times what they took when the set-up was
    measured (the same chunks of the same model on the same cores), saying what to do; None otherwise, and for a
    measurement taken on a busy machine, which was not kept and is no yardstick."""
    measured = tuning.prefill_chunk_ms
    if tuning.busy_reason is not None or not measured or len(chunk_seconds) < len(measured):
        return None
    ratio = sum(chunk_seconds[: len(measured)]) * 1e3 / sum(measured)
    if ratio < SLOW_FACTOR:
        return None
    return (
        f"this machine ran {ratio:.1f}x slower than when its set-up was measured ({tuning.measured}): another program"
        " may be busy; if it stays slow on a quiet machine, `triforce cache clear --measurements` measures again"
    )
