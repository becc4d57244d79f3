"""`triforce bench`: per-token latency of our modes and the peers, and the seconds a user waits, side by side on the
same prompts."""

import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Literal

import torch
import typer

from triforce_cli.bench.qa import QA_PEERS, QABench, qa_modes
from triforce_cli.bench.report import check_results_path, plot_latency, pyplot, write_qa_results, write_results
from triforce_cli.bench.runner import ALL_MODES, Bench, BenchConfig, default_modes, drafts_with_model
from triforce_cli.cli import options as o
from triforce_cli.cli.console import command_console, print_note, table_console
from triforce_cli.cli.render import bench_header, bench_tables, forward_cost_table, qa_tables
from triforce_cli.cli.settings import check_draft_used, engine_config, load_pipeline, sampling_config
from triforce_cli.corpus import BENCH_DEFAULT, BENCH_PROMPTS, DOCUMENT_QUESTIONS, QA_QUESTIONS, builtin_document
from triforce_cli.decoding.config import GAMMA_POLICIES, Mode
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.plan.rates import machine_rates
from triforce_cli.runtime.environment import machine_description
from triforce_cli.runtime.prompts import cut_document, cut_prompt, read_prompt
from triforce_cli.runtime.store import check_writable_file

BENCH_DEFAULTS = BenchConfig()
BENCH_SEED = 0  # a sampled bench (--temperature above 0) repeats exactly
MAX_REPEATS = 100
DEFAULT_CONTEXTS = ",".join(map(str, BENCH_DEFAULTS.contexts))
DEFAULT_POLICIES = ",".join(BENCH_DEFAULTS.gamma_policies)
DEFAULT_BUILTIN = ",".join(BENCH_DEFAULT)
QA_DEFAULT_MODES = (Mode.AUTOREGRESSIVE, Mode.TRIFORCE, *QA_PEERS)
QA_DEFAULT = ("qa-stdlib-b",)  # the qa scenario's document where --builtin is left as it is


def budgets(value: str | tuple) -> tuple[int | None, ...]:
    """Parser of 'auto' (min(1024, prompt), as None) or comma-separated token counts."""
    return (None,) if value == "auto" else o.token_counts(value)


# Sweeps: comma-separated lists
BENCH_MODE_CHOICES = ("default", *ALL_MODES)
Modes = o.some_of(
    "--modes", BENCH_MODE_CHOICES, "MODE", "Our modes and the peers to time: " + ", ".join(BENCH_MODE_CHOICES) + "."
)
Contexts = Annotated[
    tuple, typer.Option("--context", parser=o.token_counts, metavar="TOKENS,...", help="Context lengths, e.g. 2k,32k.")
]
BudgetSweep = Annotated[
    tuple, typer.Option("--budget", parser=budgets, metavar="auto|TOKENS,...", help="Retrieval budgets to sweep.")
]
ChunkSizeSweep = Annotated[
    tuple, typer.Option("--chunk-size", parser=o.token_counts, metavar="TOKENS,...", help="Chunk sizes to sweep.")
]
GammaPolicySweep = o.some_of("--gamma-policy", GAMMA_POLICIES, "POLICY", "Speculation-length policies to sweep.")
ForwardCosts = Annotated[
    tuple | None,
    typer.Option(
        parser=o.token_counts,
        metavar="T,...",
        help="Also time one target forward of T tokens, e.g. 1,2,4,8, and one drafter step.",
    ),
]

