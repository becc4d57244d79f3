"""The GPU check's measurements (scripts/gpu-check.sh runs each subcommand in its own process, under a timeout).

    profile   torch.profiler tables (by device time and by host time) of a few decode steps, eager and in the
              default step mode, with the host synchronisations torch.cuda.set_sync_debug_mode("warn") reports;
              then each tier's step cost by token count (1, 2, 4 ... 128) beside its floors: the bytes it must
              read over the measured device bandwidth, its FLOPs over the measured matmul rate.
    runs      engine runs of a random-weight target and drafter (default Llama-3.1-8B-shaped, RoPE as Llama 3.1's,
              config built here: nothing is downloaded), each as CONTEXT:OFFLOAD:MODE, the card held to
              --memory-limit-gib: ms/token beside `triforce plan --hardware this-gpu`'s prediction (with the
              acceptance each run measured), prefill seconds beside its FLOP floor, peak memory beside the plan's.
    embedded  `triforce generate` of the embedded model's shape in a cold process per step mode: time to the first
              token printed and in all (the real embedded model where it is installed, else random weights with
              the shipped tokenizer).

Random weights give real step costs and memory, not acceptance: a random drafter's tokens are rarely accepted, so
the speculative modes' ms/token here is a floor on cost, not a speed-up. Speculation lengths are fixed
(--gamma-policy fixed) so that the costs compare. A context that, with the new tokens, exceeds the model's
positions is clamped to fit (131072 becomes 131072 - new tokens). Every run is tried on its own: an error or a
timeout (--run-timeout) is recorded as its outcome and the others still run. Each figure is appended to
OUT/<subcommand>.jsonl (one JSON object a line) and OUT/summary.txt as it is measured.

    python3 scripts/gpu_check.py runs --device cpu --shape tiny --runs 512:none:triforce --out /tmp/check  # smoke
"""

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from triforce_cli.runtime.allocator import expandable_cuda_segments

expandable_cuda_segments()  # as the triforce command sets the allocator up, before torch allocates

import torch
from triforce_cli.cache import FullCache

from triforce_cli import plan as planner
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import resolve_attention
from triforce_cli.errors import ConfigError
from triforce_cli.plan import measure
from triforce_cli.plan.model import ModelShape
from triforce_cli.plan.presets import EAGER_LAYER_OVERHEAD_S, LLAMA_3_1_ROPE, SMOLLM2_135M, SMOLLM2_135M_DRAFTER
from triforce_cli.runtime.forms import STEP_CHOICES, StepMode, resolve_steps
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS, ModelConfig, RMSNorm, Transformer, rope_frequencies

GIB = 2**30
MAX_POSITIONS = 131072  # the random models' context (Llama 3.1's)
TINY = ModelShape(  # a smoke run's target and drafter on any machine
    name="tiny",
    num_layers=2,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    vocab_size=512,
    tie_word_embeddings=False,
)
SHAPES = {  # the target and its drafter: for Llama-3.1-8B, the shapes `triforce plan` predicts for
    "llama-3.1-8b": (planner.MODELS["Llama-3.1-8B"].target, planner.MODELS["Llama-3.1-8B"].drafter),
    "tiny": (TINY, TINY),
}
STEP_TOKENS = tuple(1 << i for i in range(MAX_STEP_TOKENS.bit_length()))  # 1, 2, 4 ... MAX_STEP_TOKENS
RETRIEVAL_POSITIONS = 1024 + 256  # the retrieval tier's cache: the default budget and its recent region, about
DRAFTER_POSITIONS = 16 + 496 + 64  # the drafter's: sinks, window and a step's room, about


class IdTokenizer:
    """What the engine asks of a tokenizer, for ids that stand for nothing: its vocabulary and an end-of-sequence id
    that is never honoured (the runs ignore it)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def random_model(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A runtime Transformer of shape with weights drawn N(0, 0.02) on device, RoPE scaled as Llama 3.1's.

    Built on the meta device in dtype, then materialised on device: no tensor of the whole model is ever held in
    float32 (an 8B model would take 32 GB for a moment)."""
    hf = shape.llama_config(max_position_embeddings=MAX_POSITIONS, rope_parameters=LLAMA_3_1_ROPE)
    inv_freq, rope_scale = rope_frequencies(hf, shape.head_dim)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf), inv_freq, rope_scale).to(dtype)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
    model.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # float32, as the loader keeps it
    return LoadedModel(f"random {shape.name}", model.eval(), IdTokenizer(shape.vocab_size), hf)


