"""What a load is asked for (LoadOptions), what the machine offers (Machine), and what is then run (Setup).

resolve_basis makes every choice the first two decide alone and checks every setting; resolve_setup turns them, and
where the basis asks for them the target's checkpoint and the measured fastest configuration, into a Setup. Neither
reads anything: every choice of device, dtype, attention kernels, weight form, step mode and threads, and every
combination that cannot run, is decided there. choose_setup is the one place that reads what the choice depends on
(the machine, the checkpoint and the measurement, each once) and resolves the Setup once, with all of it;
Pipeline.load loads the models as the Setup says, each transformed in one place (loading.transform_model: weight
form, sharding, weight offload, device, attention kernels, step mode).
"""

from dataclasses import dataclass, replace

import torch

from triforce_cli.decoding.tuning import Choice, Tuning, fastest_configuration, tuning_enabled
from triforce_cli.errors import ConfigError
from triforce_cli.kernels import attention_backend, half_weights_available
from triforce_cli.kernels import optional as optional_kernels
from triforce_cli.runtime.environment import physical_cores
from triforce_cli.runtime.forms import (
    HALF_PROMPT_FORMS,
    OffloadMode,
    StepMode,
    WeightForm,
    resolve_steps,
    resolve_weights,
)
from triforce_cli.runtime.loading import Checkpoint, StatusCallback, resolve_checkpoint
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.parallel import pending_group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """What to load and how; every field has the default a plain `Pipeline.load()` runs with.

    Attributes:
        target: the target model: a folder, a .safetensors or .gguf file, a hub id; None: the embedded default.
        draft: the drafter (same tokenizer as the target), 'self' for none, None: the shipped one for the embedded
            target or another file of that model (pipeline.drafter_spec).
        dtype: 'auto' (bfloat16 on CUDA, float32 on the CPU) or a name of DTYPES.
        device: 'auto' (CUDA where there is a GPU), 'cpu', 'cuda' or 'cuda:N'.
        weights: a WeightForm: 'auto' (the fastest exact form for the device, forms.resolve_weights), 'dense',
            'half' (float16 weight matrices for target and drafter) or 'gguf' (the target from its GGUF file's
            blocks); see loading.load_model. Output is exact with respect to the target in the form chosen.
        attention: 'auto' (the fastest kernel for the device and dtype), 'flash', 'sdpa' or 'cpu'; see
            resolve_attention.
        steps: a StepMode, how decode steps run: 'eager', 'graphs' (fixed-shape steps recorded as CUDA graphs)
            or 'compiled' (those compiled by inductor first); None: graphs on CUDA, eager on the CPU
            (forms.resolve_steps).
        context_window: positions both models accept, YaRN-scaled beyond their trained context.
        threads: the torch threads the caller set, or None: then a CPU's prefill runs on every physical core, and
            decoding on the threads measured fastest (with tune) or torch's.
        tune: on the CPU in float32, let 'auto' weights, unset steps and unset threads take the
            configuration measured fastest for this target and machine (decoding.tuning; measured the first time).
    """

    target: str | None = None
    draft: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    weights: str = WeightForm.AUTO
    attention: str = "auto"
    steps: StepMode | None = None
    context_window: int | None = None
    threads: int | None = None
    tune: bool = False


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What a load may use here (current_machine reads it; the defaults describe one x86 CPU and nothing else).

    Attributes:
        cuda: a CUDA GPU is available.
        world_size: the processes computing together (torchrun), 1 alone.
        local_rank: the GPU torchrun gave this process where it has yet to join the group; None otherwise.
        flash_attention: flash-attn is installed.
        half_weights: this torch build has fbgemm (half weights, x86).
        gguf_kernels: the CPU extension with the GGUF block kernels builds here.
        tuning: measurements of the fastest configuration are allowed (decoding.tuning.tuning_enabled).
        physical_cores: the physical cores this process may run on.
    """

    cuda: bool = False
    world_size: int = 1
    local_rank: int | None = None
    flash_attention: bool = False
    half_weights: bool = True
    gguf_kernels: bool = True
    tuning: bool = True
    physical_cores: int = 1


def current_machine() -> Machine:
    """This machine and process as a Machine, but for gguf_kernels, False here: finding out builds the CPU
    extension, so Pipeline.load asks only for a GGUF source, the one case that needs to know."""
    world, local_rank = pending_group()
    return Machine(
        cuda=torch.cuda.is_available(),
        world_size=world,
        local_rank=local_rank,
        flash_attention=optional_kernels.flash_attn_func is not None,
        half_weights=half_weights_available(),
        gguf_kernels=False,
        tuning=tuning_enabled(),
        physical_cores=physical_cores(),
    )


@dataclass(frozen=True, kw_only=True)
class Setup:
    """The choices a load runs with (resolve_setup).

    Attributes:
        device: this process's device (under torchrun, cuda:LOCAL_RANK).
        dtype: the compute dtype.
        attention: the attention kernel family (kernels.attention_backend).
        weights: the target's weight form, never 'auto'.
        drafter_weights: the drafter's ('half' beside a half or gguf target where fbgemm is there: a drafter has
            no GGUF file of its own).
        steps: how decode steps run (StepMode, never None).
        tensor_parallel: the target's decoder layers are sharded over the processes (the drafter stays whole).
        offload_weights: the target's layers beyond EngineConfig.on_chip_layers stream from host memory.
        reads_checkpoint: the target's checkpoint decided something (a GGUF file may become gguf weights, and
            the tuning is kept per checkpoint; Basis.reads_checkpoint).
        tune: the configuration measured fastest (decoding.tuning) chose the weights, step mode and decode
            threads (Basis.tune, with the checkpoint known).
        decode_threads: the torch threads to set for decoding (the measured choice's), None: leave them.
        prefill_threads: the threads a CPU's prefill runs on (every physical core), None: torch's.
    """

    device: torch.device
    dtype: torch.dtype
    attention: str
    weights: str
    drafter_weights: str
    steps: StepMode
    tensor_parallel: bool = False
    offload_weights: bool = False
    reads_checkpoint: bool = False
    tune: bool = False
    decode_threads: int | None = None
    prefill_threads: int | None = None

    @property
    def compiled(self) -> bool:
        """Whether decode steps are fixed-shape steps (recorded or compiled), on caches made static."""
        return self.steps != StepMode.EAGER


def resolve_device(device: str, cuda: bool | None = None) -> torch.device:
    """device as a torch device; cuda: whether a CUDA GPU is available (None: asked here)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if device == "auto":
        return torch.device("cuda" if cuda else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device '{device}' (use auto, cpu or cuda[:N])") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"unsupported device '{device}' (use auto, cpu or cuda[:N])")
    if resolved.type == "cuda" and not cuda:
        raise ConfigError("device 'cuda' requested but no CUDA GPU is available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}' (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def resolve_attention(
    requested: str, device: torch.device, dtype: torch.dtype, weights: str, flash_installed: bool | None = None
) -> str:
    """The attention kernel family to run (kernels.attention_backend), or a ConfigError saying why the requested
    one cannot run. Half and GGUF weights are computed by the CPU extension's kernels alone, beside its attention
    kernels."""
    try:
        backend = attention_backend(device, dtype, requested, flash_installed)
    except ValueError as err:
        raise ConfigError(f"`attention` {requested}: {err}") from None
    if weights in HALF_PROMPT_FORMS and backend != "cpu":  # 'auto' weights then resolve to dense
        raise ConfigError(
            f"`attention` {backend} does not run beside {weights} weights, which the cpu kernels compute: use `weights` dense"
        )
    return backend


def drafter_weights(weights: str, half_available: bool | None = None) -> str:
    """A 'half' or 'gguf' target gets a 'half' drafter (a drafter has no GGUF file of its own) where fbgemm is
    there (half_available; None: asked here)."""
    if weights not in HALF_PROMPT_FORMS:
        return WeightForm.DENSE
    half = half_weights_available() if half_available is None else half_available
    return WeightForm.HALF if half else WeightForm.DENSE


@dataclass(frozen=True, kw_only=True)
class Basis:
    """What options decide on a machine before anything is read (resolve_basis), and what else the set-up reads.

    Attributes:
        device, dtype, attention, tensor_parallel, offload_weights: as the Setup's.
        weights: the weight form asked for ('auto' where the rule or a measurement is to choose).
        steps: the step mode asked for, or its default (never None).
        reads_checkpoint: the target's checkpoint decides something: 'auto' weights on the CPU in float32 with the
            cpu attention kernels and eager steps, where a GGUF file may become gguf weights.
        tune: the configuration measured fastest (decoding.tuning) chooses the weights, step mode and decode
            threads: asked for, allowed here, and nothing it chooses set otherwise.
    """

    device: torch.device
    dtype: torch.dtype
    attention: str
    weights: str
    steps: StepMode
    tensor_parallel: bool
    offload_weights: bool
    reads_checkpoint: bool
    tune: bool


def resolve_basis(options: LoadOptions, machine: Machine, offload: str = OffloadMode.NONE) -> Basis:
    """Every choice options and machine make alone, or a ConfigError naming the settings that cannot go together:
    each setting is checked here, before the checkpoint or a measurement is read. Reads nothing.

    Args:
        options: what is asked for.
        machine: what is there (its gguf_kernels aside, which only a GGUF checkpoint asks about).
        offload: EngineConfig.offload: kv+weights streams dense weights and runs eager steps.
    """
    device = resolve_device(options.device, machine.cuda)
    if machine.local_rank is not None and device.type == "cuda":
        device = torch.device("cuda", machine.local_rank)  # torchrun: this rank's GPU
    parallel = machine.world_size > 1
    dtype = resolve_dtype(options.dtype, device)
    weights = options.weights
    attention = resolve_attention(options.attention, device, dtype, weights, machine.flash_attention)
    # sharded steps run as asked (their graphs trace the all-reduces, runtime/parallel.py); unset: eager
    requested = StepMode.EAGER if parallel and options.steps is None else options.steps
    steps = resolve_steps(requested, device, weights)
    compiled = steps != StepMode.EAGER
    streamed = offload == OffloadMode.KV_WEIGHTS
    if streamed and compiled:
        raise ConfigError(f"`offload` {OffloadMode.KV_WEIGHTS} runs eager steps: use `steps` eager")
    if weights == WeightForm.AUTO and (streamed or parallel):
        weights = WeightForm.DENSE  # streamed and sharded weights are parameters, which packed half weights are not
    tunable = device.type == "cpu" and dtype == torch.float32 and attention == "cpu" and not parallel
    # only there can 'auto' become gguf, so only there does it matter whether the target is a GGUF file
    reads_checkpoint = weights == WeightForm.AUTO and tunable and not compiled
    unset = options.steps is None and offload == OffloadMode.NONE
    return Basis(
        device=device,
        dtype=dtype,
        attention=attention,
        weights=weights,
        steps=steps,
        tensor_parallel=parallel,
        offload_weights=streamed,
        reads_checkpoint=reads_checkpoint,
        tune=options.tune and reads_checkpoint and unset and machine.tuning,
    )


def resolve_setup(
    options: LoadOptions,
    machine: Machine,
    checkpoint: Checkpoint | None = None,
    offload: str = OffloadMode.NONE,
    choice: Choice | None = None,
    basis: Basis | None = None,
) -> Setup:
    """The Setup that options ask for on machine, or a ConfigError naming the settings that cannot go together.
    Reads nothing: what it needs to know of the machine is in machine.

    Args:
        options: what is asked for.
        machine: what is there.
        checkpoint: the target's checkpoint, where the basis reads_checkpoint (otherwise ignored): a GGUF source
            lets 'auto' weights become gguf, and a known checkpoint lets tune apply.
        offload: EngineConfig.offload: kv+weights streams dense weights and runs eager steps.
        choice: the measured fastest configuration (decoding.tuning.Choice), where the basis tunes (otherwise
            ignored): its weights and step mode, and its threads unless options.threads are set.
        basis: resolve_basis(options, machine, offload), where the caller has it already (choose_setup, which
            learns from it what to read); None: resolved here.
    """
    basis = resolve_basis(options, machine, offload) if basis is None else basis
    device, weights, steps = basis.device, basis.weights, basis.steps
    checkpoint = checkpoint if basis.reads_checkpoint else None
    tune = basis.tune and checkpoint is not None
    decode_threads = None
    if tune and choice is not None:
        weights, steps = choice.weights, choice.steps
        if options.threads is None:
            decode_threads = choice.threads
    weights = resolve_weights(
        weights,
        basis.dtype,
        device,
        basis.attention,
        steps != StepMode.EAGER,
        gguf_source=checkpoint is not None and checkpoint.gguf is not None,
        gguf_kernels=machine.gguf_kernels,
        half_available=machine.half_weights,
    )
    return Setup(
        device=device,
        dtype=basis.dtype,
        attention=basis.attention,
        weights=weights,
        drafter_weights=drafter_weights(weights, machine.half_weights),
        steps=steps,
        tensor_parallel=basis.tensor_parallel,
        offload_weights=basis.offload_weights,
        reads_checkpoint=basis.reads_checkpoint,
        tune=tune,
        decode_threads=decode_threads,
        prefill_threads=machine.physical_cores if options.threads is None and device.type == "cpu" else None,
    )


@dataclass(frozen=True)
class Chosen:
    """A load's set-up with what it was chosen from: the target's checkpoint where it decided something (None
    otherwise: load_model resolves it), and the measurement of the fastest configuration where that chose."""

    setup: Setup
    checkpoint: Checkpoint | None = None
    tuning: Tuning | None = None


def choose_setup(options: LoadOptions, offload: str = OffloadMode.NONE, status: StatusCallback | None = None) -> Chosen:
    """The set-up of a load, every choice made here and resolved once: first what options decide on this machine
    alone (resolve_basis, which checks every setting before anything is read), then what that basis asks for is
    read: the target's checkpoint where it decides something (Basis.reads_checkpoint: a GGUF file may become gguf
    weights), the fastest configuration where it chooses (Basis.tune; measured the first time,
    decoding.tuning.fastest_configuration); then resolve_setup, with all of it.

    Args:
        options: what is asked for.
        offload: EngineConfig.offload.
        status: receives one-line notes (a GGUF file converted, a measurement taken).
    Returns:
        The Setup, with the checkpoint it read (for load_model, so that it is resolved once) and the tuning.
    """
    machine = current_machine()
    basis = resolve_basis(options, machine, offload)
    checkpoint = tuning = None
    if basis.reads_checkpoint:
        checkpoint = resolve_checkpoint(options.target, status)
        if checkpoint.gguf is not None:
            machine = replace(machine, gguf_kernels=kernel_error() is None)  # builds the extension once
    if basis.tune:
        tuning = fastest_configuration(options.target, checkpoint, status)
    choice = None if tuning is None else tuning.choice
    return Chosen(resolve_setup(options, machine, checkpoint, offload, choice, basis), checkpoint, tuning)
