"""The fastest exact configuration of a target on this CPU: measured the first time, remembered in the cache folder.

Every weight form the target can take here (GGUF blocks, half, dense) computes the same model up to rounding, and
so does every thread count; which is fastest depends on the CPU, its caches and the model. A short measurement
(the target loaded in each form, a prompt prefilled once, plain decoding timed at each thread count) picks the
configuration that `--weights auto` and an unset `--threads` then use. Compiled steps run dense weights only and
measured slower than eager ones on the CPU (docs/performance.md), so they are measured only where dense weights
come within COMPILE_MARGIN of the best. The choice is kept per CPU, torch and tool version and checkpoint files,
so a changed machine, version or checkpoint is measured anew; `triforce info` lists what is kept; TRIFORCE_TUNING=off uses the
rule of loading.resolve_weights instead.
"""

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels import half_weights_available
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.runtime.environment import cpu_description, package_version
from triforce_cli.runtime.loading import Checkpoint, StatusCallback, load_model
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.store import cache_root

TUNING_ENV = "TRIFORCE_TUNING"  # "off": no measurement, loading.resolve_weights' rule
PROMPT_TOKENS = 512
NEW_TOKENS = 16
RUNS = 3  # timed generations per candidate, the thread counts taken in turn; the fastest counts (another program
# busy on the machine only ever slows a run down)
COMPILE_MARGIN = 1.25  # compiled dense steps are measured only where eager dense ones come this close to the best


@dataclass(frozen=True)
class Choice:
    weights: str
    threads: int
    compiled: bool = False

    @property
    def label(self) -> str:
        return f"{self.weights} weights, {self.threads} thread{'s' * (self.threads > 1)}, compile {'on' if self.compiled else 'off'}"


@dataclass
class Tuning:
    target: str
    cpu: str
    choice: Choice
    ms_per_token: dict[str, float]  # Choice.label -> ms per token of plain decoding, the fastest of RUNS
    measured: str  # UTC date and time
    machine: str  # machine_key() where it was measured

    @classmethod
    def from_record(cls, record: dict) -> "Tuning":
        return cls(**{**record, "choice": Choice(**record["choice"])})


def tuning_enabled() -> bool:
    return os.environ.get(TUNING_ENV, "").lower() not in ("off", "0", "no")


def tuning_folder() -> Path:
    return cache_root() / "tuning"


def machine_key() -> str:
    """The machine part of what a measurement holds for: the CPU (model, features, cores), torch and this tool."""
    cpu, features = cpu_description()
    return f"{cpu}|{','.join(features)}|{os.cpu_count()}|{torch.__version__}|{package_version('triforce-cli')}"


def tuning_key(checkpoint: Checkpoint) -> str:
    """What a measurement holds for: machine_key and the checkpoint's files as they are."""
    digest = hashlib.sha256(machine_key().encode())
    for path in (*checkpoint.weight_files, *([checkpoint.gguf] if checkpoint.gguf else [])):
        stat = path.stat()
        digest.update(f"|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def remembered(checkpoint: Checkpoint) -> Tuning | None:
    """The kept measurement for checkpoint on this machine, or None (none kept, or unreadable)."""
    try:
        return Tuning.from_record(json.loads((tuning_folder() / f"{tuning_key(checkpoint)}.json").read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remembered_tunings() -> list[Tuning]:
    """Every kept measurement that holds for this machine, torch and tool, newest first."""
    kept = []
    for path in sorted(tuning_folder().glob("*.json")):
        try:
            tuning = Tuning.from_record(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if tuning.machine == machine_key():
            kept.append(tuning)
    return sorted(kept, key=lambda t: t.measured, reverse=True)


def thread_counts() -> list[int]:
    cores = os.cpu_count() or 1
    return sorted({1, max(1, cores // 2), cores})


def weight_forms(checkpoint: Checkpoint) -> list[str]:
    """The forms the target can take on this CPU in float32, most compact first."""
    forms = ["gguf"] if checkpoint.gguf is not None and kernel_error() is None else []
    return [*forms, *(["half"] if half_weights_available() else []), "dense"]


def _decode_ms(engine: Engine, prompt: list[int], state) -> float:
    """ms per token of plain decoding after the prefilled prompt."""
    return engine.generate(prompt, prompt_state=state).stats.ms_per_token


def measure(spec: str | None, checkpoint: Checkpoint) -> Tuning:
    """Time plain decoding of the target in every weight form and thread count (and compiled, where dense weights
    come close); the fastest is the choice."""
    config = EngineConfig(
        mode="autoregressive", max_new_tokens=NEW_TOKENS, ignore_eos=True, sampling=SamplingConfig(temperature=0)
    )
    threads_before = torch.get_num_threads()
    timings: dict[Choice, float] = {}
    try:
        for weights in weight_forms(checkpoint):
            loaded = load_model(spec, weights=weights)
            generator = torch.Generator().manual_seed(0)
            cfg = loaded.model.config
            length = min(PROMPT_TOKENS, cfg.max_position_embeddings - NEW_TOKENS)
            prompt = torch.randint(0, cfg.vocab_size, (length,), generator=generator).tolist()
            engine = Engine(loaded, config)
            state = engine.prefill(prompt)
            for _ in range(RUNS):
                for threads in thread_counts():
                    torch.set_num_threads(threads)
                    ms = _decode_ms(engine, prompt, state)
                    timings[Choice(weights, threads)] = min(ms, timings.get(Choice(weights, threads), ms))
            if weights == "dense":
                best = min(timings.values())
                dense = min((t for c, t in timings.items() if c.weights == "dense"), default=float("inf"))
                if dense <= COMPILE_MARGIN * best:
                    threads = min((c for c in timings if c.weights == "dense"), key=timings.get).threads
                    torch.set_num_threads(threads)
                    loaded.model.compile_steps()
                    engine = Engine(loaded, config)
                    timings[Choice("dense", threads, compiled=True)] = min(
                        _decode_ms(engine, prompt, state) for _ in range(RUNS)
                    )
    finally:
        torch.set_num_threads(threads_before)
    choice = min(timings, key=timings.get)
    cpu, _ = cpu_description()
    return Tuning(
        checkpoint.name,
        cpu,
        choice,
        {c.label: round(ms, 2) for c, ms in sorted(timings.items(), key=lambda item: item[1])},
        time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine_key(),
    )


def fastest_configuration(spec: str | None, checkpoint: Checkpoint, status: StatusCallback | None = None) -> Tuning:
    """The kept measurement for the target on this machine, measuring it (and keeping it) the first time."""
    kept = remembered(checkpoint)
    if kept is not None:
        return kept
    if status is not None:
        status(f"measuring the fastest configuration for {checkpoint.name} on this CPU, once (triforce info shows it)")
    tuning = measure(spec, checkpoint)
    path = tuning_folder() / f"{tuning_key(checkpoint)}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(tuning), indent=2))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache: measured again next time
    if status is not None:
        status(f"fastest here: {tuning.choice.label}")
    return tuning