def use_steps(models: list[LoadedModel], requested: str | None, device: torch.device) -> StepMode:
    """Run the models' decode steps as `triforce generate --steps` does (None: its default, graphs on CUDA and eager
    on the CPU); the mode set."""
    steps = resolve_steps(requested, device, "dense")
    for loaded in models:
        loaded.model.use_steps(steps)
    return steps


def hold_memory(device: torch.device, limit_gib: float) -> None:
    """Hold this process to limit_gib of the card (0: all of it) as a smaller card would."""
    if device.type != "cuda" or not limit_gib:
        return
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_gib * GIB / total), device)


def measured_hardware(device: torch.device) -> planner.Hardware:
    """The machine as `triforce plan --hardware this-gpu` (this-cpu on a CPU) measures it now."""
    return measure.measure_this_gpu() if device.type == "cuda" else measure.measure_this_cpu()


class RunTimeout(Exception):
    """A run took longer than --run-timeout."""


@contextmanager
def time_limit(seconds: int):
    """Raise RunTimeout in this (main) thread after seconds (0: no limit)."""

    def expire(signum, frame):
        raise RunTimeout(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Results:
    """Figures appended as they come: OUT/<name>.jsonl one JSON object a line, OUT/summary.txt one line each."""

    def __init__(self, out: Path | None, name: str):
        self.out, self.name = out, name
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)

    def add(self, record: dict, line: str) -> None:
        print(line, flush=True)
        if self.out is None:
            return
        with open(self.out / f"{self.name}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        with open(self.out / "summary.txt", "a") as handle:
            handle.write(f"[{self.name}] {line}\n")

    def note(self, text: str) -> None:
        print(text, flush=True)
        if self.out is not None:
            with open(self.out / "summary.txt", "a") as handle:
                handle.write(f"[{self.name}] {text}\n")


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def failure(err: BaseException) -> tuple[str, str]:
    """A run's outcome and detail for an exception: 'refused' (the engine's memory or prompt checks), 'out of
    memory' (a defect: the checks should have refused), 'timeout' or 'error'."""
    first = (str(err).splitlines() or [""])[0]
    if isinstance(err, ConfigError):
        return "refused", first
    if isinstance(err, torch.OutOfMemoryError):  # where it was asked for, and what the allocator held then
        traceback.print_exception(err, file=sys.stderr)
        if torch.cuda.is_initialized():
            print(torch.cuda.memory_summary(abbreviated=True), file=sys.stderr)
        return "out of memory", first
    if isinstance(err, RunTimeout):
        return "timeout", first
    traceback.print_exception(err, file=sys.stderr)
    return "error", f"{type(err).__name__}: {first}"


def fitted_context(context: int, new_tokens: int, positions: int = MAX_POSITIONS) -> int:
    """The longest prompt up to context that leaves room for new_tokens within the model's positions."""
    return min(context, positions - new_tokens)


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """FLOPs of a prefill of `tokens` tokens: two per weight and token in the layers and the last token's output
    layer, and causal attention (each token's queries against the keys before it: 2 * H * D * T^2 per layer)."""
    layers = 2 * shape.num_layers * shape.layer_parameters * tokens
    attention = 2 * shape.num_layers * shape.num_heads * shape.head_dim * tokens**2
    return layers + attention + 2 * shape.output_parameters


def step_floors(shape: ModelShape, tokens: int, positions: int, dtype_bytes: int, hardware) -> tuple[float, float]:
    """Seconds of a step of `tokens` tokens over `positions` cached positions at the hardware's bandwidth (the
    layers' and output layer's weights and the keys and values read once) and at its FLOP/s."""
    weights = (shape.num_layers * shape.layer_parameters + shape.output_parameters) * dtype_bytes
    kv = shape.kv_elements(positions) * dtype_bytes
    flops = 2 * (shape.num_layers * shape.layer_parameters + shape.output_parameters) * tokens
    flops += 4 * shape.num_layers * shape.num_heads * shape.head_dim * positions * tokens
    return (weights + kv) / hardware.bandwidth, flops / hardware.flops


@dataclass
class Run:
    context: int
    offload: str
    mode: str
    steps: str
    outcome: str = "ran"  # see failure()
    detail: str = ""
    requested_context: int = 0
    prefill_s: float | None = None
    prefill_floor_s: float | None = None
    ms_per_token: float | None = None
    acceptance: dict[str, float] = field(default_factory=dict)
    planned_ms_per_token: float | None = None
    peak_device_gib: float | None = None
    planned_device_gib: float | None = None
    planned_host_gib: float | None = None
    planned_fits: bool | None = None
    on_chip_layers: int = 0

    def line(self) -> str:
        shown = {
            key: "-" if value is None else f"{value:.2f}"
            for key, value in (
                ("ms", self.ms_per_token),
                ("planned", self.planned_ms_per_token),
                ("prefill", self.prefill_s),
                ("floor", self.prefill_floor_s),
                ("peak", self.peak_device_gib),
                ("planned_gib", self.planned_device_gib),
            )
        }
        offload = f"kv {self.on_chip_layers}" if self.offload == "kv" else self.offload
        off = ""
        if self.ms_per_token and self.planned_ms_per_token:
            ratio = self.ms_per_token / self.planned_ms_per_token
            off = f", {ratio:.2f}x planned{'' if 0.75 <= ratio <= 1.25 else ' (off by more than 25%)'}"
        return (
            f"{self.context:>7} {offload:>5} {self.mode:>14} {self.steps:>8} {self.outcome:>13}: "
            f"{shown['ms']} ms/token (planned {shown['planned']}{off}), prefill {shown['prefill']} s (FLOP floor "
            f"{shown['floor']}), peak {shown['peak']} GiB (planned {shown['planned_gib']}, fits "
            f"{self.planned_fits}) {self.detail}"
        )


def parse_runs(text: str) -> list[tuple[int, str, str]]:
    """'32768:none:autoregressive,131072:kv:triforce' as (context, offload, mode) triples."""
    runs = []
    for item in text.split(","):
        context, offload, mode = item.split(":")
        runs.append((int(context), offload, mode))
    return runs


def measured_acceptance(stats) -> planner.Acceptance:
    """The per-draft acceptance a run measured, as the planner takes it (0 where a tier did not run)."""
    rates = {(a.proposer, a.verifier): a.judged_acceptance_rate for a in stats.acceptance}
    draft = rates.get(("drafter", "retrieval"), rates.get(("drafter", "target"), 0.0))
    return planner.Acceptance(draft=draft, retrieval=rates.get(("retrieval", "target"), 0.0))


def planned_row(shapes, hardware, config: EngineConfig, context: int, acceptance, dtype_bytes: int):
    """The planner's row for config's mode and offload (shapes: the target's and the drafter's)."""
    target, drafter = shapes
    workload = planner.Workload(context=context, engine=config, acceptance=acceptance, dtype_bytes=dtype_bytes)
    return planner.plan(target=target, drafter=drafter, hardware=hardware, workload=workload).row(
        config.mode, config.offload
    )


def one_run(target, drafter, shapes, hardware, context, offload, mode, args, steps) -> Run:
    """Prefill a random prompt of context tokens and decode args.new_tokens past end-of-sequence (see module), with
    the on-chip layers the planner finds room for on hardware."""
    fitted = fitted_context(context, args.new_tokens)
    run = Run(fitted, offload, mode, steps, requested_context=context)
    if fitted != context:
        run.detail = f"context {context} clamped to {fitted}: {MAX_POSITIONS} positions less the new tokens"
    device, size = target.device, target.dtype.itemsize
    reset_peak(device)
    engine = None
    try:
        with time_limit(args.run_timeout):
            config = EngineConfig(
                mode=mode,
                offload=offload,
                max_new_tokens=args.new_tokens,
                ignore_eos=True,
                gamma_policy="fixed",
                sampling=SamplingConfig(temperature=0),
            )
            plan = planned_row(shapes, hardware, config, fitted, planner.DEFAULT_ACCEPTANCE, size)
            config = replace(config, on_chip_layers=plan.on_chip_layers if offload == "kv" else 0)
            run.on_chip_layers = config.on_chip_layers
            run.planned_device_gib, run.planned_host_gib = plan.device_bytes / GIB, plan.host_bytes / GIB
            run.planned_fits = plan.fits
            run.prefill_floor_s = prefill_flops(shapes[0], fitted) / hardware.flops
            generator = torch.Generator().manual_seed(1)
            prompt = torch.randint(0, target.model.config.vocab_size, (fitted,), generator=generator)
            engine = Engine(target, config, drafter if config.uses_drafter else None)
            result = engine.generate(prompt.tolist())
    except Exception as err:  # noqa: BLE001 - whatever ends one run, the others still run
        run.outcome, detail = failure(err)
        run.detail = f"{run.detail} {detail}".strip()
        return run
    finally:
        del engine
    run.prefill_s = result.stats.prefill_seconds
    run.ms_per_token = result.stats.ms_per_token
    run.peak_device_gib = peak_gib(device)
    acceptance = measured_acceptance(result.stats)
    run.acceptance = asdict(acceptance)
    run.planned_ms_per_token = planned_row(shapes, hardware, config, fitted, acceptance, size).ms_per_token
    return run


def runs_command(args) -> int:
    device = torch.device(args.device)
    hold_memory(device, args.memory_limit_gib)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = Results(args.out, "runs")
    hardware = measured_hardware(device)
    if args.memory_limit_gib:
        hardware = planner.with_figures(hardware, memory_gb=args.memory_limit_gib)
    results.note(
        f"{hardware.name}: {hardware.bandwidth_gbs:.0f} GB/s, {hardware.tflops:.1f} TFLOP/s, PCIe "
        f"{hardware.pcie_gbs:.1f} GB/s, {hardware.memory_bytes / GIB:.1f} GiB"
    )
    shapes = SHAPES[args.shape]
    target, drafter = (random_model(shape, device, dtype) for shape in shapes)
    backend = resolve_attention(args.attention, device, dtype, "dense")
    for loaded in (target, drafter):  # as Pipeline.load sets up the models it loads
        loaded.model.use_attention(backend)
    steps = use_steps([target, drafter], args.steps, device)
    if device.type == "cuda" and steps == StepMode.EAGER:  # planned as the steps run: one kernel launch at a time
        hardware = replace(hardware, cuda_graphs=False, layer_overhead_s=EAGER_LAYER_OVERHEAD_S)
    results.note(f"attention {backend}, steps {steps}, {dtype}")
    outcomes = []
    for context, offload, mode in parse_runs(args.runs):
        run = one_run(target, drafter, shapes, hardware, context, offload, mode, args, steps)
        outcomes.append(run.outcome)
        results.add(asdict(run), run.line())
    results.note("random weights: step costs and memory are real, acceptance is not (drafts are rarely accepted)")
    return 1 if any(outcome in ("out of memory", "error") for outcome in outcomes) else 0


def table_of(profiler, device: torch.device, by: str) -> str:
    """The profiler's operators sorted by device time ('device') or host time ('host'), 30 rows."""
    if by == "host":
        key = "cpu_time_total"
    else:
        averages = profiler.key_averages()
        key = "device_time_total" if averages and hasattr(averages[0], "device_time_total") else "cuda_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=30)


def profile_generation(engine: Engine, prompt: list[int], device: torch.device, out: Path, steps: str) -> dict:
    """Profile one generation after a warm one: tables by device and host time, and the synchronisations
    torch.cuda.set_sync_debug_mode("warn") reports while it runs, into out."""
    from torch.profiler import ProfilerActivity, profile

    engine.generate(prompt)  # records or compiles the steps it takes
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with profile(activities=activities) as profiler:
                result = engine.generate(prompt)
                measure.synchronize(device)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    tables = {by: table_of(profiler, device, by) for by in (("device", "host") if device.type == "cuda" else ("host",))}
    for by, table in tables.items():
        (out / f"profile-{steps}-by-{by}-time.txt").write_text(table)
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message).lower()]
    (out / f"sync-warnings-{steps}.txt").write_text("\n".join(syncs) + "\n")
    return {
        "steps": steps,
        "decoded_tokens": result.stats.decoded_tokens,
        "ms_per_token": result.stats.ms_per_token,
        "sync_warnings": len(syncs),
        "distinct_sync_sites": len({s.split(": ", 1)[0] for s in syncs}),
    }


