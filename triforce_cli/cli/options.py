"""The options several commands share (models, machine, decoding, sampling, the prompt cache), each declared once
with the defaults it takes, and the parameter types that read token counts, lists and devices. An option only one
command takes is declared beside that command (cli/generate.py, chat.py, bench.py, serve.py, distill.py, plan.py).

A command names each option it takes in its own signature, named as the LoadOptions, EngineConfig or SamplingConfig
field it sets, so that cli/settings.py builds those from the command's values. A value that cannot be read
(``--budget 1e400k``, ``--device gpu``, ``--threads 0``) is a usage error, which the application prints as one
line (cli/app.py). Explanations live in the README and docs/commands.md; help texts stay one or two lines.
"""

import math
from pathlib import Path
from typing import Annotated, Literal

import typer

from triforce_cli.decoding.config import GAMMA_POLICIES, MODES, EngineConfig
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import DTYPES, LoadOptions
from triforce_cli.kernels import ATTENTION_BACKENDS, CHUNK_SCORES
from triforce_cli.runtime.forms import OFFLOAD_CHOICES, STEP_CHOICES, WEIGHT_CHOICES, StepMode

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_TOKENS = 2**30  # far beyond any context a model or a cache here can hold
MAX_THREADS = 1024
MAX_LAYERS = 1024  # decoder layers of any model this runtime loads

# The defaults of the shared options: the library's own
LOAD_DEFAULTS, ENGINE_DEFAULTS, SAMPLING_DEFAULTS = LoadOptions(), EngineConfig(), SamplingConfig()


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


def folder_path(value: str | Path) -> Path:
    """Parser of a folder option: a path that is not blank (Path("") would mean the current folder)."""
    if not str(value).strip():
        raise typer.BadParameter("give a folder, not an empty path")
    return Path(value)


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
PromptCache = Annotated[
    Path | None,
    typer.Option(
        parser=folder_path,
        metavar="DIR",
        help="Folder to save prefilled prompts in and reuse them from (e.g. ~/.cache/triforce-cli/prompts).",
    ),
]
JsonOutput = Annotated[bool, typer.Option("--json", help="Print one JSON object and nothing else.")]
