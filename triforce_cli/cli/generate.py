"""`triforce generate`: a continuation of a (long) prompt, exactly as the target would write it."""

import json

import typer

from triforce_cli.cli import options as o
from triforce_cli.cli.console import StdoutConsole, command_console, print_note
from triforce_cli.cli.render import PrefillProgress, TokenStream, print_setup, print_summary
from triforce_cli.cli.settings import engine_config, load_pipeline
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.decoding.stats import as_record
from triforce_cli.interrupts import interrupted_exit_code
from triforce_cli.runtime.prompts import read_prompt


@o.takes(*o.MACHINE, "prompt_cache", after="chat")
@o.takes(*o.MODELS, *o.ENGINE, "max_new_tokens", "ignore_eos", *o.SAMPLING)
def generate(prompt_file: o.PromptFile, chat: o.Chat = False, json_output: o.JsonOutput = False, **settings) -> None:
    """Generate a continuation of a (long) prompt, exactly as the target model would."""
    prompt_cache = settings["prompt_cache"]
    out = StdoutConsole(highlight=False)
    with command_console(settings["threads"], json_output) as err:
        config = engine_config(settings)
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
