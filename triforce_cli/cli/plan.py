"""`triforce plan`: predicted memory and per-token latency of every mode on a machine, and the settings to use."""

import json
import math
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from triforce_cli import plan as planner
from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.setup import DTYPES
from triforce_cli.decoding.stats import as_record
from triforce_cli.errors import ConfigError
from triforce_cli.plan.plot import plot_predicted_latency, pyplot
from triforce_cli.plan.weights import WEIGHT_PLANS
from triforce_cli.runtime.forms import OffloadMode
from triforce_cli.runtime.store import check_writable_file, human_size

DEFAULTS = EngineConfig()
MAX_GPUS = 64


def positive_number(value: str | float) -> float:
    """Parser of a finite number above 0."""
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise typer.BadParameter(f"'{value}' is not a finite number above 0")
    return number


def acceptance_rate(value: str | float) -> float:
    """Parser of a probability in [0, 1]."""
    try:
        number = float(value)
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a number") from None
    if not 0 <= number <= 1:  # also refuses nan
        raise typer.BadParameter(f"'{value}' is not an acceptance rate in [0, 1]")
    return number


def hardware_name(value: str) -> str:
    """Parser of a machine preset as people spell it (RTX 4090, rtx4090, a100): its name, or one line naming the
    presets and the closest."""
    try:
        return planner.hardware_name(value)
    except ConfigError as err:
        raise typer.BadParameter(str(err)) from None


def figure(help_text: str) -> typer.models.OptionInfo:
    return typer.Option(parser=positive_number, metavar="NUMBER", help=help_text)