def step_costs(loaded: LoadedModel, shape: ModelShape, tier: str, positions: int, hardware, results: Results):
    """Median seconds of an eager step of 1, 2, 4 ... tokens after `positions` cached positions, beside its
    bandwidth and FLOP floors."""
    model, device = loaded.model, loaded.device
    cfg = model.config
    dtype = model.model.norm.weight.dtype
    cache = FullCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, positions + MAX_STEP_TOKENS, dtype, device)
    cache.length = positions  # its zeros taken as that many positions: a step reads them as it would real ones
    for tokens in STEP_TOKENS:
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        timings = []
        for _ in range(6):
            measure.synchronize(device)
            started = time.perf_counter()
            model(ids, positions, cache, num_logits=tokens)
            measure.synchronize(device)
            timings.append(time.perf_counter() - started)
        seconds = statistics.median(timings[1:])
        bytes_floor, flops_floor = step_floors(shape, tokens, positions, dtype.itemsize, hardware)
        record = {
            "tier": tier,
            "positions": positions,
            "tokens": tokens,
            "ms": 1000 * seconds,
            "bandwidth_floor_ms": 1000 * bytes_floor,
            "flops_floor_ms": 1000 * flops_floor,
        }
        results.add(
            record,
            f"{tier:>9} at {positions:>6}: {tokens:>3} tokens {1000 * seconds:8.3f} ms eager, floors "
            f"{1000 * bytes_floor:.3f} ms (bytes) {1000 * flops_floor:.3f} ms (FLOPs)",
        )


