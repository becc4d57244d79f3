"""Every command-line option declared once, with the parameter types that read token counts, lists and devices.

A value that cannot be read (``--budget 1e400k``, ``--device gpu``, ``--threads 0``) is a usage error, which the
application prints as one line (cli/app.py). Explanations live in the README; help texts stay one or two lines.
"""

import functools
import inspect
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import typer

from triforce_cli.bench.runner import ALL_MODES
from triforce_cli.corpus import BENCH_PROMPTS, BUILTIN_NAMES
from triforce_cli.decoding.config import GAMMA_POLICIES, MODES, EngineConfig
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import DTYPES, LoadOptions
from triforce_cli.distill.trainer import SAVE_DTYPES
from triforce_cli.kernels import ATTENTION_BACKENDS, CHUNK_SCORES
from triforce_cli.runtime.forms import OFFLOAD_CHOICES, STEP_CHOICES, WEIGHT_CHOICES, StepMode

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_TOKENS = 2**30  # far beyond any context a model or a cache here can hold
MAX_THREADS = 1024
MAX_LAYERS = 1024  # decoder layers of any model this runtime loads
MAX_REPEATS = 100


def parse_token_count(text: str) -> int:
    """'7.5k' -> 7680, '4096' -> 4096; a ValueError saying what is wrong for anything but a positive count."""
    cleaned = text.strip().lower()
    scale = 1024 if cleaned.endswith("k") else 1
    try:
        value = float(cleaned.removesuffix("k")) * scale
    except ValueError:
        raise ValueError(f"'{text}' is not a token count (e.g. 2k, 7.5k or 4096)") from None
    if not math.isfinite(value) or value < 1 or value != round(value) and scale == 1:
        raise ValueError(f"'{text}' is not a positive whole token count")
    if value > MAX_TOKENS:
        raise ValueError(f"'{text}' is more than the {MAX_TOKENS // 2**20}M tokens any setting can use")
    return round(value)


def token_count(value: str | int) -> int:
    """Parser of one positive token count (2k, 7.5k, 4096)."""
    if isinstance(value, int):
        return value
    try:
        return parse_token_count(value)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def token_counts(value: str | tuple) -> tuple[int, ...]:
    """Parser of comma-separated token counts: 2k,7.5k,32k -> (2048, 7680, 32768)."""
    if isinstance(value, tuple):
        return value
    return tuple(token_count(part) for part in str(value).split(","))


def budgets(value: str | tuple) -> tuple[int | None, ...]:
    """Parser of 'auto' (min(1024, prompt), as None) or comma-separated token counts."""
    return (None,) if value == "auto" else token_counts(value)


def names_of(choices: tuple[str, ...], allow_none: bool = False):
    """Parser of comma-separated names, each one of choices (and '' for none where allow_none)."""

    def parse(value: str | tuple) -> tuple[str, ...]:
        if isinstance(value, tuple):
            return value
        names = tuple(name.strip() for name in str(value).split(",") if name.strip())
        if (not names and not allow_none) or any(name not in choices for name in names):
            raise typer.BadParameter(f"'{value}': choose from {', '.join(choices)}")
        return names

    return parse


def completions(choices: tuple[str, ...]):
    """Shell completion of the last comma-separated name among choices."""

    def complete(incomplete: str) -> list[str]:
        head, _, last = incomplete.rpartition(",")
        return [f"{head},{c}" if head else c for c in choices if c.startswith(last)]

    return complete


def one_of(choices: tuple[str, ...], help: str):
    """An option that takes one of choices, listed as its metavar."""
    return Annotated[Literal[choices], typer.Option(metavar="|".join(choices), help=help)]


def some_of(flag: str, choices: tuple[str, ...], name: str, help: str):
    """An option that takes comma-separated names among choices, completed in the shell; name: its metavar's."""
    parse, complete = names_of(choices), completions(choices)
    return Annotated[tuple, typer.Option(flag, parser=parse, metavar=f"{name},...", autocompletion=complete, help=help)]


DEVICES = ("auto", "cpu", "cuda")


def device_name(value: str) -> str:
    """Parser of auto, cpu or cuda, the last two optionally with a device index (cuda:1)."""
    kind, _, index = value.partition(":")
    if value != "auto" and (kind not in DEVICES[1:] or ":" in value and not index.isdigit()):
        raise typer.BadParameter(f"'{value}' is not one of auto, cpu, cuda, cuda:N")
    return value