def plan(
    context: Annotated[int, typer.Option(parser=o.token_count, metavar="TOKENS", help="Prompt length, e.g. 128k.")],
    model: Annotated[
        str,
        typer.Option(
            metavar="PRESET|CONFIG",
            help=f"A preset ({', '.join(planner.MODELS)}), a local config.json or its folder, or a .gguf file.",
        ),
    ] = planner.EMBEDDED_PRESET,
    hardware: Annotated[
        str,
        typer.Option(
            parser=hardware_name,
            metavar="|".join(planner.HARDWARE_CHOICES),
            autocompletion=o.completions(planner.HARDWARE_CHOICES),
            help="Machine figures; this-cpu and this-gpu measure this machine's CPU or CUDA GPU now (seconds).",
        ),
    ] = planner.THIS_CPU,
    budget: o.Budget = None,
    chunk_size: o.ChunkSize = DEFAULTS.chunk_size,
    gamma1: o.Gamma1 = DEFAULTS.gamma1,
    gamma2: o.Gamma2 = DEFAULTS.gamma2,
    max_new_tokens: o.MaxNewTokens = DEFAULTS.max_new_tokens,
    acceptance_draft: Annotated[
        float,
        typer.Option(parser=acceptance_rate, metavar="RATE", help="Per-draft acceptance of the drafter's tokens."),
    ] = planner.DEFAULT_ACCEPTANCE.draft,
    acceptance_retrieval: Annotated[
        float,
        typer.Option(parser=acceptance_rate, metavar="RATE", help="Per-draft acceptance of the retrieval tier's."),
    ] = planner.DEFAULT_ACCEPTANCE.retrieval,
    gpus: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_GPUS, metavar="N", help="GPUs in tensor parallel [default: the machine's]."),
    ] = None,
    dtype: Annotated[
        Literal[tuple(DTYPES)], typer.Option(metavar="|".join(DTYPES), help="Dtype of weights and caches.")
    ] = "bfloat16",
    weights: Annotated[
        Literal[tuple(WEIGHT_PLANS)] | None,
        typer.Option(
            metavar="dtype|q4_k_m|q8_0|...",
            help="The target's weights: the dtype's, or GGUF blocks of a quantization as llama.cpp names it, kept"
            " packed on the CPU [default: a .gguf --model's own types, else dtype].",
        ),
    ] = None,
    memory_gb: Annotated[float | None, figure("Memory per device, GB of 2^30 bytes.")] = None,
    bandwidth_gbs: Annotated[float | None, figure("Device memory bandwidth, GB/s.")] = None,
    pcie_gbs: Annotated[float | None, figure("Host-to-device bandwidth, GB/s.")] = None,
    tflops: Annotated[float | None, figure("Dense TFLOP/s in the dtype.")] = None,
    json_output: o.JsonOutput = False,
    plot: Annotated[
        Path | None, typer.Option(metavar="FILE", help="Write a PNG of predicted latency against context length.")
    ] = None,
) -> None:
    """Predict memory and per-token latency of every mode, with and without the KV cache offloaded (no model runs)."""
    with command_console(json_output=json_output):
        if plot is not None:
            check_plot_path(plot)
            pyplot()
        preset = planner.model_preset(model)
        engine = EngineConfig(
            budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2, max_new_tokens=max_new_tokens
        )
        workload = planner.Workload(
            context=context,
            engine=engine,
            acceptance=planner.Acceptance(draft=acceptance_draft, retrieval=acceptance_retrieval),
            dtype_bytes=DTYPES[dtype].itemsize,
            weights=planner.weight_bytes(weights, model=model, shape=preset.target),
        )
        workload.engine.budget_for(context)  # a budget the context cannot hold, before measuring anything
        machine = planner.with_figures(
            planner.machine(hardware),
            gpus=gpus,
            memory_gb=memory_gb,
            bandwidth_gbs=bandwidth_gbs,
            pcie_gbs=pcie_gbs,
            tflops=tflops,
        )
        if workload.weights is not None and machine.gpu:
            raise ConfigError(
                f"`--weights {workload.weights.name}`: GGUF blocks are computed on the CPU; plan them with --hardware"
                f" {planner.THIS_CPU}"
            )
        setup = {"target": preset.target, "drafter": preset.drafter, "hardware": machine}
        prediction = planner.plan(**setup, workload=workload)
        if json_output:
            print(json.dumps(plan_record(prediction, preset, machine, workload, dtype)))
        else:
            print_plan(StdoutConsole(highlight=False), prediction, preset, machine, workload, dtype)
        if plot is not None:
            curves = [(w.context, planner.predict_rows(**setup, workload=w)) for w in planner.context_sweep(workload)]
            title = f"predicted: {preset.target.name} on {machine.name}, budget {workload.budget} at {context} tokens"
            plot_predicted_latency(curves, plot, title)


def check_plot_path(path: Path) -> None:
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot writes a PNG: give a file ending in .png, not {path.name}")
    check_writable_file(path, "plot")


def plan_record(
    prediction: planner.Plan,
    preset: planner.ModelPreset,
    machine: planner.Hardware,
    workload: planner.Workload,
    dtype: str,
) -> dict:
    """The JSON object of --json: every figure is a prediction."""
    cfg = workload.engine
    return {
        "prediction": True,
        "model": {
            "name": preset.target.name,
            "parameters": preset.target.parameters,
            "drafter": preset.drafter.name,
            "drafter_parameters": preset.drafter.parameters,
        },
        "hardware": as_record(machine),
        "settings": {
            "context": workload.context,
            "budget": workload.budget,
            "chunk_size": cfg.chunk_size,
            "gamma1": cfg.gamma1,
            "gamma2": cfg.gamma2,
            "max_new_tokens": cfg.max_new_tokens,
            "acceptance_draft": workload.acceptance.draft,
            "acceptance_retrieval": workload.acceptance.retrieval,
            "dtype": dtype,
            "weights": None if workload.weights is None else as_record(workload.weights),
        },
        "rows": [as_record(row) for row in prediction.rows],
        "recommendation": as_record(prediction.recommendation),
    }


