"""Library messages name settings by their Python keyword in backticks; the command line shows them as flags.

The table of cli/flags.py cannot rot: every flag in it is an option of some command of the app, and every setting
it names is a keyword of the library (a field of a config dataclass or an argument of a function the CLI calls).
"""

import dataclasses
import inspect
import io

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from triforce_cli.bench.runner import BenchConfig
from triforce_cli.cli.app import app
from triforce_cli.cli.console import print_error, print_note
from triforce_cli.cli.flags import FLAGS, PHRASES, flag_text
from triforce_cli.decoding.chat import ChatSession
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.distill.trainer import DistillConfig, Distiller
from triforce_cli.errors import ConfigError
from triforce_cli.plan.presets import with_figures


def app_options() -> set[str]:
    """Every option string (--x, --no-x, -p) of every command and subcommand of the app."""
    group = typer.main.get_command(app)
    context = group.context_class(group)
    options, commands = set(), [group]
    while commands:
        command = commands.pop()
        if hasattr(command, "list_commands"):
            commands.extend(command.get_command(context, name) for name in command.list_commands(context))
        for param in command.params:
            if param.param_type_name == "option":
                options.update(param.opts, param.secondary_opts)
    return options


def library_keywords() -> set[str]:
    fields = {
        f.name
        for config in (LoadOptions, EngineConfig, SamplingConfig, BenchConfig, DistillConfig)
        for f in dataclasses.fields(config)
    }
    functions = (Pipeline.load, Pipeline.generate, ChatSession.prefill, Distiller.__init__, with_figures)
    return fields | {name for function in functions for name in inspect.signature(function).parameters}


def test_every_flag_is_an_option_of_the_app():
    options = app_options()
    assert "--context-window" in options and "--no-compile" in options  # the walk reaches the commands' options
    flags = {*FLAGS.values(), *(text.removeprefix("no ") for text in PHRASES.values())}
    assert sorted(flags - options) == []


def test_every_setting_is_a_library_keyword():
    keywords = library_keywords()
    phrased = {phrase.split("`")[1] for phrase in PHRASES}
    assert sorted((set(FLAGS) | phrased) - keywords) == []
    assert phrased <= set(FLAGS)  # a switch named without a value still reads as its flag


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("use `context_window` 8k or more", "use --context-window 8k or more"),
        (
            "`offload` kv+weights runs eager steps: use `steps` eager",
            "--offload kv+weights runs eager steps: use --steps eager",
        ),
        ("`steps` compiled runs dense weights only", "--steps compiled runs dense weights only"),
        ("`ngram` needs a `mode` with a drafter tier", "--ngram needs a --mode with a drafter tier"),
        ("`ngram` False: the drafter alone", "--no-ngram: the drafter alone"),
        ("`gamma1` must lie in 1..64; `max_new_tokens` 4", "--gamma1 must lie in 1..64; --max-new-tokens 4"),
        ("`prompt_cache` /tmp/x is not a folder", "--prompt-cache /tmp/x is not a folder"),
        ("`ngram` Falsey", "--ngram Falsey"),  # a phrase ends at a word's end
        # unknown names, and backticks that hold no setting, stay as they are
        ("`tune` and `cache_positions`", "`tune` and `cache_positions`"),
        (
            "`triforce cache clear --measurements` measures again",
            "`triforce cache clear --measurements` measures again",
        ),
        ("no settings here", "no settings here"),
    ],
)
def test_flag_text(message, expected):
    assert flag_text(message) == expected


def test_errors_and_notes_show_flags():
    console = Console(file=io.StringIO(), width=200)
    print_error(console, "tensor parallelism shards dense weights: use `weights` dense")
    print_note(console, "could not save the prefill to `prompt_cache` /tmp/x (disk full); generating on")
    assert console.file.getvalue().splitlines() == [
        "error: tensor parallelism shards dense weights: use --weights dense",
        "could not save the prefill to --prompt-cache /tmp/x (disk full); generating on",
    ]


def test_a_config_error_through_the_cli_names_flags(tmp_path):
    """EngineConfig's check runs before any model loads: the message the library words with settings, as flags."""
    with pytest.raises(ConfigError, match="^`ngram` needs a `mode` with a drafter tier"):
        EngineConfig(mode="autoregressive", ngram=True)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    result = CliRunner().invoke(app, ["generate", "-p", str(prompt), "--ngram", "--mode", "autoregressive", "--json"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("error: --ngram needs a --mode with a drafter tier (streaming or triforce)")
    assert "`" not in result.stdout and "--ngram needs a --mode" in result.stdout  # the JSON error too