# Models
Target = Annotated[
    str | None,
    typer.Option(
        metavar="MODEL", help="Target model: folder, .safetensors, .gguf or hub id [default: embedded model]."
    ),
]
Draft = Annotated[
    str | None,
    typer.Option(
        metavar="MODEL|self",
        help="Drafter sharing the target's tokenizer, or 'self' [default: the shipped drafter where it fits the"
        " target, else self].",
    ),
]
Weights = one_of(
    WEIGHT_CHOICES,
    "Weight form; auto: on a CPU in float32 the one measured fastest for the target here (gguf for a GGUF file,"
    " half or dense), dense elsewhere.",
)
Dtype = one_of(("auto", *DTYPES), "Compute dtype (auto: bfloat16 on GPU).")
Device = Annotated[
    str,
    typer.Option(
        parser=device_name, metavar="auto|cpu|cuda[:N]", autocompletion=completions(DEVICES), help="Where to run."
    ),
]
Attention = one_of(
    ("auto", *ATTENTION_BACKENDS),
    "Attention kernels: auto picks flash on CUDA where installed, else sdpa; cpu on a CPU.",
)
Steps = Annotated[
    StepMode | None,
    typer.Option(
        metavar="|".join(STEP_CHOICES),
        help="How decode steps run: eager, graphs (each step length recorded once as a CUDA graph) or compiled"
        " (compiled by inductor first, then recorded) [default: graphs on CUDA, eager on a CPU].",
        show_default=False,
    ),
]
Compile = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Shorthands for --steps compiled and --steps eager.",
        show_default=False,
    ),
]
Threads = Annotated[
    int | None, typer.Option(min=1, max=MAX_THREADS, metavar="N", help="CPU threads for torch [default: torch's].")
]
ContextWindow = Annotated[
    int | None,
    typer.Option(parser=token_count, metavar="TOKENS", help="Positions to accept, e.g. 32k (YaRN-scaled RoPE)."),
]

# Decoding
Mode = one_of(MODES, "Tiers to run (see the README).")
Budget = Annotated[
    int | None,
    typer.Option(parser=token_count, metavar="TOKENS", help="Retrieval-cache budget [default: min(1024, prompt)]."),
]
ChunkSize = Annotated[int, typer.Option(parser=token_count, metavar="TOKENS", help="Retrieval-cache chunk size.")]
ChunkScore = one_of(
    CHUNK_SCORES, "Retrieval chunk score: mean (the chunk's mean key) or bound (Quest's min/max-key bound)."
)
DraftWindow = Annotated[
    int, typer.Option(parser=token_count, metavar="TOKENS", help="Drafter StreamingLLM recent window.")
]
SinkTokens = Annotated[
    int, typer.Option(min=0, max=MAX_TOKENS, metavar="N", help="Drafter StreamingLLM attention sinks.")
]
Gamma1 = Annotated[
    int, typer.Option(min=1, metavar="N", help="Drafter tokens per verification (a ceiling if adaptive).")
]
Gamma2 = Annotated[
    int, typer.Option(min=1, metavar="N", help="Tokens the full cache verifies per pass (a ceiling if adaptive).")
]
GammaPolicy = one_of(GAMMA_POLICIES, "Speculation lengths: fixed, or adapted after every verification.")
Ngram = Annotated[
    bool | None,
    typer.Option(
        "--ngram/--no-ngram",
        help="N-gram prompt lookup drafts first [default: where there is a drafter]; --no-ngram: the drafter alone.",
        show_default=False,
    ),
]
RefreshInterval = Annotated[
    int, typer.Option(min=1, metavar="N", help="Full verifications between retrieval-chunk selections.")
]
MaxNewTokens = Annotated[int, typer.Option(parser=token_count, metavar="TOKENS", help="Tokens to generate at most.")]
Offload = one_of(
    OFFLOAD_CHOICES,
    "kv: the target's full KV cache in host memory, streamed to the GPU layer by layer; kv+weights: its layers'"
    " weights too.",
)
OnChipLayers = Annotated[
    int,
    typer.Option(
        min=0,
        max=MAX_LAYERS,
        metavar="N",
        help="With --offload kv: the first layers whose KV cache stays on the GPU (every layer: nothing offloaded).",
    ),
]
IgnoreEos = Annotated[
    bool, typer.Option("--ignore-eos", help="Generate --max-new-tokens tokens even past end-of-sequence.")
]

