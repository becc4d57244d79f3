"""The `triforce` command line: thin Typer commands over the library API."""

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from triforce_cli.config import MODES, EngineConfig
from triforce_cli.errors import TriforceError
from triforce_cli.pipeline import Pipeline
from triforce_cli.prompts import read_prompt
from triforce_cli.render import PrefillProgress, TokenStream, print_summary, tier_legend
from triforce_cli.sampling import SamplingConfig

app = typer.Typer(
    help="Lossless long-context speculative generation (TriForce: drafter -> retrieval cache -> full cache).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
DEFAULTS = EngineConfig()
SAMPLING_DEFAULTS = SamplingConfig()
INTERRUPTED_EXIT_CODE = 130


@app.callback()
def main() -> None:
    """Lossless long-context speculative generation (TriForce)."""


@contextmanager
def reported_errors(console: Console):
    """Domain errors and out-of-memory become one line on stderr and exit code 1."""
    try:
        yield
    except TriforceError as err:
        console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except (torch.OutOfMemoryError, MemoryError):
        console.print(
            "[bold red]error:[/] out of memory: lower --max-new-tokens, use a shorter prompt or a smaller --dtype",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None


def quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


@app.command()
def generate(
    prompt_file: Annotated[str, typer.Option("--prompt-file", "-p", help="Prompt text file; '-' reads stdin.")],
    target: Annotated[
        str | None, typer.Option(help="Target model: folder, .safetensors, .gguf or hub id (default: embedded).")
    ] = None,
    draft: Annotated[
        str | None, typer.Option(help="Drafter model sharing the target's tokenizer (default: the target itself).")
    ] = None,
    mode: Annotated[str, typer.Option(help=f"One of: {', '.join(MODES)}.")] = DEFAULTS.mode,
    budget: Annotated[
        int | None, typer.Option(help="Retrieval-cache budget in tokens (default: min(1024, prompt)).")
    ] = DEFAULTS.budget,
    chunk_size: Annotated[int, typer.Option(help="Retrieval-cache chunk size in tokens.")] = DEFAULTS.chunk_size,
    draft_window: Annotated[int, typer.Option(help="Drafter StreamingLLM recent window.")] = DEFAULTS.draft_window,
    sink_tokens: Annotated[int, typer.Option(help="Drafter StreamingLLM attention sinks.")] = DEFAULTS.sink_tokens,
    gamma1: Annotated[int, typer.Option(help="Drafter tokens per verification.")] = DEFAULTS.gamma1,
    gamma2: Annotated[int, typer.Option(help="Tokens the full cache verifies per pass.")] = DEFAULTS.gamma2,
    ngram: Annotated[
        bool, typer.Option("--ngram", help="Training-free n-gram (prompt lookup) proposer at the bottom tier.")
    ] = DEFAULTS.ngram,
    refresh_interval: Annotated[
        int, typer.Option(help="Full verifications between retrieval-chunk selections.")
    ] = DEFAULTS.refresh_interval,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = DEFAULTS.max_new_tokens,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = SAMPLING_DEFAULTS.temperature,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = SAMPLING_DEFAULTS.top_p,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 keeps all.")] = SAMPLING_DEFAULTS.top_k,
    seed: Annotated[int | None, typer.Option(help="Random seed for sampling.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda[:N].")] = "auto",
    threads: Annotated[int | None, typer.Option(help="CPU threads for torch.")] = None,
    prompt_cache: Annotated[
        Path | None, typer.Option(help="Folder to keep prefilled prompts in and reuse them from.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object and nothing else.")] = False,
) -> None:
    """Generate a continuation of a (long) prompt, exactly as the target model would."""
    err = Console(stderr=True)
    out = Console(highlight=False)
    quiet_libraries()
    with reported_errors(err):
        if threads is not None:
            torch.set_num_threads(threads)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        config = EngineConfig(
            mode=mode,
            budget=budget,
            chunk_size=chunk_size,
            sink_tokens=sink_tokens,
            draft_window=draft_window,
            gamma1=gamma1,
            gamma2=gamma2,
            max_new_tokens=max_new_tokens,
            refresh_interval=refresh_interval,
            ngram=ngram,
            sampling=sampling,
        )
        text = read_prompt(prompt_file)
        status = None if json_output else (lambda message: err.print(f"[dim]{message}[/]"))
        pipe = Pipeline.load(target=target, draft=draft, config=config, dtype=dtype, device=device, status=status)
        prompt_ids = pipe.encode(text, chat=chat)
        pipe.engine.check_prompt(prompt_ids)
        if json_output:
            result = pipe.generate_ids(prompt_ids, prompt_cache=prompt_cache)
            print(json.dumps({"token_ids": result.token_ids, "text": result.text, **result.stats.as_dict()}))
        else:
            if pipe.engine.drafter_description:
                err.print(f"[dim]drafter: {pipe.engine.drafter_description}[/]")
            err.print(tier_legend())
            stream = TokenStream(out, pipe.target.tokenizer)
            with PrefillProgress(err) as progress:
                result = pipe.generate_ids(prompt_ids, progress, stream, prompt_cache)
            stream.finish()
            print_summary(err, result.stats)
        if result.stats.stop_reason == "interrupted":
            raise typer.Exit(INTERRUPTED_EXIT_CODE)
