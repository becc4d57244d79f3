"""The weight forms a model can take, the ways its decode steps run and the offload modes of its caches, named once
for every layer that uses them, and the rules that choose a form and a step mode where a setting leaves them to the
machine (resolve_weights, resolve_steps: the set-up's policy, decoding.setup.resolve_setup, and `triforce info`).

Each is a StrEnum: a member equals its string ('half' == WeightForm.HALF), so settings given as strings, saved
records and JSON keep their plain values.
"""

from enum import StrEnum

import torch

from triforce_cli.errors import ConfigError
from triforce_cli.kernels import half_weights_available
from triforce_cli.runtime.native import kernel_error


class WeightForm(StrEnum):
    """How a model holds its weight matrices (runtime/loading.py): 'auto' resolves to one of the others
    (resolve_weights); 'half' and 'gguf' exist on the CPU in float32 only."""

    AUTO = "auto"
    DENSE = "dense"  # float weights in the compute dtype
    HALF = "half"  # float16 weight matrices (half_weights.py)
    GGUF = "gguf"  # a GGUF file's own blocks (gguf_weights.py)


# the forms that only the CPU extension's kernels compute (with the cpu attention kernels, in eager steps), and beside
# which a drafter takes half weights; `weights in HALF_PROMPT_FORMS` reads a plain string too
HALF_PROMPT_FORMS = (WeightForm.HALF, WeightForm.GGUF)
WEIGHT_FORMATS = (WeightForm.DENSE, WeightForm.HALF, WeightForm.GGUF)  # what a loaded model holds
WEIGHT_CHOICES = tuple(form.value for form in WeightForm)  # what a setting may name


class StepMode(StrEnum):
    """How decode steps on caches made static run (Transformer.use_steps); None where a setting leaves it unset:
    'graphs' on CUDA, 'eager' on the CPU (resolve_steps)."""

    EAGER = "eager"  # every forward as it comes
    GRAPHS = "graphs"  # fixed-shape steps, each recorded once per cache and padded length as a CUDA graph
    COMPILED = "compiled"  # those steps compiled by inductor first (fewer kernels, a compilation per length)


STEP_CHOICES = tuple(mode.value for mode in StepMode)


class OffloadMode(StrEnum):
    """Where the target's full KV cache (and weights) live (EngineConfig.offload)."""

    NONE = "none"  # every cache on the device
    KV = "kv"  # the full KV cache in host memory, streamed layer by layer (offload/kv.py)
    KV_WEIGHTS = "kv+weights"  # its layers' weights too (offload/weights.py)


OFFLOAD_CHOICES = tuple(mode.value for mode in OffloadMode)


def resolve_weights(
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
    attention: str = "cpu",
    compiled: bool = False,
    gguf_source: bool = False,
    *,
    gguf_kernels: bool | None = None,
    half_available: bool | None = None,
) -> str:
    """'auto' as the fastest exact weight form by rule: on a CPU in float32 with the cpu attention kernels and eager
    steps, 'gguf' for a GGUF checkpoint whose block kernel builds here (a decode step reads a fifth of the float32
    bytes), else 'half' on an x86 torch build whose CPU extension builds (half the bytes); 'dense' elsewhere. Any
    other choice as it is.
    decoding.tuning replaces the rule by a measurement where it may.

    gguf_kernels, half_available: whether the block kernel builds and half weights run here, where the caller knows
    (decoding.setup.Machine); None: found out here, the kernel only for a GGUF checkpoint."""
    if weights != WeightForm.AUTO:
        return weights
    if not (device.type == "cpu" and dtype == torch.float32 and attention == "cpu" and not compiled):
        return WeightForm.DENSE
    if gguf_source and (kernel_error() is None if gguf_kernels is None else gguf_kernels):
        return WeightForm.GGUF
    half = half_weights_available() and kernel_error() is None if half_available is None else half_available
    return WeightForm.HALF if half else WeightForm.DENSE


def resolve_steps(requested: StepMode | None, device: torch.device, weights: str) -> StepMode:
    """How decode steps run (Transformer.use_steps): as requested, else as fixed-shape steps recorded as CUDA graphs
    on CUDA, and eager on the CPU, where the eager steps on half weights measured faster (STEP_REASONS). Half and
    GGUF weights run only in eager steps: their CPU kernels take variable-length views."""
    default = StepMode.GRAPHS if device.type == "cuda" else StepMode.EAGER
    steps = default if requested is None else StepMode(requested)
    if steps != StepMode.EAGER and weights in HALF_PROMPT_FORMS:
        raise ConfigError(
            f"`steps` {steps} runs dense weights only, not {weights}: use `weights` dense or `steps` eager"
        )
    return steps


STEP_REASONS = {
    "cuda": "graphs: every decode step is one CUDA graph, recorded once per step length (--steps compiled to compile"
    " them first)",
    "cpu": "eager: on the CPU the eager steps on GGUF or half weights beat fixed-shape ones (--steps graphs or"
    " --compile to try)",
}
