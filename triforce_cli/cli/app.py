"""The `triforce` application: its commands, and usage errors as one line like every other error."""

import importlib
import sys

import typer
from rich.console import Console
from typer.core import TyperGroup

from triforce_cli.cli.bench import bench
from triforce_cli.cli.cache import cache_app
from triforce_cli.cli.chat import chat
from triforce_cli.cli.console import INTERRUPTED, print_error
from triforce_cli.cli.distill import distill
from triforce_cli.cli.generate import generate
from triforce_cli.cli.info import info
from triforce_cli.cli.plan import plan
from triforce_cli.cli.serve import serve
from triforce_cli.interrupts import interrupted_exit_code

# click's exceptions, wherever this typer takes click from (recent versions carry their own copy)
click_exceptions = importlib.import_module(typer.BadParameter.__module__)


class OneLineErrors(TyperGroup):
    """A group whose usage errors (an unknown option, a value that cannot be read) print one ``error:`` line, with
    a pointer to --help, instead of a panel; with --json among the arguments also a JSON object on stdout."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        arguments = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(arguments, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as err:  # its message is the help
            err.show()
            sys.exit(err.exit_code)
        except click_exceptions.ClickException as err:
            print_error(Console(stderr=True), usage_line(err), "--json" in arguments)
            sys.exit(err.exit_code)
        except typer.Abort:
            print_error(Console(stderr=True), INTERRUPTED, "--json" in arguments)
            sys.exit(interrupted_exit_code())
        sys.exit(code if isinstance(code, int) else 0)


# How pydantic, which typer reads choices and numbers with, starts the message of a ValueError: no help to a user
PYDANTIC_VALUE_ERROR = "Value error, "


def usage_line(err) -> str:
    """'Invalid value for '--gamma1': 'x' is not a valid integer (see triforce generate --help)'."""
    if isinstance(err, click_exceptions.BadParameter):
        err.message = err.message.removeprefix(PYDANTIC_VALUE_ERROR)
    message = " ".join(err.format_message().split())
    context = getattr(err, "ctx", None)
    return f"{message} (see {context.command_path} --help)" if context is not None else message


app = typer.Typer(
    cls=OneLineErrors,
    name="triforce",
    help="Lossless long-context speculative generation (TriForce: drafter -> retrieval cache -> full cache).",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: readable at 80 columns, and brackets in help texts stay as typed
)
app.command()(generate)
app.command()(chat)
app.command()(bench)
app.command()(distill)
app.command()(info)
app.command()(plan)
app.command()(serve)
app.add_typer(cache_app, name="cache")