# Runs
PromptFiles = Annotated[
    list[Path] | None,
    typer.Option("--prompt-file", "-p", metavar="FILE", help="Prompt file; repeat for several."),
]
CONTINUED = ", ".join(name for name, prompt in BENCH_PROMPTS.items() if prompt.request is None)
ASKED = ", ".join(name for name, prompt in BENCH_PROMPTS.items() if prompt.request is not None)
Builtin = Annotated[
    tuple,
    typer.Option(
        parser=o.names_of(tuple(BENCH_PROMPTS)),
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


def bench(
    prompt_file: PromptFiles = None,
    builtin: Builtin = DEFAULT_BUILTIN,
    context: Contexts = DEFAULT_CONTEXTS,
    modes: Modes = "default",
    budget: BudgetSweep = "auto",
    chunk_size: ChunkSizeSweep = str(o.ENGINE_DEFAULTS.chunk_size),
    chunk_score: o.ChunkScore = o.ENGINE_DEFAULTS.chunk_score,
    max_new_tokens: o.MaxNewTokens = BENCH_DEFAULTS.max_new_tokens,
    ignore_eos: o.IgnoreEos = BENCH_DEFAULTS.ignore_eos,
    repeats: Repeats = BENCH_DEFAULTS.repeats,
    warmup: Warmup = BENCH_DEFAULTS.warmup,
    temperature: o.Temperature = 0.0,  # greedy, as BenchConfig's sampling
    top_p: o.TopP = o.SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = o.SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = BENCH_SEED,
    target: o.Target = o.LOAD_DEFAULTS.target,
    draft: o.Draft = o.LOAD_DEFAULTS.draft,
    draft_window: o.DraftWindow = o.ENGINE_DEFAULTS.draft_window,
    sink_tokens: o.SinkTokens = o.ENGINE_DEFAULTS.sink_tokens,
    gamma1: o.Gamma1 = o.ENGINE_DEFAULTS.gamma1,
    gamma2: o.Gamma2 = o.ENGINE_DEFAULTS.gamma2,
    gamma_policy: GammaPolicySweep = DEFAULT_POLICIES,
    refresh_interval: o.RefreshInterval = o.ENGINE_DEFAULTS.refresh_interval,
    dtype: o.Dtype = o.LOAD_DEFAULTS.dtype,
    device: o.Device = o.LOAD_DEFAULTS.device,
    threads: o.Threads = o.LOAD_DEFAULTS.threads,
    weights: o.Weights = o.LOAD_DEFAULTS.weights,
    attention: o.Attention = o.LOAD_DEFAULTS.attention,
    steps: o.Steps = o.LOAD_DEFAULTS.steps,
    compile_steps: o.Compile = None,
    offload: o.Offload = o.ENGINE_DEFAULTS.offload,
    on_chip_layers: o.OnChipLayers = o.ENGINE_DEFAULTS.on_chip_layers,
    context_window: o.ContextWindow = o.LOAD_DEFAULTS.context_window,
    prompt_cache: o.PromptCache = None,
    forward_costs: ForwardCosts = None,
    scenario: Scenario = "decode",
    questions: Questions = None,
    out: ResultsFile = None,
    plot: PlotFile = None,
) -> None:
    """Per-token latency of every mode and the peers, and the seconds to the first token and to the answer."""
    settings = locals()  # cli/settings.py picks the library's settings from them by name
    with command_console(threads) as err:
        sampling = sampling_config(settings)
        config = BenchConfig(
            modes=tuple(m for m in modes if m != "default"),
            contexts=context,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            warmup=warmup,
            budgets=budget,
            chunk_sizes=chunk_size,
            gamma_policies=gamma_policy,
            forward_tokens=forward_costs or (),
            sampling=sampling,
            prompt_cache=prompt_cache,
            ignore_eos=ignore_eos,
        )
        # the default modes and --forward-costs' drafter row draft with it too
        runs_drafter = "default" in modes or bool(forward_costs) or drafts_with_model(config.modes)
        check_draft_used(draft, runs_drafter, f"`modes` {','.join(modes)}")
        if questions is not None and scenario != "qa":
            raise ConfigError("--questions are asked in the qa scenario: give --scenario qa with them")
        check_results_path(out)
        asked_questions = read_questions(questions) if questions is not None else None
        if scenario == "qa":
            if out is not None and out.suffix != ".json":
                raise ConfigError("the qa scenario writes its results as .json")
            if plot is not None:
                raise ConfigError("the qa scenario draws no plot: leave --plot out")
            qa_modes(config.modes)
        if plot is not None:
            pyplot()
            check_writable_file(plot, "plot")
        if prompt_cache is not None:
            check_writable(prompt_cache)
        if prompt_file:
            prompts = {path.name: (read_prompt(str(path)), None) for path in prompt_file}
        else:
            documents = {
                document: builtin_document(document) for document in {BENCH_PROMPTS[n].document for n in builtin}
            }
            prompts = {name: (documents[BENCH_PROMPTS[name].document], BENCH_PROMPTS[name].request) for name in builtin}
        per_run = ("budget", "chunk_size", "gamma_policy", "ignore_eos")  # BenchConfig's: swept, or set per run
        pipe = load_pipeline(settings, engine_config(settings, skip=per_run), lambda message: print_note(err, message))
        if "default" in modes:
            defaults = default_modes(pipe.target)
            if scenario == "qa":
                defaults = tuple(m for m in defaults if m in QA_DEFAULT_MODES)
            config = replace(config, modes=tuple(dict.fromkeys((*defaults, *config.modes))))
        if scenario == "qa":
            _qa(pipe, config, prompt_file, builtin, asked_questions, err, out)
            return
        if (
            not prompt_file
            and builtin == tuple(BENCH_DEFAULT)
            and not getattr(pipe.target.tokenizer, "chat_template", None)
        ):
            asked = [name for name, (_, request) in prompts.items() if request is not None]
            prompts = {name: prompt for name, prompt in prompts.items() if name not in asked}
            print_note(err, f"{pipe.target.name} has no chat template: the default prompts {', '.join(asked)} left out")
        cut = {}  # every prompt at every length first: one that cannot be cut fails the run before it starts
        for name, (text, request) in prompts.items():
            for length in config.contexts:
                try:
                    cut[name, length] = cut_prompt(pipe.target.tokenizer, text, request, length)
                except PromptError as error:
                    raise PromptError(f"prompt {name}: {error}") from None
        rates = None
        if config.forward_tokens and pipe.target.device.type == "cpu":
            rates = machine_rates(lambda message: print_note(err, message))
        runner = Bench(pipe, config, rates)
        rows = []
        for (name, length), ids in cut.items():
            print_note(err, f"{name} at {length} tokens: prefill, then {len(config.modes)} modes...")
            rows += runner.run_context(name, ids)
        console = table_console()
        console.print(bench_header(machine_description(), pipe.target))
        for table in bench_tables(rows):
            console.print(table)
        if runner.forward_costs:
            console.print(forward_cost_table(runner.forward_costs))
        if out is not None:
            setup = {"target": pipe.target.name, "weights": pipe.target.weights, "threads": torch.get_num_threads()}
            write_results(rows, out, shlex.join(["triforce", *sys.argv[1:]]), runner.forward_costs, setup)
        if plot is not None:
            plot_latency(rows, plot)


def read_questions(path: Path) -> tuple[str, ...]:
    """The questions of a --questions file, one per non-blank line; a PromptError where it has none."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise PromptError(f"--questions {path} cannot be read: {reason}") from None
    found = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not found:
        raise PromptError(f"--questions {path} holds no question")
    return found


def _qa(
    pipe: Pipeline,
    config: BenchConfig,
    prompt_file: list[Path] | None,
    builtin: tuple[str, ...],
    asked: tuple[str, ...] | None,
    err,
    out: Path | None,
) -> None:
    """The qa scenario: each document (the files, else the built-in prompts' documents) cut for each context length,
    its questions (asked, else the built-in ones) asked in turn by every mode; a table per document and length."""
    if prompt_file:
        documents = {path.name: (read_prompt(str(path)), asked or DOCUMENT_QUESTIONS) for path in prompt_file}
    else:
        chosen = QA_DEFAULT if builtin == tuple(BENCH_DEFAULT) else builtin
        names = dict.fromkeys(BENCH_PROMPTS[name].document for name in chosen)
        documents = {
            name: (builtin_document(name), asked or QA_QUESTIONS.get(name, DOCUMENT_QUESTIONS)) for name in names
        }
    tokenizer = pipe.target.tokenizer
    cut = {}  # every document at every length first: one that cannot be cut fails the run before it starts
    for name, (text, questions) in documents.items():
        for length in config.contexts:
            try:
                cut[name, length] = (cut_document(tokenizer, text, questions[0], length), questions)
            except PromptError as error:
                raise PromptError(f"document {name}: {error}") from None
    runner = QABench(Bench(pipe, config))
    rows = []
    for (name, length), (document, questions) in cut.items():
        print_note(err, f"{name} at {length} tokens: {len(questions)} questions, {len(config.modes)} modes...")
        rows += runner.run_document(name, document, questions)
    console = table_console()
    console.print(bench_header(machine_description(), pipe.target))
    for table in qa_tables(rows):
        console.print(table)
    if out is not None:
        setup = {"target": pipe.target.name, "weights": pipe.target.weights, "threads": torch.get_num_threads()}
        write_qa_results(rows, out, shlex.join(["triforce", *sys.argv[1:]]), setup)