def profile_command(args) -> int:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = args.out or Path("gpu-check")
    results = Results(out, "profile")
    shapes = SHAPES[args.shape]
    target, drafter = (random_model(shape, device, dtype) for shape in shapes)
    backend = resolve_attention(args.attention, device, dtype, "dense")
    for loaded in (target, drafter):
        loaded.model.use_attention(backend)
    prompt = torch.randint(0, shapes[0].vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    config = EngineConfig(
        mode="autoregressive", max_new_tokens=args.new_tokens, ignore_eos=True, sampling=SamplingConfig(temperature=0)
    )
    failed = False
    for requested in dict.fromkeys(("eager", args.steps)):
        steps = resolve_steps(requested, device, "dense")
        if requested is None and steps == StepMode.EAGER:  # the default is eager here: profiled already
            break
        try:
            with time_limit(args.run_timeout):
                use_steps([target], steps, device)
                record = profile_generation(Engine(target, config), prompt.tolist(), device, out, steps)
            results.add(record, f"profile {steps}: {record}")
        except Exception as err:  # noqa: BLE001 - whatever ends one run, the others still run
            outcome, detail = failure(err)
            failed |= outcome != "refused"
            results.add({"steps": steps, "outcome": outcome, "detail": detail}, f"profile {steps}: {outcome} {detail}")
        if steps == "eager":  # the step costs run eager; the default step mode is set last
            try:
                hardware = measured_hardware(device)
                for loaded, shape, tier, positions in (
                    (target, shapes[0], "full", fitted_context(args.context, MAX_STEP_TOKENS)),
                    (target, shapes[0], "retrieval", RETRIEVAL_POSITIONS),
                    (drafter, shapes[1], "drafter", DRAFTER_POSITIONS),
                ):
                    with time_limit(args.run_timeout):
                        step_costs(loaded, shape, tier, positions, hardware, results)
            except Exception as err:  # noqa: BLE001 - whatever ends one run, the others still run
                outcome, detail = failure(err)
                failed = True
                results.add({"step_costs": outcome, "detail": detail}, f"step costs: {outcome} {detail}")
    return 1 if failed else 0


def embedded_checkpoints(folder: Path) -> tuple[Path, Path]:
    """A random-weight target of the embedded model's shape and a random drafter of the shipped drafter's shape
    (3 layers, the whole vocabulary), each with the shipped tokenizer, written once under folder in bfloat16."""
    import shutil

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from triforce_cli.runtime.embedded import EMBEDDED_DRAFTER

    made = []
    for name, shape in (("target", SMOLLM2_135M), ("drafter", replace(SMOLLM2_135M_DRAFTER, output_vocab=None))):
        path = folder / name
        made.append(path)
        if (path / "model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        hf = shape.llama_config(
            max_position_embeddings=8192, rope_parameters={"rope_type": "default", "rope_theta": 1e5}
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(hf).to(torch.bfloat16)
        model = model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        state = {}
        for key, tensor in model.state_dict().items():
            if hf.tie_word_embeddings and key == "lm_head.weight":
                continue
            ones = key.endswith("norm.weight")
            state[key] = (
                torch.ones_like(tensor)
                if ones
                else torch.randn(tensor.shape, generator=generator).mul_(0.02).to(tensor.dtype)
            )
        save_file(state, str(path / "model.safetensors"))
        hf.save_pretrained(path)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(EMBEDDED_DRAFTER / file, path / file)
    return made[0], made[1]


def embedded_installed() -> bool:
    """Whether the embedded model and the gguf package that reads it are installed."""
    import importlib.metadata
    import importlib.util

    from triforce_cli.runtime.embedded import EMBEDDED_DISTRIBUTION

    try:
        importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec("gguf") is not None


def cold_generate(command: list[str], timeout: int) -> dict:
    """Run a `triforce generate` command in a new process: seconds to its first byte of output (the first token:
    notes go to stderr) and in all, its exit status and its error output's last lines."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = None
    try:
        with time_limit(timeout):
            if process.stdout.read(1):
                first = time.perf_counter() - started
            process.stdout.read()
            stderr = process.stderr.read().decode(errors="replace")
            process.wait()
    except RunTimeout:
        process.kill()
        process.wait()
        return {"outcome": "timeout", "first_token_s": first, "seconds": time.perf_counter() - started}
    return {
        "outcome": "ran" if process.returncode == 0 else "error",
        "returncode": process.returncode,
        "first_token_s": first,
        "seconds": time.perf_counter() - started,
        "stderr_tail": stderr.strip().splitlines()[-3:],
    }


# how each step mode is asked of `triforce generate`: eager with --no-compile (its shorthand for --steps eager),
# the default with no flag, another mode with --steps (scripts/gpu-check.sh's STEPS)
STEP_FLAGS = {"eager": ["--no-compile"]}


def embedded_command(args) -> int:
    results = Results(args.out, "embedded")
    triforce = [sys.executable, "-m", "triforce_cli"]
    models: list[str] = []
    if embedded_installed():
        name = "embedded model"
    else:
        target, drafter = embedded_checkpoints(args.checkpoints)
        models = ["--target", str(target), "--draft", str(drafter)]
        name = "random weights of the embedded model's shape, shipped tokenizer"
    prompt = args.checkpoints / "prompt.txt"
    prompt.parent.mkdir(parents=True, exist_ok=True)
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 10))
    common = ["generate", "--prompt-file", str(prompt), *models, "--device", args.device]
    common += [
        "--max-new-tokens",
        str(args.new_tokens),
        "--ignore-eos",
        "--temperature",
        "0",
        "--gamma-policy",
        "fixed",
    ]
    failed = False
    default = args.steps or "default"
    for steps in ("eager", default):
        flags = STEP_FLAGS.get(steps, [] if steps == "default" else ["--steps", steps])
        record = {"model": name, "steps": steps, **cold_generate([*triforce, *common, *flags], args.run_timeout)}
        failed |= record["outcome"] != "ran"
        first = record["first_token_s"]
        results.add(
            record,
            f"{name}, steps {steps}: {record['outcome']}, first token "
            f"{'-' if first is None else f'{first:.1f}'} s, {record['seconds']:.1f} s in all (cold process)",
        )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument("--device", default="cuda")
    shared.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    shared.add_argument("--steps", choices=STEP_CHOICES, help="as triforce generate's (CUDA: graphs, CPU: eager)")
    shared.add_argument("--attention", default="auto", help="as triforce generate's --attention")
    shared.add_argument("--new-tokens", type=int, default=32)
    shared.add_argument("--run-timeout", type=int, default=0, help="seconds each run may take (0: no limit)")
    shared.add_argument("--out", type=Path, help="the folder the figures are appended in")
    runs = commands.add_parser("runs", parents=[shared], help="engine runs at long contexts")
    runs.add_argument(
        "--runs",
        default="32768:none:autoregressive,32768:kv:autoregressive,32768:none:triforce,131072:kv:autoregressive",
        help="CONTEXT:OFFLOAD:MODE, comma-separated",
    )
    runs.add_argument("--memory-limit-gib", type=float, default=24.0, help="the card's share to use; 0: all")
    profile = commands.add_parser("profile", parents=[shared], help="profiles and step costs")
    profile.add_argument("--prompt-tokens", type=int, default=256)
    profile.add_argument("--context", type=int, default=32768, help="cached positions of the full tier's steps")
    embedded = commands.add_parser("embedded", parents=[shared], help="cold triforce generate of the embedded shape")
    embedded.add_argument("--prompt-tokens", type=int, default=2048)
    embedded.add_argument("--checkpoints", type=Path, default=Path("gpu-check-models"))
    args = parser.parse_args()
    return {"runs": runs_command, "profile": profile_command, "embedded": embedded_command}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