# Sampling
Temperature = Annotated[float, typer.Option(min=0.0, metavar="FLOAT", help="0 is greedy.")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, metavar="FLOAT", help="Nucleus sampling mass, above 0.")]
TopK = Annotated[int, typer.Option(min=0, metavar="K", help="Keep the k most likely tokens; 0 keeps all.")]
Seed = Annotated[int | None, typer.Option(min=0, max=MAX_SEED, metavar="SEED", help="Random seed for sampling.")]

# Files
PromptFile = Annotated[
    str, typer.Option("--prompt-file", "-p", metavar="FILE", help="Prompt text file; '-' reads stdin.")
]
DocumentFile = Annotated[
    str, typer.Option("--prompt-file", "-p", metavar="FILE", help="Text file of the document to ask about.")
]
SystemPrompt = Annotated[
    str | None,
    typer.Option(metavar="TEXT", help="A system prompt opening the conversation.", show_default=False),
]
PromptCache = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        help="Folder to save prefilled prompts in and reuse them from (e.g. ~/.cache/triforce-cli/prompts).",
    ),
]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap the prompt as a user turn of the model's chat template.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object and nothing else.")]

# Serving
Host = Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on; 0.0.0.0 serves other machines too.")]
Port = Annotated[int, typer.Option(min=0, max=65535, metavar="PORT", help="TCP port to listen on.")]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="TRIFORCE_API_KEY",
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health.",
        show_default=False,
    ),
]
QueueSize = Annotated[
    int, typer.Option(min=1, max=4096, metavar="N", help="Requests that may wait for the model; more get 503.")
]
ServedModelName = Annotated[
    str | None, typer.Option(metavar="NAME", help="The model id clients send [default: the target's name].")
]
MaxTokensLimit = Annotated[
    int | None,
    typer.Option(
        min=1,
        metavar="N",
        help="The most new tokens one request may ask for; more is a 400 [default: what the context holds].",
        show_default=False,
    ),
]
RequestTimeout = Annotated[
    float | None,
    typer.Option(
        min=0.001,
        metavar="SECONDS",
        help="A request still waiting or generating after this long ends with a 504 [default: none].",
        show_default=False,
    ),
]
MaxBodyBytes = Annotated[
    int, typer.Option(min=1024, metavar="BYTES", help="The largest request body accepted; larger ones get 413.")
]
CorsOrigin = Annotated[
    list[str] | None,
    typer.Option(
        metavar="ORIGIN",
        help="A browser origin allowed to call the API (CORS), e.g. http://localhost:3000; '*' for any; repeatable.",
        show_default=False,
    ),
]
ShutdownGrace = Annotated[
    float,
    typer.Option(
        min=0,
        metavar="SECONDS",
        help="On SIGINT/SIGTERM, how long the running request may go on before it is cancelled.",
    ),
]

# Bench sweeps: comma-separated lists
BENCH_MODE_CHOICES = ("default", *ALL_MODES)
BenchModes = some_of(
    "--modes", BENCH_MODE_CHOICES, "MODE", "Our modes and the peers to time: " + ", ".join(BENCH_MODE_CHOICES) + "."
)
Contexts = Annotated[
    tuple, typer.Option("--context", parser=token_counts, metavar="TOKENS,...", help="Context lengths, e.g. 2k,32k.")
]
BudgetSweep = Annotated[
    tuple, typer.Option("--budget", parser=budgets, metavar="auto|TOKENS,...", help="Retrieval budgets to sweep.")
]
ChunkSizeSweep = Annotated[
    tuple, typer.Option("--chunk-size", parser=token_counts, metavar="TOKENS,...", help="Chunk sizes to sweep.")
]
GammaPolicySweep = some_of("--gamma-policy", GAMMA_POLICIES, "POLICY", "Speculation-length policies to sweep.")
ForwardCosts = Annotated[
    tuple | None,
    typer.Option(parser=token_counts, metavar="T,...", help="Also time one target forward of T tokens, e.g. 1,2,4,8."),
]

