"""Step costs and memory of a random-weight Llama-3.1-8B-shaped target on a GPU held to 24 GiB, beside what
`triforce plan` predicts for an RTX 4090 (scripts/gpu-check.sh runs it).

Random weights give real step costs and real memory, not acceptance: a random drafter's tokens are rarely
accepted, so the speculative modes' ms/token here is a floor on cost, not a speed-up. Each context and offload
setting prefills a random prompt once per mode and decodes --new-tokens tokens past end-of-sequence.

    python3 scripts/gpu_check.py                          # 32K and 128K, on the device and --offload kv
    python3 scripts/gpu_check.py --device cpu --shape tiny --contexts 512 --memory-limit-gib 0   # a smoke run

Where the planner says a setting does not fit, the engine must refuse it before allocating (one ConfigError line);
an out-of-memory error anywhere is a defect and is reported as one.
"""

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import resolve_attention
from triforce_cli.errors import ConfigError
from triforce_cli.plan import MODELS
from triforce_cli.plan.model import ModelShape
from triforce_cli.plan.presets import LLAMA_3_1_ROPE
from triforce_cli.runtime.forms import STEP_CHOICES
from triforce_cli.runtime.loading import LoadedModel, resolve_steps
from triforce_cli.runtime.model import ModelConfig, RMSNorm, Transformer, rope_frequencies

GIB = 2**30
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
    "llama-3.1-8b": (MODELS["Llama-3.1-8B"].target, MODELS["Llama-3.1-8B"].drafter),
    "tiny": (TINY, TINY),
}


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
    """A runtime Transformer of shape with weights drawn N(0, 0.02) on device, RoPE scaled as Llama 3.1's."""
    hf = shape.llama_config(max_position_embeddings=131072, rope_parameters=LLAMA_3_1_ROPE)
    inv_freq, rope_scale = rope_frequencies(hf, shape.head_dim)
    with torch.device("meta"):  # as the loader builds a model: nothing allocated until to_empty
        model = Transformer(ModelConfig.from_hf(hf), inv_freq, rope_scale)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
    model.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # float32, as the loader keeps it
    return LoadedModel(f"random {shape.name}", model.eval(), IdTokenizer(shape.vocab_size), hf)


def planned(context: int, hardware: str) -> dict[tuple[str, str], dict]:
    """`triforce plan --json` rows for Llama-3.1-8B at context on hardware, by (mode, offload)."""
    command = [
        "triforce",
        "plan",
        "--model",
        "Llama-3.1-8B",
        "--hardware",
        hardware,
        "--context",
        str(context),
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return {(row["mode"], row["offload"]): row for row in json.loads(result.stdout)["rows"]}


@dataclass
class Run:
    context: int
    offload: str
    mode: str
    outcome: str  # "ran", "refused" (the engine's memory check) or "out of memory" (a defect)
    detail: str = ""
    prefill_s: float | None = None
    ms_per_token: float | None = None
    peak_device_gib: float | None = None
    planned_device_gib: float | None = None
    planned_host_gib: float | None = None
    planned_fits: bool | None = None
    planned_ms_per_token: float | None = None
    on_chip_layers: int = 0


def measure(target, drafter, context, offload, mode, new_tokens, plan_row) -> Run:
    on_chip = plan_row["on_chip_layers"] if plan_row and offload == "kv" else 0
    config = EngineConfig(
        mode=mode,
        offload=offload,
        on_chip_layers=on_chip,
        max_new_tokens=new_tokens,
        ignore_eos=True,
        sampling=SamplingConfig(temperature=0),
    )
    run = Run(context, offload, mode, "ran", on_chip_layers=on_chip)
    if plan_row:
        run.planned_device_gib = plan_row["device_bytes"] / GIB
        run.planned_host_gib = plan_row["host_bytes"] / GIB
        run.planned_fits = plan_row["fits"]
        run.planned_ms_per_token = plan_row["ms_per_token"]
    device = target.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    prompt = torch.randint(0, target.model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1))
    try:
        engine = Engine(target, config, drafter if config.uses_drafter else None)
        started = time.perf_counter()
        result = engine.generate(prompt.tolist())
        del engine
    except ConfigError as err:
        run.outcome, run.detail = "refused", str(err)
        return run
    except torch.OutOfMemoryError as err:
        run.outcome, run.detail = "out of memory", str(err).splitlines()[0]
        return run
    run.prefill_s = result.stats.prefill_seconds
    run.ms_per_token = result.stats.ms_per_token
    run.detail = f"{time.perf_counter() - started:.1f} s in all"
    if device.type == "cuda":
        run.peak_device_gib = torch.cuda.max_memory_allocated(device) / GIB
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=SHAPES, default="llama-3.1-8b")
    parser.add_argument("--contexts", default="32768,131072", help="comma-separated prompt lengths")
    parser.add_argument("--offloads", default="none,kv")
    parser.add_argument("--modes", default="autoregressive,triforce")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--memory-limit-gib", type=float, default=24.0, help="the card's share this run may use; 0: all"
    )
    parser.add_argument("--hardware", default="rtx-4090", help="the planner's machine to compare with")
    parser.add_argument("--attention", default="auto", help="as triforce generate's --attention")
    parser.add_argument(
        "--steps", choices=STEP_CHOICES, default=None, help="as triforce generate's (CUDA: graphs, CPU: eager)"
    )
    parser.add_argument("--out", help="also write the runs here as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda" and args.memory_limit_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_limit_gib * GIB / total), device)
    contexts = [int(c) for c in args.contexts.split(",")]
    target, drafter = (random_model(shape, device, dtype) for shape in SHAPES[args.shape])
    backend = resolve_attention(args.attention, device, dtype, "dense")
    steps = resolve_steps(args.steps, device, "dense")
    for loaded in (target, drafter):  # as Pipeline.load sets up the models it loads
        loaded.model.use_attention(backend)
        loaded.model.use_steps(steps)
    print(
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}: attention {backend}, "
        f"{steps} steps, {dtype}",
        flush=True,
    )
    runs = []
    for context in contexts:
        plan = planned(context, args.hardware) if args.shape == "llama-3.1-8b" else {}
        for offload in args.offloads.split(","):
            for mode in args.modes.split(","):
                run = measure(target, drafter, context, offload, mode, args.new_tokens, plan.get((mode, offload)))
                runs.append(run)
                print(json.dumps(run.__dict__), flush=True)
    print(
        f"\n{'context':>8} {'offload':>7} {'mode':>14} {'outcome':>13} {'ms/token':>9} {'planned':>8} "
        f"{'peak GiB':>9} {'planned GiB':>11} {'planned fits':>12}"
    )
    for run in runs:
        figures = (run.ms_per_token, run.planned_ms_per_token, run.peak_device_gib, run.planned_device_gib)
        shown = ["-" if f is None else f"{f:.1f}" for f in figures]
        print(
            f"{run.context:>8} {run.offload:>7} {run.mode:>14} {run.outcome:>13} {shown[0]:>9} {shown[1]:>8} "
            f"{shown[2]:>9} {shown[3]:>11} {run.planned_fits!s:>12}"
        )
    print("\nrandom weights: step costs and memory are real, acceptance is not (drafts are rarely accepted)")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump([run.__dict__ for run in runs], handle, indent=1)
    return 1 if any(run.outcome == "out of memory" for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
