"""The weight forms a model can take, the ways its decode steps run and the offload modes of its caches, named once
for every layer that uses them.

Each is a StrEnum: a member equals its string ('half' == WeightForm.HALF), so settings given as strings, saved
records and JSON keep their plain values.
"""

from enum import StrEnum


class WeightForm(StrEnum):
    """How a model holds its weight matrices (runtime/loading.py): 'auto' resolves to one of the others
    (loading.resolve_weights); 'half' and 'gguf' exist on the CPU in float32 only."""

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
    'graphs' on CUDA, 'eager' on the CPU (loading.resolve_steps)."""

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
