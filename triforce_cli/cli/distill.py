"""`triforce distill`: train a small drafter for a target; `--draft` loads the folder it writes."""

from pathlib import Path
from typing import Annotated

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note
from triforce_cli.cli.render import DistillBar
from triforce_cli.corpus import BUILTIN_NAMES
from triforce_cli.distill.trainer import SAVE_DTYPES, DistillConfig, Distiller, load_teacher
from triforce_cli.interrupts import interrupted_exit_code

DISTILL_DEFAULTS = DistillConfig(builtin=("stdlib-train",))
DEFAULT_BUILTIN = ",".join(DISTILL_DEFAULTS.builtin)
DEFAULT_INIT_LAYERS = ",".join(map(str, DISTILL_DEFAULTS.init_layers))


def layer_numbers(value: str | tuple) -> tuple[int, ...]:
    """Parser of '0,1,29' -> (0, 1, 29)."""
    if isinstance(value, tuple):
        return value
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a list of layer numbers (e.g. 0,1,2,3)") from None


DrafterFolder = Annotated[
    Path, typer.Option(parser=o.folder_path, metavar="DIR", help="Folder to write the drafter (and its checkpoint) to.")
]
TrainingFiles = Annotated[
    list[Path] | None,
    typer.Option("--data", "-d", metavar="FILE", help="Training text file; repeat for several."),
]
TrainingBuiltin = Annotated[
    tuple,
    typer.Option(
        parser=o.names_of(BUILTIN_NAMES, allow_none=True),
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
SaveDtype = o.one_of(tuple(SAVE_DTYPES), "Dtype of the written weights.")
DistillSeed = Annotated[
    int,
    typer.Option(
        min=0, max=o.MAX_SEED, metavar="SEED", help="Seed of the split, the sampling and the initial weights."
    ),
]
Resume = Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in --out.")]


def distill(
    out: DrafterFolder,
    data: TrainingFiles = None,
    builtin: TrainingBuiltin = DEFAULT_BUILTIN,
    target: o.Target = None,
    init_layers: InitLayers = DEFAULT_INIT_LAYERS,
    init_from: InitFrom = None,
    draft_vocab: DraftVocab = DISTILL_DEFAULTS.draft_vocab,
    self_generate: SelfGenerate = DISTILL_DEFAULTS.self_generate,
    self_temperature: SelfTemperature = DISTILL_DEFAULTS.self_temperature,
    top_k: DistillTopK = DISTILL_DEFAULTS.top_k,
    seq_len: SeqLen = DISTILL_DEFAULTS.seq_len,
    batch_size: BatchSize = DISTILL_DEFAULTS.batch_size,
    learning_rate: LearningRate = DISTILL_DEFAULTS.learning_rate,
    max_steps: MaxSteps = DISTILL_DEFAULTS.max_steps,
    max_minutes: MaxMinutes = None,
    eval_every: EvalEvery = DISTILL_DEFAULTS.eval_every,
    held_out_windows: HeldOutWindows = DISTILL_DEFAULTS.held_out_windows,
    held_out: HeldOut = None,
    acceptance_temperature: AcceptanceTemperature = DISTILL_DEFAULTS.acceptance_temperature,
    save_dtype: SaveDtype = DISTILL_DEFAULTS.save_dtype,
    seed: DistillSeed = DISTILL_DEFAULTS.seed,
    resume: Resume = False,
    threads: o.Threads = None,
) -> None:
    """Train a small drafter for a target with the top-K distillation loss (HASS); --draft loads the result."""
    with command_console(threads) as err:
        config = DistillConfig(
            data=tuple(str(path) for path in data or ()),
            builtin=builtin,
            init_layers=init_layers,
            init_from=str(init_from) if init_from is not None else None,
            draft_vocab=draft_vocab,
            self_generate=self_generate,
            self_temperature=self_temperature,
            seq_len=seq_len,
            batch_size=batch_size,
            top_k=top_k,
            learning_rate=learning_rate,
            max_steps=max_steps,
            held_out_windows=held_out_windows,
            held_out_text=tuple(held_out or ()),
            eval_every=eval_every,
            acceptance_temperature=acceptance_temperature,
            save_dtype=save_dtype,
            seed=seed,
        )
        checkpoint, teacher, tokenizer = load_teacher(target, status=lambda message: print_note(err, message))
        distiller = Distiller(config, teacher, tokenizer, checkpoint, out, resume=resume)
        with DistillBar(err) as bar:
            try:
                result = distiller.run(bar, max_minutes)
            except KeyboardInterrupt:
                result = distiller.stop(interrupted=True)
        held = result.history[-1] if result.history else None
        summary = f"{result.steps} steps, {result.tokens} tokens, {result.seconds / 60:.1f} min"
        if held is not None:
            summary += f"; held-out acceptance {held['acceptance']:.1%} (greedy {held['greedy_acceptance']:.1%})"
        print_note(err, summary)
        if result.steps:
            print_note(err, f"drafter written to {result.folder}: use it with --draft {result.folder}")
        if not result.finished:
            print_note(err, f"stopped before --max-steps {config.max_steps}: continue with --resume")
            raise typer.Exit(interrupted_exit_code() if result.interrupted else 0)
