"""`triforce generate`: a continuation of a (long) prompt, exactly as the target would write it."""

import json

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.cli.render import PrefillProgress, TokenStream, print_setup, print_summary
from triforce_cli.cli.settings import engine_config, load_pipeline
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.stats import as_record
from triforce_cli.interrupts import interrupted_exit_code
from triforce_cli.runtime.prompts import read_prompt

DEFAULTS = EngineConfig()
SAMPLING_DEFAULTS = SamplingConfig()


def generate(
    prompt_file: o.PromptFile,
    target: o.Target = None,
    draft: o.Draft = None,
    mode: o.Mode = DEFAULTS.mode,
    budget: o.Budget = DEFAULTS.budget,
    chunk_size: o.ChunkSize = DEFAULTS.chunk_size,
    chunk_score: o.ChunkScore = DEFAULTS.chunk_score,
    draft_window: o.DraftWindow = DEFAULTS.draft_window,
    sink_tokens: o.SinkTokens = DEFAULTS.sink_tokens,
    gamma1: o.Gamma1 = DEFAULTS.gamma1,
    gamma2: o.Gamma2 = DEFAULTS.gamma2,
    gamma_policy: o.GammaPolicy = DEFAULTS.gamma_policy,
    ngram: o.Ngram = DEFAULTS.ngram,
    refresh_interval: o.RefreshInterval = DEFAULTS.refresh_interval,
    max_new_tokens: o.MaxNewTokens = DEFAULTS.max_new_tokens,
    ignore_eos: o.IgnoreEos = DEFAULTS.ignore_eos,
    temperature: o.Temperature = SAMPLING_DEFAULTS.temperature,
    top_p: o.TopP = SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = None,
    chat: o.Chat = False,
    dtype: o.Dtype = "auto",
    device: o.Device = "auto",
    threads: o.Threads = None,
    weights: o.Weights = "auto",
    attention: o.Attention = "auto",
    compile_steps: o.Compile = None,
    offload: o.Offload = "none",
    on_chip_layers: o.OnChipLayers = 0,
    context_window: o.ContextWindow = None,
    prompt_cache: o.PromptCache = None,
    json_output: o.JsonOutput = False,
) -> None:
    """Generate a continuation of a (long) prompt, exactly as the target model would."""
    options = dict(locals())  # the settings, each named as its field (cli/settings.py)
    out = StdoutConsole(highlight=False)
    with command_console(threads, json_output) as err:
        config = engine_config(options)
        text = read_prompt(prompt_file)
        if prompt_cache is not None:
            check_writable(prompt_cache)
        pipe = load_pipeline(options, config, None if json_output else (lambda message: print_note(err, message)))
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