def print_plan(
    out: Console,
    prediction: planner.Plan,
    preset: planner.ModelPreset,
    machine: planner.Hardware,
    workload: planner.Workload,
    dtype: str,
) -> None:
    """The settings, a table of every mode and offload setting (fits 80 columns) and the recommendation."""
    cfg, alpha = workload.engine, workload.acceptance
    devices = f"{machine.gpus}× " if machine.gpus > 1 else ""
    measured = " (measured now)" if machine.measured else ""
    out.print(
        Text(
            f"{preset.target.name} ({preset.target.parameters / 1e6:,.0f}M), drafter {preset.drafter.name}"
            f" ({preset.drafter.parameters / 1e6:,.0f}M), {dtype}{weights_text(workload.weights)};"
            f" {workload.context} tokens, budget"
            f" {workload.budget}, chunk {cfg.chunk_size}, gamma1 {cfg.gamma1}, gamma2 {cfg.gamma2}, acceptance"
            f" {alpha.draft:.2f} (drafter) / {alpha.retrieval:.2f} (retrieval)"
        )
    )
    out.print(
        Text(
            f"{machine.name}{measured}: {devices}{human_size(machine.memory_bytes)},"
            f" {machine.bandwidth / 1e9:,.0f} GB/s, PCIe {machine.pcie / 1e9:,.0f} GB/s,"
            f" {flops_text(machine.flops)}, {machine.layer_overhead_s * 1e6:.0f} µs per layer"
        )
    )
    table = Table(title=Text("predicted per-token latency and memory"), title_justify="left")
    for column in ("mode", "offload", "ms/token", "×AR", "device", "host", "fits"):
        table.add_column(Text(column), justify="left" if column in ("mode", "offload") else "right")
    for row in prediction.rows:
        autoregressive = prediction.row("autoregressive", row.offload)
        table.add_row(
            row.mode,
            row.offload if row.offload == OffloadMode.NONE else f"kv {row.on_chip_layers}",
            f"{row.ms_per_token:,.1f}",
            f"{autoregressive.ms_per_token / row.ms_per_token:.2f}×",
            human_size(row.device_bytes),
            human_size(row.host_bytes) if row.host_bytes else "-",
            "yes" if row.fits else Text("NO", style="red"),
        )
    table.caption = Text("kv N: the full KV cache in host memory, N layers of it on the device too")
    out.print(table)
    out.print(Text(recommendation_text(prediction.recommendation, machine)))


def weights_text(weights: planner.WeightBytes | None) -> str:
    """', weights q4_k_m (0.83 bytes a weight in the layers, 1.25 in the output layer)', or nothing for the dtype's."""
    if weights is None:
        return ""
    return (
        f", weights {weights.name} ({weights.layers:.2f} bytes a weight in the layers, {weights.output:.2f} in the"
        " output layer)"
    )


def flops_text(flops: float) -> str:
    return f"{flops / 1e12:,.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.0f} GFLOP/s"


def recommendation_text(advice: planner.Recommendation, machine: planner.Hardware) -> str:
    """One sentence: the recommended settings and what they are predicted to give, or that nothing fits."""
    if not advice.fits:
        return (
            f"nothing fits {machine.name}'s memory, not even with the full KV cache in host memory: more --gpus or a"
            " shorter --context"
        )
    offload = (
        f"--offload kv --on-chip-layers {advice.on_chip_layers}"
        if advice.offload == OffloadMode.KV
        else "--offload none"
    )
    fastest = "" if advice.mode == "triforce" else f"; fastest: {advice.mode}, {advice.mode_ms_per_token:,.1f} ms/token"
    return (
        f"recommended (predicted): {offload} --budget {advice.budget} --gamma1 {advice.gamma1} --gamma2"
        f" {advice.gamma2}: triforce {advice.triforce_ms_per_token:,.1f} ms/token, {advice.speedup:.2f}×"
        f" autoregressive with the same offload{fastest}"
    )
