"""`triforce distill`: train a small drafter for a target; `--draft` loads the folder it writes."""

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note
from triforce_cli.cli.render import DistillBar
from triforce_cli.distill.trainer import DistillConfig, Distiller, load_teacher
from triforce_cli.interrupts import interrupted_exit_code

DISTILL_DEFAULTS = DistillConfig(builtin=("stdlib-train",))
DEFAULT_BUILTIN = ",".join(DISTILL_DEFAULTS.builtin)
DEFAULT_INIT_LAYERS = ",".join(map(str, DISTILL_DEFAULTS.init_layers))


def distill(
    out: o.DrafterFolder,
    data: o.TrainingFiles = None,
    builtin: o.TrainingBuiltin = DEFAULT_BUILTIN,
    target: o.Target = None,
    init_layers: o.InitLayers = DEFAULT_INIT_LAYERS,
    init_from: o.InitFrom = None,
    draft_vocab: o.DraftVocab = DISTILL_DEFAULTS.draft_vocab,
    self_generate: o.SelfGenerate = DISTILL_DEFAULTS.self_generate,
    self_temperature: o.SelfTemperature = DISTILL_DEFAULTS.self_temperature,
    top_k: o.DistillTopK = DISTILL_DEFAULTS.top_k,
    seq_len: o.SeqLen = DISTILL_DEFAULTS.seq_len,
    batch_size: o.BatchSize = DISTILL_DEFAULTS.batch_size,
    learning_rate: o.LearningRate = DISTILL_DEFAULTS.learning_rate,
    max_steps: o.MaxSteps = DISTILL_DEFAULTS.max_steps,
    max_minutes: o.MaxMinutes = None,
    eval_every: o.EvalEvery = DISTILL_DEFAULTS.eval_every,
    held_out_windows: o.HeldOutWindows = DISTILL_DEFAULTS.held_out_windows,
    held_out: o.HeldOut = None,
    acceptance_temperature: o.AcceptanceTemperature = DISTILL_DEFAULTS.acceptance_temperature,
    save_dtype: o.SaveDtype = DISTILL_DEFAULTS.save_dtype,
    seed: o.DistillSeed = DISTILL_DEFAULTS.seed,
    resume: o.Resume = False,
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
