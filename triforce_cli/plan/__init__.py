"""`triforce plan`: predicted memory and per-token latency of every mode, with and without the full KV cache
offloaded, from a model's shape and a machine's figures, and the settings predicted to decode fastest.

model.py holds the cost model, presets.py the models and machines known by name, measure.py the measurement of
this machine; docs/planner.md describes the model and compares its predictions with measurements.
"""

from triforce_cli.plan import measure
from triforce_cli.plan.model import (
    Acceptance,
    Hardware,
    ModelShape,
    Plan,
    Recommendation,
    Row,
    WeightBytes,
    Workload,
    context_sweep,
    plan,
    predict_rows,
)
from triforce_cli.plan.presets import (
    DEFAULT_ACCEPTANCE,
    EMBEDDED_PRESET,
    HARDWARE,
    HARDWARE_CHOICES,
    MODELS,
    THIS_CPU,
    THIS_GPU,
    ModelPreset,
    hardware_name,
    model_preset,
    with_figures,
)
from triforce_cli.plan.weights import weight_bytes


def machine(spelling: str) -> Hardware:
    """A machine preset by name (spelled as presets.hardware_name reads), or this machine's CPU or CUDA device
    measured now for this-cpu or this-gpu."""
    name = hardware_name(spelling)
    measured = {THIS_CPU: measure.measure_this_cpu, THIS_GPU: measure.measure_this_gpu}
    return measured[name]() if name in measured else HARDWARE[name]


__all__ = [
    "DEFAULT_ACCEPTANCE",
    "EMBEDDED_PRESET",
    "HARDWARE",
    "HARDWARE_CHOICES",
    "MODELS",
    "THIS_CPU",
    "THIS_GPU",
    "Acceptance",
    "Hardware",
    "ModelPreset",
    "ModelShape",
    "Plan",
    "Recommendation",
    "Row",
    "WeightBytes",
    "Workload",
    "context_sweep",
    "hardware_name",
    "machine",
    "model_preset",
    "plan",
    "predict_rows",
    "weight_bytes",
    "with_figures",
]
