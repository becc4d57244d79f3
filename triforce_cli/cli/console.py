"""How commands speak to the terminal: dim status notes, and every failure as one line with a non-zero exit.

Domain errors (TriforceError), running out of memory and Ctrl-C (or SIGTERM) become one ``error:`` line on stderr
here, at the command-line boundary only, the settings they name in backticks as flags (cli/flags.py); with ``--json`` the same message also goes to stdout as ``{"error": ...}``,
so a script reading stdout always gets one JSON object. A reader that closes stdout early (``| head``) ends the
command quietly.
"""

import errno
import json
import os
import re
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout

import torch
import typer
from rich.console import Console
from rich.text import Text

from triforce_cli.cli.flags import flag_text
from triforce_cli.errors import TriforceError
from triforce_cli.interrupts import InterruptWatch, interrupted_exit_code
from triforce_cli.runtime.parallel import launch_rank

OUT_OF_MEMORY = "out of memory: lower --max-new-tokens, use a shorter prompt or a smaller --dtype"
INTERRUPTED = "interrupted"
CPU_ALLOCATION_FAILURES = ("can't allocate memory", "Storage size calculation overflowed")
# 128 + SIGPIPE (13): what a shell reports for `yes | head` and every coreutils program whose reader went away, so that
# `set -o pipefail` treats the tool like any other; 0 would claim the whole output was delivered.
CLOSED_STDOUT_EXIT_CODE = 141
FILE_COLUMNS = 200  # the width of tables written to a file or a pipe, where no terminal gives one
ITEM_END = re.compile(r"(?<=[,;:)]) ")  # a space after the punctuation that ends an item of a note
NOTE_INDENT = "  "  # before a note's continuation lines


def first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "unknown error")


def wrap_note(message: str, width: int) -> list[str]:
    """message in lines of at most width, the later ones indented. Lines break only between the items of a list,
    after the ', ', '; ', ': ' or ') ' that ends one, so a size ('1.2 MiB'), a name or a command stays whole; an item
    longer than a line (one holding a long path) gets a line of its own, for the terminal to wrap."""
    lines = [""]
    for item in ITEM_END.split(message):
        if lines[-1] and len(f"{lines[-1]} {item}") > width:
            lines.append(NOTE_INDENT + item)
        else:
            lines[-1] = f"{lines[-1]} {item}" if lines[-1] else item
    return lines


def print_note(console: Console, message: str) -> None:
    """A dim status note, printed as it is (model names and paths may contain brackets) but for the settings it
    names (flag_text), wrapped to the console's width by wrap_note rather than by Rich, which would break inside a
    size or a name."""
    console.print(Text("\n".join(wrap_note(flag_text(message), console.width)), style="dim"), soft_wrap=True)


def print_error(console: Console, message: str, json_output: bool = False) -> None:
    """One line, printed as it is (no Rich markup or emoji codes are read from it) but for the settings it names,
    which become flags (flag_text); with json_output also a JSON object on stdout."""
    line = first_line(flag_text(message))
    console.print(Text.assemble(("error:", "bold red"), " ", line), soft_wrap=True)
    if json_output:
        print(json.dumps({"error": line}))


def is_out_of_memory(err: BaseException) -> bool:
    """torch reports a failed CPU allocation as a plain RuntimeError."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in CPU_ALLOCATION_FAILURES)


def quiet_libraries() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


class StdoutConsole(Console):
    """A console on stdout whose reader going away is left to command_console (quiet, exit 141): Rich's own handling
    would exit with 1, which reads as a failure of the command."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def table_console() -> StdoutConsole:
    """stdout for wide tables: the terminal's width, COLUMNS where it is set, else FILE_COLUMNS where stdout is a
    file or a pipe (Rich's 80 columns there cut a bench's figures to '1.…')."""
    console = StdoutConsole()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = FILE_COLUMNS
    return console


def drop_stdout() -> None:
    """Point stdout at /dev/null, as the Python docs advise on BrokenPipeError: what is still buffered for a reader
    that went away is then dropped at exit instead of failing once more as an 'Exception ignored' message."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@contextmanager
def command_console(threads: int | None = None, json_output: bool = False) -> Iterator[Console]:
    """A command's stderr console: libraries quieted, torch threads set, failures reported as one line.

    Exit codes: 1 for a domain error or running out of memory, 130 for Ctrl-C and 143 for SIGTERM (at any point:
    loading, prefill), 141 with nothing said once stdout's reader has gone (stdout is flushed here for that).
    """
    follower = launch_rank() != 0  # under torchrun only rank 0 speaks; the others compute alongside
    err = Console(stderr=True, quiet=follower)
    quiet_libraries()
    with ExitStack() as scope:
        watch = scope.enter_context(InterruptWatch())
        if follower:
            scope.enter_context(redirect_stdout(scope.enter_context(open(os.devnull, "w"))))
        try:
            try:
                if threads is not None:
                    torch.set_num_threads(threads)
                yield err
            except TriforceError as error:
                print_error(err, str(error), json_output)
                raise typer.Exit(1) from None
            except (typer.Exit, BrokenPipeError):
                raise
            except OSError as error:  # a path the user gave, or the cache folder, that cannot be read or written
                if not isinstance(error, ConnectionError) and error.strerror and error.filename is not None:
                    print_error(err, f"{error.filename}: {error.strerror}", json_output)
                    raise typer.Exit(1) from None
                raise
            except BaseException as error:
                if watch.seen or isinstance(error, KeyboardInterrupt):
                    print_error(err, INTERRUPTED, json_output)
                    raise typer.Exit(interrupted_exit_code()) from None
                if not is_out_of_memory(error):
                    raise
                print_error(err, OUT_OF_MEMORY, json_output)
                raise typer.Exit(1) from None
            finally:
                sys.stdout.flush()  # a closed stdout shows here, not in Python's exit
        except BrokenPipeError:
            drop_stdout()
            raise typer.Exit(CLOSED_STDOUT_EXIT_CODE) from None