# Bench runs
BenchPromptFiles = Annotated[
    list[Path] | None,
    typer.Option("--prompt-file", "-p", metavar="FILE", help="Prompt file; repeat for several."),
]
CONTINUED = ", ".join(name for name, prompt in BENCH_PROMPTS.items() if prompt.request is None)
ASKED = ", ".join(name for name, prompt in BENCH_PROMPTS.items() if prompt.request is not None)
BenchBuiltin = Annotated[
    tuple,
    typer.Option(
        parser=names_of(tuple(BENCH_PROMPTS)),
        metavar="NAME,...",
        help=f"Built-in prompts when no file is given: documents continued ({CONTINUED}) and chat turns "
        f"asking about a document ({ASKED}; they need a chat template). Files are continued. qa: the prompts' "
        "documents [default: qa-stdlib-b's].",
    ),
]
Repeats = Annotated[int, typer.Option(min=1, max=MAX_REPEATS, metavar="N", help="Timed runs of every mode.")]
Warmup = Annotated[int, typer.Option(min=0, max=MAX_REPEATS, metavar="N", help="Untimed runs of every mode first.")]
Scenario = Annotated[
    Literal["decode", "qa"],
    typer.Option(
        metavar="decode|qa",
        help="decode: per-token latency of each prompt; qa: one document, questions asked in turn as a chat, "
        "the time to each answer.",
    ),
]
Questions = Annotated[
    Path | None,
    typer.Option(metavar="FILE", help="qa: the questions, one per line [default: built-in ones]."),
]
ResultsFile = Annotated[Path | None, typer.Option(metavar="FILE", help="Write the results to a .json or .csv file.")]
PlotFile = Annotated[Path | None, typer.Option(metavar="FILE", help="Write a PNG of latency against context length.")]


# Distillation
def layer_numbers(value: str | tuple) -> tuple[int, ...]:
    """Parser of '0,1,29' -> (0, 1, 29)."""
    if isinstance(value, tuple):
        return value
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a list of layer numbers (e.g. 0,1,2,3)") from None


DrafterFolder = Annotated[
    Path, typer.Option(metavar="DIR", help="Folder to write the drafter (and its checkpoint) to.")
]
TrainingFiles = Annotated[
    list[Path] | None,
    typer.Option("--data", "-d", metavar="FILE", help="Training text file; repeat for several."),
]
TrainingBuiltin = Annotated[
    tuple,
    typer.Option(
        parser=names_of(BUILTIN_NAMES, allow_none=True),
        metavar="NAME,...",
        help=f"Built-in training text from: {', '.join(BUILTIN_NAMES)}; '' for none.",
    ),
]
InitLayers = Annotated[
    tuple,
    typer.Option(parser=layer_numbers, metavar="N,...", help="Target layers the drafter starts from, in order."),
]
InitFrom = Annotated[
    Path | None,
    typer.Option(
        metavar="DIR",
        help="Start from this drafter folder (distilled for the same target) instead of target layers.",
    ),
]
DraftVocab = Annotated[
    int,
    typer.Option(metavar="N", help="Tokens the drafter's output layer covers (the most frequent in the data); 0: all."),
]
SelfGenerate = Annotated[
    int,
    typer.Option(metavar="N", help="Extra training windows the target writes itself (aligns the drafter's context)."),
]
SelfTemperature = Annotated[float, typer.Option(metavar="FLOAT", help="Temperature of the target's own windows.")]
DistillTopK = Annotated[int, typer.Option(metavar="K", help="Target tokens per position in the top-K loss.")]
SeqLen = Annotated[int, typer.Option(metavar="N", help="Tokens per training window.")]
BatchSize = Annotated[int, typer.Option(metavar="N", help="Windows per step.")]
LearningRate = Annotated[float, typer.Option(metavar="FLOAT", help="Peak AdamW learning rate.")]
MaxSteps = Annotated[int, typer.Option(metavar="N", help="Training steps (the learning-rate schedule spans them).")]
MaxMinutes = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        max=1e6,
        metavar="MINUTES",
        help="Stop after this many minutes, saving a checkpoint to --resume from.",
    ),
]
EvalEvery = Annotated[int, typer.Option(metavar="STEPS", help="Steps between held-out evaluations and checkpoints.")]
HeldOutWindows = Annotated[
    int,
    typer.Option(
        metavar="N", help="Windows of real text the held-out acceptance is measured on (kept out of training)."
    ),
]
HeldOut = Annotated[
    list[str] | None,
    typer.Option(
        metavar="FILE|NAME",
        help="Measure the held-out acceptance on this text (a file, or a built-in name as for --builtin; repeat "
        "for several) rather than on windows cut from the training text, which share its documents.",
    ),
]
AcceptanceTemperature = Annotated[float, typer.Option(metavar="FLOAT", help="Temperature of the held-out acceptance.")]
SaveDtype = one_of(tuple(SAVE_DTYPES), "Dtype of the written weights.")
DistillSeed = Annotated[
    int,
    typer.Option(min=0, max=MAX_SEED, metavar="SEED", help="Seed of the split, the sampling and the initial weights."),
]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in --out.")]


