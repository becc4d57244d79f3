"""`triforce generate`: a continuation of a (long) prompt, exactly as the target would write it."""

import json
from typing import Annotated

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.cli.render import PrefillProgress, TokenStream, print_setup, print_summary
from triforce_cli.cli.settings import check_draft_used, engine_config, load_pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.decoding.stats import as_record
from triforce_cli.interrupts import interrupted_exit_code
from triforce_cli.runtime.prompts import read_prompt

PromptFile = Annotated[
    str, typer.Option("--prompt-file", "-p", metavar="FILE", help="Prompt text file; '-' reads stdin.")
]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap the prompt as a user turn of the model's chat template.")]


def generate(
    prompt_file: PromptFile,
    target: o.Target = o.LOAD_DEFAULTS.target,
    draft: o.Draft = o.LOAD_DEFAULTS.draft,
    mode: o.Mode = o.ENGINE_DEFAULTS.mode,
    budget: o.Budget = o.ENGINE_DEFAULTS.budget,
    chunk_size: o.ChunkSize = o.ENGINE_DEFAULTS.chunk_size,
    chunk_score: o.ChunkScore = o.ENGINE_DEFAULTS.chunk_score,
    draft_window: o.DraftWindow = o.ENGINE_DEFAULTS.draft_window,
    sink_tokens: o.SinkTokens = o.ENGINE_DEFAULTS.sink_tokens,
    gamma1: o.Gamma1 = o.ENGINE_DEFAULTS.gamma1,
    gamma2: o.Gamma2 = o.ENGINE_DEFAULTS.gamma2,
    gamma_policy: o.GammaPolicy = o.ENGINE_DEFAULTS.gamma_policy,
    ngram: o.Ngram = o.ENGINE_DEFAULTS.ngram,
    refresh_interval: o.RefreshInterval = o.ENGINE_DEFAULTS.refresh_interval,
    max_new_tokens: o.MaxNewTokens = o.ENGINE_DEFAULTS.max_new_tokens,
    ignore_eos: o.IgnoreEos = o.ENGINE_DEFAULTS.ignore_eos,
    temperature: o.Temperature = o.SAMPLING_DEFAULTS.temperature,
    top_p: o.TopP = o.SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = o.SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = o.SAMPLING_DEFAULTS.seed,
    chat: Chat = False,
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
    json_output: o.JsonOutput = False,
) -> None:
    """Generate a continuation of a (long) prompt, exactly as the target model would."""
    settings = locals()  # cli/settings.py picks the library's settings from them by name
    out = StdoutConsole(highlight=False)
    with command_console(threads, json_output) as err:
        config = engine_config(settings)
        check_draft_used(draft, config.uses_drafter, f"`mode` {config.mode}")
        text = read_prompt(prompt_file)
        if prompt_cache is not None:
            check_writable(prompt_cache)
        pipe = load_pipeline(settings, config, None if json_output else (lambda message: print_note(err, message)))
        prompt_ids = pipe.encode(text, chat=chat)
        pipe.engine.check_prompt(prompt_ids)
        plan = pipe.engine.memory_plan(len(prompt_ids))
        if json_output:
            result = pipe.generate_ids(prompt_ids, prompt_cache=prompt_cache)
            memory = {"memory": {"device": plan.device, "items": [list(item) for item in plan.items]}}
            print(json.dumps({"token_ids": result.token_ids, "text": result.text, **as_record(result.stats), **memory}))
        else:
            print_setup(err, plan, pipe.engine.drafter_description)
            stream = TokenStream(out, pipe.target.tokenizer)
            with PrefillProgress(err) as progress:
                result = pipe.generate_ids(prompt_ids, progress, stream, prompt_cache)
            stream.finish()
            print_summary(err, result.stats)
        if result.stats.stop_reason == "interrupted":
            raise typer.Exit(interrupted_exit_code())
