"""`triforce bench`: per-token latency of our modes and the peers, and the seconds a user waits, side by side on the
same prompts."""

import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import torch
import typer

from triforce_cli.bench.report import check_results_path, plot_latency, pyplot, write_results
from triforce_cli.bench.runner import Bench, BenchConfig, default_modes
from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.cli.render import bench_header, bench_tables, forward_cost_table
from triforce_cli.corpus import DOCUMENTS, builtin_document
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.errors import PromptError
from triforce_cli.runtime.environment import machine_description
from triforce_cli.runtime.prompts import read_prompt

DEFAULTS = EngineConfig()
BENCH_DEFAULTS = BenchConfig()
SAMPLING_DEFAULTS = SamplingConfig()
DEFAULT_CONTEXTS = ",".join(map(str, BENCH_DEFAULTS.contexts))
DEFAULT_POLICIES = ",".join(BENCH_DEFAULTS.gamma_policies)
MAX_REPEATS = 100


def bench(
    prompt_file: Annotated[
        list[Path] | None,
        typer.Option("--prompt-file", "-p", metavar="FILE", help="Prompt file; repeat for several."),
    ] = None,
    builtin: Annotated[
        tuple,
        typer.Option(
            parser=o.names_of(tuple(DOCUMENTS)),
            metavar="NAME,...",
            help=f"Built-in prompts when no file is given: {', '.join(DOCUMENTS)}.",
        ),
    ] = next(iter(DOCUMENTS)),
    context: o.Contexts = DEFAULT_CONTEXTS,
    modes: o.BenchModes = "default",
    budget: o.BudgetSweep = "auto",
    chunk_size: o.ChunkSizeSweep = str(DEFAULTS.chunk_size),
    chunk_score: o.ChunkScore = DEFAULTS.chunk_score,
    max_new_tokens: o.MaxNewTokens = BENCH_DEFAULTS.max_new_tokens,
    ignore_eos: o.IgnoreEos = BENCH_DEFAULTS.ignore_eos,
    repeats: Annotated[
        int, typer.Option(min=1, max=MAX_REPEATS, metavar="N", help="Timed runs of every mode.")
    ] = BENCH_DEFAULTS.repeats,
    warmup: Annotated[
        int, typer.Option(min=0, max=MAX_REPEATS, metavar="N", help="Untimed runs of every mode first.")
    ] = BENCH_DEFAULTS.warmup,
    temperature: o.Temperature = 0.0,
    top_p: o.TopP = SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = 0,
    target: o.Target = None,
    draft: o.Draft = None,
    draft_window: o.DraftWindow = DEFAULTS.draft_window,
    sink_tokens: o.SinkTokens = DEFAULTS.sink_tokens,
    gamma1: o.Gamma1 = DEFAULTS.gamma1,
    gamma2: o.Gamma2 = DEFAULTS.gamma2,
    gamma_policy: o.GammaPolicySweep = DEFAULT_POLICIES,
    refresh_interval: o.RefreshInterval = DEFAULTS.refresh_interval,
    dtype: o.Dtype = "auto",
    device: o.Device = "auto",
    threads: o.Threads = None,
    weights: o.Weights = "auto",
    attention: o.Attention = "auto",
    compile_steps: o.Compile = None,
    offload: o.Offload = "none",
    on_chip_layers: o.OnChipLayers = 0,
    context_window: o.ContextWindow = None,
    forward_costs: o.ForwardCosts = None,
    prompt_cache: o.PromptCache = None,
    out: Annotated[Path | None, typer.Option(metavar="FILE", help="Write the results to a .json or .csv file.")] = None,
    plot: Annotated[
        Path | None, typer.Option(metavar="FILE", help="Write a PNG of latency against context length.")
    ] = None,
) -> None:
    """Per-token latency of every mode and the peers, and the seconds to the first token and to the answer."""
    with command_console(threads) as err:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
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
        if plot is not None:
            pyplot()
        if prompt_cache is not None:
            check_writable(prompt_cache)
        prompts = (
            {path.name: read_prompt(str(path)) for path in prompt_file}
            if prompt_file
            else {name: builtin_document(name) for name in builtin}
        )
        engine_config = EngineConfig(
            chunk_score=chunk_score,
            sink_tokens=sink_tokens,
            draft_window=draft_window,
            gamma1=gamma1,
            gamma2=gamma2,
            refresh_interval=refresh_interval,
            max_new_tokens=max_new_tokens,
            offload=offload,
            on_chip_layers=on_chip_layers,
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
            context_window=context_window,
            attention=attention,
            compile_steps=compile_steps,
            tune=True,
            threads=threads,
        )
        if "default" in modes:
            defaults = default_modes(pipe.target)
            config = replace(config, modes=tuple(dict.fromkeys((*defaults, *config.modes))))
        runner = Bench(pipe, config)
        rows = []
        for name, text in prompts.items():
            ids = pipe.encode(text)
            for length in config.contexts:
                if length > len(ids):
                    raise PromptError(f"prompt {name} has {len(ids)} tokens, fewer than the context {length}")
                print_note(err, f"{name} at {length} tokens: prefill, then {len(config.modes)} modes...")
                rows += runner.run_context(name, ids[:length])
        console = StdoutConsole()
        console.print(bench_header(machine_description()))
        for table in bench_tables(rows):
            console.print(table)
        if runner.forward_costs:
            console.print(forward_cost_table(runner.forward_costs))
        if out is not None:
            setup = {"target": pipe.target.name, "weights": pipe.target.weights, "threads": torch.get_num_threads()}
            write_results(rows, out, shlex.join(["triforce", *sys.argv[1:]]), runner.forward_costs, setup)
        if plot is not None:
            plot_latency(rows, plot)