# Options several commands take, each with its default: a command names those it takes with `takes`, so each is
# declared here once and reaches the command in its **settings, named as the LoadOptions, EngineConfig or
# SamplingConfig field it sets (cli/settings.py builds those from them).
LOAD_DEFAULTS, ENGINE_DEFAULTS, SAMPLING_DEFAULTS = LoadOptions(), EngineConfig(), SamplingConfig()
SHARED: dict[str, tuple[object, object]] = {
    "target": (Target, LOAD_DEFAULTS.target),
    "draft": (Draft, LOAD_DEFAULTS.draft),
    "mode": (Mode, ENGINE_DEFAULTS.mode),
    "budget": (Budget, ENGINE_DEFAULTS.budget),
    "chunk_size": (ChunkSize, ENGINE_DEFAULTS.chunk_size),
    "chunk_score": (ChunkScore, ENGINE_DEFAULTS.chunk_score),
    "draft_window": (DraftWindow, ENGINE_DEFAULTS.draft_window),
    "sink_tokens": (SinkTokens, ENGINE_DEFAULTS.sink_tokens),
    "gamma1": (Gamma1, ENGINE_DEFAULTS.gamma1),
    "gamma2": (Gamma2, ENGINE_DEFAULTS.gamma2),
    "gamma_policy": (GammaPolicy, ENGINE_DEFAULTS.gamma_policy),
    "ngram": (Ngram, ENGINE_DEFAULTS.ngram),
    "refresh_interval": (RefreshInterval, ENGINE_DEFAULTS.refresh_interval),
    "max_new_tokens": (MaxNewTokens, ENGINE_DEFAULTS.max_new_tokens),
    "ignore_eos": (IgnoreEos, ENGINE_DEFAULTS.ignore_eos),
    "temperature": (Temperature, SAMPLING_DEFAULTS.temperature),
    "top_p": (TopP, SAMPLING_DEFAULTS.top_p),
    "top_k": (TopK, SAMPLING_DEFAULTS.top_k),
    "seed": (Seed, SAMPLING_DEFAULTS.seed),
    "dtype": (Dtype, LOAD_DEFAULTS.dtype),
    "device": (Device, LOAD_DEFAULTS.device),
    "threads": (Threads, LOAD_DEFAULTS.threads),
    "weights": (Weights, LOAD_DEFAULTS.weights),
    "attention": (Attention, LOAD_DEFAULTS.attention),
    "steps": (Steps, LOAD_DEFAULTS.steps),
    "compile_steps": (Compile, None),
    "offload": (Offload, ENGINE_DEFAULTS.offload),
    "on_chip_layers": (OnChipLayers, ENGINE_DEFAULTS.on_chip_layers),
    "context_window": (ContextWindow, LOAD_DEFAULTS.context_window),
    "prompt_cache": (PromptCache, None),
}
MODELS = ("target", "draft")
DRAFTING = ("draft_window", "sink_tokens", "gamma1", "gamma2")  # the drafter's cache and the speculation lengths
ENGINE = ("mode", "budget", "chunk_size", "chunk_score", *DRAFTING, "gamma_policy", "ngram", "refresh_interval")
SAMPLING = ("temperature", "top_p", "top_k", "seed")
MACHINE = (
    "dtype",
    "device",
    "threads",
    "weights",
    "attention",
    "steps",
    "compile_steps",
    "offload",
    "on_chip_layers",
    "context_window",
)


def takes(*names: str, after: str | None = None, **defaults):
    """A command that also takes the shared options names (SHARED; defaults: another default for some), passed to
    it in its **settings and listed in its help after its parameter `after` (None: its first).

    Returns:
        A decorator: the command with a signature of its own parameters and those options (keyword-only), which
        typer reads, and which calls the command with all of them by name.
    """

    def decorate(command: Callable) -> Callable:
        own = [p for p in inspect.signature(command).parameters.values() if p.kind is not p.VAR_KEYWORD]
        at = 1 if after is None else [p.name for p in own].index(after) + 1
        shared = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=SHARED[name][0], default=value)
            for name in names
            for value in [defaults.get(name, SHARED[name][1])]
        ]
        parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        parameters[at:at] = shared

        @functools.wraps(command)
        def run(**values):
            return command(**values)

        run.__signature__ = inspect.Signature(parameters, return_annotation=None)
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        return run

    return decorate
