"""The `triforce` command line: thin Typer commands over the library API."""

import json
import shlex
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.text import Text

from triforce_cli.bench.llama_cpp import LLAMA_CPP_PEER
from triforce_cli.bench.report import (
    bench_table,
    check_results_path,
    forward_cost_table,
    plot_latency,
    pyplot,
    write_results,
)
from triforce_cli.bench.runner import ALL_MODES, DEFAULT_MODES, Bench, BenchConfig, default_modes
from triforce_cli.cli.render import DistillBar, PrefillProgress, TokenStream, print_summary, tier_legend
from triforce_cli.corpus import BUILTIN_NAMES, DOCUMENTS, builtin_document
from triforce_cli.decoding.config import GAMMA_POLICIES, MODES, EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.distill.trainer import DistillConfig, Distiller, load_teacher
from triforce_cli.errors import ConfigError, PromptError, TriforceError
from triforce_cli.runtime.prompts import read_prompt

app = typer.Typer(
    help="Lossless long-context speculative generation (TriForce: drafter -> retrieval cache -> full cache).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
DEFAULTS = EngineConfig()
SAMPLING_DEFAULTS = SamplingConfig()
BENCH_DEFAULTS = BenchConfig()
INTERRUPTED_EXIT_CODE = 130

Target = Annotated[
    str | None, typer.Option(help="Target model: folder, .safetensors, .gguf or hub id (default: embedded).")
]
Draft = Annotated[
    str | None,
    typer.Option(
        help="Drafter sharing the target's tokenizer, or 'self' for the target on a StreamingLLM cache "
        "(default: the embedded model's distilled drafter; the target itself for other targets)."
    ),
]
ChunkSize = Annotated[int, typer.Option(help="Retrieval-cache chunk size in tokens.")]
DraftWindow = Annotated[int, typer.Option(help="Drafter StreamingLLM recent window.")]
SinkTokens = Annotated[int, typer.Option(help="Drafter StreamingLLM attention sinks.")]
Gamma1 = Annotated[int, typer.Option(help="Drafter tokens per verification.")]
Gamma2 = Annotated[int, typer.Option(help="Tokens the full cache verifies per pass.")]
GAMMA_POLICY_HELP = (
    f"Speculation lengths, from {', '.join(GAMMA_POLICIES)}: adaptive ones move below --gamma1/--gamma2 after every"
    " verification (heuristic: +2 after a fully accepted draft, else -1; throughput: most expected tokens/s);"
    " auto is throughput, or fixed for sampling with --seed, which then repeats exactly."
)
RefreshInterval = Annotated[int, typer.Option(help="Full verifications between retrieval-chunk selections.")]
MaxNewTokens = Annotated[int, typer.Option(help="Tokens to generate at most.")]
Temperature = Annotated[float, typer.Option(help="0 means greedy.")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")]
TopK = Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 keeps all.")]
Seed = Annotated[int | None, typer.Option(help="Random seed for sampling.")]
Dtype = Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")]
Threads = Annotated[int | None, typer.Option(help="CPU threads for torch.")]
ContextWindow = Annotated[
    str | None,
    typer.Option(help="Positions the models accept, e.g. 32k; beyond the trained context RoPE is scaled with YaRN."),
]
Weights = Annotated[
    str,
    typer.Option(
        help="dense; half: weight matrices and the prompt's KV cache rounded to float16 and read as such "
        "(CPU, faster); "
        "compact: compute the target from a GGUF's Q4_1 blocks (less memory)."
    ),
]


@app.callback()
def main() -> None:
    """Lossless long-context speculative generation (TriForce)."""


OUT_OF_MEMORY = "out of memory: lower --max-new-tokens, use a shorter prompt or a smaller --dtype"


def print_note(console: Console, message: str) -> None:
    """A dim status line, printed as it is (model names and paths may contain brackets)."""
    console.print(Text(message, style="dim"), soft_wrap=True)


def print_error(console: Console, message: str) -> None:
    """One line, printed as it is: no Rich markup or emoji codes are read from the message."""
    first_line = next((line.strip() for line in message.splitlines() if line.strip()), "unknown error")
    console.print(Text.assemble(("error:", "bold red"), " ", first_line), soft_wrap=True)


@contextmanager
def reported_errors(console: Console):
    """Domain errors and out-of-memory become one line on stderr and exit code 1."""
    try:
        yield
    except TriforceError as err:
        print_error(console, str(err))
        raise typer.Exit(1) from None
    except (torch.OutOfMemoryError, MemoryError):
        print_error(console, OUT_OF_MEMORY)
        raise typer.Exit(1) from None


@contextmanager
def command_console(threads: int | None):
    """A command's stderr console: libraries quieted, torch threads set, domain errors reported as one line."""
    err = Console(stderr=True)
    quiet_libraries()
    with reported_errors(err):
        if threads is not None:
            torch.set_num_threads(threads)
        yield err


def quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def parse_sizes(text: str) -> tuple[int, ...]:
    """'2k,7.5k,32768' -> (2048, 7680, 32768)."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            sizes.append(round(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise ConfigError(f"cannot read '{part}' as a token count (e.g. 2k, 7.5k or 4096)") from None
    return tuple(sizes)


def parse_window(text: str | None) -> int | None:
    """'32k' -> 32768; None stays None."""
    if text is None:
        return None
    sizes = parse_sizes(text)
    if len(sizes) != 1:
        raise ConfigError(f"--context-window takes one token count, not '{text}'")
    return sizes[0]


def parse_layers(text: str) -> tuple[int, ...]:
    """'0,1,29' -> (0, 1, 29)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"cannot read '{text}' as layer numbers (e.g. 0,1,2,3)") from None


def parse_names(text: str, known) -> tuple[str, ...]:
    """'a, b' -> ('a', 'b'), each one of known."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if name not in known:
            raise ConfigError(f"unknown name '{name}' (choose from {', '.join(known)})")
    return names


@app.command()
def generate(
    prompt_file: Annotated[str, typer.Option("--prompt-file", "-p", help="Prompt text file; '-' reads stdin.")],
    target: Target = None,
    draft: Draft = None,
    mode: Annotated[str, typer.Option(help=f"One of: {', '.join(MODES)}.")] = DEFAULTS.mode,
    budget: Annotated[
        int | None, typer.Option(help="Retrieval-cache budget in tokens (default: min(1024, prompt)).")
    ] = DEFAULTS.budget,
    chunk_size: ChunkSize = DEFAULTS.chunk_size,
    draft_window: DraftWindow = DEFAULTS.draft_window,
    sink_tokens: SinkTokens = DEFAULTS.sink_tokens,
    gamma1: Gamma1 = DEFAULTS.gamma1,
    gamma2: Gamma2 = DEFAULTS.gamma2,
    gamma_policy: Annotated[str, typer.Option(help=GAMMA_POLICY_HELP)] = DEFAULTS.gamma_policy,
    ngram: Annotated[
        bool | None,
        typer.Option(
            "--ngram/--no-ngram",
            help=(
                "Streaming and triforce modes: the training-free n-gram (prompt lookup) proposer drafts first and the"
                " separate drafter where it finds nothing (the default wherever there is one; --no-ngram: the"
                " drafter alone). Without one (--draft self, or another target without --draft) the target drafts"
                " for itself, unless --ngram is given: then the n-gram drafts alone."
            ),
            show_default=False,
        ),
    ] = DEFAULTS.ngram,
    refresh_interval: RefreshInterval = DEFAULTS.refresh_interval,
    max_new_tokens: MaxNewTokens = DEFAULTS.max_new_tokens,
    temperature: Temperature = SAMPLING_DEFAULTS.temperature,
    top_p: TopP = SAMPLING_DEFAULTS.top_p,
    top_k: TopK = SAMPLING_DEFAULTS.top_k,
    seed: Seed = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    dtype: Dtype = "auto",
    device: Device = "auto",
    threads: Threads = None,
    weights: Weights = "dense",
    context_window: ContextWindow = None,
    prompt_cache: Annotated[
        Path | None, typer.Option(help="Folder to keep prefilled prompts in and reuse them from.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object and nothing else.")] = False,
) -> None:
    """Generate a continuation of a (long) prompt, exactly as the target model would."""
    out = Console(highlight=False)
    with command_console(threads) as err:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        config = EngineConfig(
            mode=mode,
            budget=budget,
            chunk_size=chunk_size,
            sink_tokens=sink_tokens,
            draft_window=draft_window,
            gamma1=gamma1,
            gamma2=gamma2,
            gamma_policy=gamma_policy,
            max_new_tokens=max_new_tokens,
            refresh_interval=refresh_interval,
            ngram=ngram,
            sampling=sampling,
        )
        text = read_prompt(prompt_file)
        status = None if json_output else (lambda message: print_note(err, message))
        pipe = Pipeline.load(
            target=target,
            draft=draft,
            config=config,
            dtype=dtype,
            device=device,
            status=status,
            weights=weights,
            context_window=parse_window(context_window),
        )
        prompt_ids = pipe.encode(text, chat=chat)
        pipe.engine.check_prompt(prompt_ids)
        if json_output:
            result = pipe.generate_ids(prompt_ids, prompt_cache=prompt_cache)
            print(json.dumps({"token_ids": result.token_ids, "text": result.text, **result.stats.as_dict()}))
        else:
            if pipe.engine.drafter_description:
                print_note(err, f"drafter: {pipe.engine.drafter_description}")
            err.print(tier_legend())
            stream = TokenStream(out, pipe.target.tokenizer)
            with PrefillProgress(err) as progress:
                result = pipe.generate_ids(prompt_ids, progress, stream, prompt_cache)
            stream.finish()
            print_summary(err, result.stats)
        if result.stats.stop_reason == "interrupted":
            raise typer.Exit(INTERRUPTED_EXIT_CODE)


@app.command()
def bench(
    prompt_file: Annotated[
        list[Path] | None,
        typer.Option("--prompt-file", "-p", help="Prompt file(s); repeat the option for several."),
    ] = None,
    builtin: Annotated[
        str, typer.Option(help=f"Built-in prompts when no file is given, from: {', '.join(DOCUMENTS)}.")
    ] = next(iter(DOCUMENTS)),
    context: Annotated[str, typer.Option(help="Context lengths to cut each prompt to, e.g. 2k,7.5k,32k.")] = ",".join(
        map(str, BENCH_DEFAULTS.contexts)
    ),
    modes: Annotated[
        str,
        typer.Option(
            help=f"Comma-separated, from: {', '.join(ALL_MODES)}; 'default' is {','.join(DEFAULT_MODES)}"
            f", plus {LLAMA_CPP_PEER} where llama-cpp-python is installed and the target is a GGUF file."
        ),
    ] = "default",
    budget: Annotated[
        str, typer.Option(help="Retrieval budgets to sweep, e.g. 256,1024 (auto: min(1024, prompt)).")
    ] = "auto",
    chunk_size: Annotated[str, typer.Option(help="Retrieval chunk sizes to sweep, e.g. 8,16.")] = str(
        DEFAULTS.chunk_size
    ),
    max_new_tokens: MaxNewTokens = BENCH_DEFAULTS.max_new_tokens,
    repeats: Annotated[int, typer.Option(help="Timed runs of every mode.")] = BENCH_DEFAULTS.repeats,
    warmup: Annotated[int, typer.Option(help="Untimed runs of every mode first.")] = BENCH_DEFAULTS.warmup,
    temperature: Temperature = 0.0,
    top_p: TopP = SAMPLING_DEFAULTS.top_p,
    top_k: TopK = SAMPLING_DEFAULTS.top_k,
    seed: Seed = 0,
    target: Target = None,
    draft: Draft = None,
    draft_window: DraftWindow = DEFAULTS.draft_window,
    sink_tokens: SinkTokens = DEFAULTS.sink_tokens,
    gamma1: Gamma1 = DEFAULTS.gamma1,
    gamma2: Gamma2 = DEFAULTS.gamma2,
    gamma_policy: Annotated[
        str, typer.Option(help="Speculation-length policies to sweep, e.g. fixed,throughput (see generate --help).")
    ] = ",".join(BENCH_DEFAULTS.gamma_policies),
    refresh_interval: RefreshInterval = DEFAULTS.refresh_interval,
    dtype: Dtype = "auto",
    device: Device = "auto",
    threads: Threads = None,
    weights: Weights = "dense",
    context_window: ContextWindow = None,
    forward_costs: Annotated[
        str | None,
        typer.Option(
            help="Also time one target forward of T new tokens per context, e.g. 1,2,4,8 (verification cost)."
        ),
    ] = None,
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            help="Folder to keep prefilled prompts in and reuse them from (prefill then shows the time to open one)."
        ),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write results to a .json or .csv file.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of latency against context length.")] = None,
) -> None:
    """Per-token latency of every mode and the peers, side by side on the same prompts."""
    with command_console(threads) as err:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        config = BenchConfig(
            modes=DEFAULT_MODES if modes == "default" else parse_names(modes, ALL_MODES),
            contexts=parse_sizes(context),
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            warmup=warmup,
            budgets=(None,) if budget == "auto" else parse_sizes(budget),
            chunk_sizes=parse_sizes(chunk_size),
            gamma_policies=parse_names(gamma_policy, GAMMA_POLICIES),
            forward_tokens=parse_sizes(forward_costs) if forward_costs else (),
            sampling=sampling,
            prompt_cache=prompt_cache,
        )
        check_results_path(out)
        if plot is not None:
            pyplot()
        engine_config = EngineConfig(
            sink_tokens=sink_tokens,
            draft_window=draft_window,
            gamma1=gamma1,
            gamma2=gamma2,
            refresh_interval=refresh_interval,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
        )
        pipe = Pipeline.load(
            target=target,
            draft=draft,
            config=engine_config,
            dtype=dtype,
            device=device,
            status=lambda message: print_note(err, message),
            weights=weights,
            context_window=parse_window(context_window),
        )
        if modes == "default":
            config = replace(config, modes=default_modes(pipe.target))
        if prompt_file:
            prompts = {path.name: read_prompt(str(path)) for path in prompt_file}
        else:
            prompts = {name: builtin_document(name) for name in parse_names(builtin, DOCUMENTS)}
        runner = Bench(pipe, config)
        rows = []
        for name, text in prompts.items():
            ids = pipe.encode(text)
            for length in config.contexts:
                if length > len(ids):
                    raise PromptError(f"prompt {name} has {len(ids)} tokens, fewer than the context {length}")
                print_note(err, f"{name} at {length} tokens: prefill, then {len(config.modes)} modes...")
                rows += runner.run_context(name, ids[:length])
        console = Console(width=None if sys.stdout.isatty() else 220)
        console.print(bench_table(rows))
        if runner.forward_costs:
            console.print(forward_cost_table(runner.forward_costs))
        command = shlex.join(["triforce", *sys.argv[1:]])
        if out is not None:
            write_results(rows, out, command, runner.forward_costs)
        if plot is not None:
            plot_latency(rows, plot)


DISTILL_DEFAULTS = DistillConfig(builtin=("stdlib-train",))


@app.command()
def distill(
    out: Annotated[Path, typer.Option(help="Folder to write the drafter (and its checkpoint) to.")],
    data: Annotated[
        list[Path] | None, typer.Option("--data", "-d", help="Training text file; repeat for several.")
    ] = None,
    builtin: Annotated[
        str,
        typer.Option(help=f"Built-in training text, comma-separated from: {', '.join(BUILTIN_NAMES)}; '' for none."),
    ] = ",".join(DISTILL_DEFAULTS.builtin),
    target: Target = None,
    init_layers: Annotated[
        str, typer.Option(help="Target layers the drafter starts from, in order (its depth).")
    ] = ",".join(map(str, DISTILL_DEFAULTS.init_layers)),
    init_from: Annotated[
        Path | None,
        typer.Option(help="Start from this drafter folder (distilled for the same target) instead of target layers."),
    ] = None,
    draft_vocab: Annotated[
        int, typer.Option(help="Tokens the drafter's output layer covers (the most frequent in the data); 0: all.")
    ] = DISTILL_DEFAULTS.draft_vocab,
    self_generate: Annotated[
        int, typer.Option(help="Extra training windows the target writes itself (aligns the drafter's context).")
    ] = DISTILL_DEFAULTS.self_generate,
    self_temperature: Annotated[float, typer.Option(help="Temperature of the target's own windows.")] = (
        DISTILL_DEFAULTS.self_temperature
    ),
    top_k: Annotated[int, typer.Option(help="Target tokens per position in the top-K loss.")] = DISTILL_DEFAULTS.top_k,
    seq_len: Annotated[int, typer.Option(help="Tokens per training window.")] = DISTILL_DEFAULTS.seq_len,
    batch_size: Annotated[int, typer.Option(help="Windows per step.")] = DISTILL_DEFAULTS.batch_size,
    learning_rate: Annotated[float, typer.Option(help="Peak AdamW learning rate.")] = DISTILL_DEFAULTS.learning_rate,
    max_steps: Annotated[int, typer.Option(help="Training steps (the learning-rate schedule spans them).")] = (
        DISTILL_DEFAULTS.max_steps
    ),
    max_minutes: Annotated[
        float | None, typer.Option(help="Stop after this many minutes, saving a checkpoint to --resume from.")
    ] = None,
    eval_every: Annotated[int, typer.Option(help="Steps between held-out evaluations and checkpoints.")] = (
        DISTILL_DEFAULTS.eval_every
    ),
    held_out_windows: Annotated[
        int, typer.Option(help="Windows of real text the held-out acceptance is measured on (kept out of training).")
    ] = DISTILL_DEFAULTS.held_out_windows,
    held_out: Annotated[
        list[str] | None,
        typer.Option(
            help="Measure the held-out acceptance on this text (a file, or a built-in name as for --builtin; repeat "
            "for several) rather than on windows cut from the training text, which share its documents."
        ),
    ] = None,
    acceptance_temperature: Annotated[float, typer.Option(help="Temperature of the held-out acceptance.")] = (
        DISTILL_DEFAULTS.acceptance_temperature
    ),
    save_dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16 for the written weights.")] = (
        DISTILL_DEFAULTS.save_dtype
    ),
    seed: Annotated[int, typer.Option(help="Seed of the split, the sampling and the initial weights.")] = (
        DISTILL_DEFAULTS.seed
    ),
    resume: Annotated[bool, typer.Option("--resume", help="Continue the checkpoint in --out.")] = False,
    threads: Threads = None,
) -> None:
    """Train a small drafter for a target with the top-K distillation loss (HASS); --draft loads the result."""
    with command_console(threads) as err:
        config = DistillConfig(
            data=tuple(str(path) for path in data or ()),
            builtin=parse_names(builtin, BUILTIN_NAMES),
            init_layers=parse_layers(init_layers),
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
            raise typer.Exit(INTERRUPTED_EXIT_CODE if result.interrupted else 0)
