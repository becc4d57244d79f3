"""`triforce bench`: per-token latency of our modes and the peers, and the seconds a user waits, side by side on the
same prompts."""

import shlex
import sys
from dataclasses import replace
from pathlib import Path

import torch

from triforce_cli.bench.qa import QA_PEERS, QABench, qa_modes
from triforce_cli.bench.report import check_results_path, plot_latency, pyplot, write_qa_results, write_results
from triforce_cli.bench.runner import Bench, BenchConfig, default_modes
from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.cli.render import bench_header, bench_tables, forward_cost_table, qa_tables
from triforce_cli.cli.settings import engine_config, load_pipeline, sampling_config
from triforce_cli.corpus import BENCH_DEFAULT, BENCH_PROMPTS, DOCUMENT_QUESTIONS, QA_QUESTIONS, builtin_document
from triforce_cli.decoding.config import EngineConfig, Mode
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.plan.rates import machine_rates
from triforce_cli.runtime.environment import machine_description
from triforce_cli.runtime.prompts import cut_document, cut_prompt, read_prompt

DEFAULTS = EngineConfig()
BENCH_DEFAULTS = BenchConfig()
SAMPLING_DEFAULTS = SamplingConfig()
BENCH_SETTINGS = {"max_new_tokens": BENCH_DEFAULTS.max_new_tokens, "ignore_eos": BENCH_DEFAULTS.ignore_eos}
DEFAULT_CONTEXTS = ",".join(map(str, BENCH_DEFAULTS.contexts))
DEFAULT_POLICIES = ",".join(BENCH_DEFAULTS.gamma_policies)
DEFAULT_BUILTIN = ",".join(BENCH_DEFAULT)
QA_DEFAULT_MODES = (Mode.AUTOREGRESSIVE, Mode.TRIFORCE, *QA_PEERS)
QA_DEFAULT = ("qa-stdlib-b",)  # the qa scenario's document where --builtin is left as it is


@o.takes("refresh_interval", *o.MACHINE, "prompt_cache", after="gamma_policy")
@o.takes(*o.SAMPLING, *o.MODELS, *o.DRAFTING, after="warmup", temperature=0.0, seed=0)
@o.takes("chunk_score", "max_new_tokens", "ignore_eos", after="chunk_size", **BENCH_SETTINGS)
def bench(
    prompt_file: o.BenchPromptFiles = None,
    builtin: o.BenchBuiltin = DEFAULT_BUILTIN,
    context: o.Contexts = DEFAULT_CONTEXTS,
    modes: o.BenchModes = "default",
    budget: o.BudgetSweep = "auto",
    chunk_size: o.ChunkSizeSweep = str(DEFAULTS.chunk_size),
    repeats: o.Repeats = BENCH_DEFAULTS.repeats,
    warmup: o.Warmup = BENCH_DEFAULTS.warmup,
    gamma_policy: o.GammaPolicySweep = DEFAULT_POLICIES,
    forward_costs: o.ForwardCosts = None,
    scenario: o.Scenario = "decode",
    questions: o.Questions = None,
    out: o.ResultsFile = None,
    plot: o.PlotFile = None,
    **settings,
) -> None:
    """Per-token latency of every mode and the peers, and the seconds to the first token and to the answer."""
    max_new_tokens, ignore_eos, prompt_cache = (
        settings[name] for name in ("max_new_tokens", "ignore_eos", "prompt_cache")
    )
    with command_console(settings["threads"]) as err:
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
        if prompt_cache is not None:
            check_writable(prompt_cache)
        if prompt_file:
            prompts = {path.name: (read_prompt(str(path)), None) for path in prompt_file}
        else:
            documents = {
                document: builtin_document(document) for document in {BENCH_PROMPTS[n].document for n in builtin}
            }
            prompts = {name: (documents[BENCH_PROMPTS[name].document], BENCH_PROMPTS[name].request) for name in builtin}
        per_run = ("ignore_eos",)  # BenchConfig's, like the sweeps, which are the command's own parameters
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
        console = StdoutConsole()
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
    console = StdoutConsole()
    console.print(bench_header(machine_description(), pipe.target))
    for table in qa_tables(rows):
        console.print(table)
    if out is not None:
        setup = {"target": pipe.target.name, "weights": pipe.target.weights, "threads": torch.get_num_threads()}
        write_qa_results(rows, out, shlex.join(["triforce", *sys.argv[1:]]), setup)
