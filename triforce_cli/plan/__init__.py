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
    ModelPreset,
    hardware_preset,
    model_preset,
    with_figures,
)


def machine(name: str) -> Hardware:
    """A machine preset by name, or this machine measured now for this-cpu."""
    return measure.measure_this_cpu() if name.lower() == THIS_CPU else hardware_preset(name)


__all__ = [
    "DEFAULT_ACCEPTANCE",
    "EMBEDDED_PRESET",
    "HARDWARE",
    "HARDWARE_CHOICES",
    "MODELS",
    "THIS_CPU",
    "Acceptance",
    "Hardware",
    "ModelPreset",
    "ModelShape",
    "Plan",
    "Recommendation",
    "Row",
    "Workload",
    "context_sweep",
    "machine",
    "model_preset",
    "plan",
    "predict_rows",
    "with_figures",
]
