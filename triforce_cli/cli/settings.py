"""The library's settings built from a command's options, once for every command: each option is named as the
LoadOptions, EngineConfig or SamplingConfig field it sets, so a command hands over its values (``locals()``) and
the fields are picked by name."""

from dataclasses import fields

from triforce_cli.decoding.config import MODE_TIERS, EngineConfig
from triforce_cli.decoding.pipeline import SELF_DRAFT, Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.forms import StepMode
from triforce_cli.runtime.loading import StatusCallback


def _named(cls, values: dict, skip: tuple[str, ...] = ()) -> dict:
    """The values that set a field of the dataclass cls, but for those in skip."""
    return {f.name: values[f.name] for f in fields(cls) if f.name in values and f.name not in skip}


def step_mode(values: dict) -> StepMode | None:
    """The step mode a command's options ask for: --steps, or its shorthands --compile (compiled) and --no-compile
    (eager); a ConfigError where the two disagree."""
    steps, shorthand = values.get("steps"), values.get("compile_steps")
    implied = None if shorthand is None else StepMode.COMPILED if shorthand else StepMode.EAGER
    if steps is not None and implied is not None and steps != implied:
        flag = "--compile" if shorthand else "--no-compile"
        raise ConfigError(f"{flag} means --steps {implied}, not --steps {steps}: give one of them")
    return steps if steps is not None else implied


def load_options(values: dict) -> LoadOptions:
    """What to load, as a command's options ask; a command measures the fastest configuration where it may."""
    return LoadOptions(**{**_named(LoadOptions, values), "steps": step_mode(values)}, tune=True)


def sampling_config(values: dict) -> SamplingConfig:
    return SamplingConfig(**_named(SamplingConfig, values))


def engine_config(values: dict, skip: tuple[str, ...] = ()) -> EngineConfig:
    """The EngineConfig of a command's options (those in skip left at their defaults: a bench sweeps them)."""
    return EngineConfig(**_named(EngineConfig, values, ("sampling", *skip)), sampling=sampling_config(values))


def load_pipeline(values: dict, config: EngineConfig, status: StatusCallback | None) -> Pipeline:
    """The command's models loaded as its options ask, with config."""
    return Pipeline.load(options=load_options(values), config=config, status=status)


def check_draft_used(draft: str | None, runs_drafter: bool, modes: str) -> None:
    """A ConfigError where `draft` names a model that no mode the command runs drafts with (modes: those modes, as
    the message names them), rather than loading it for nothing."""
    if draft is not None and draft != SELF_DRAFT and not runs_drafter:
        drafting = " or ".join(mode for mode, tiers in MODE_TIERS.items() if tiers.drafter)
        raise ConfigError(
            f"`draft` names the model of a drafter tier, which {modes} does not run: leave `draft` out, or choose a"
            f" mode with one ({drafting})"
        )
