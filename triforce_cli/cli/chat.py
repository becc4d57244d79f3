"""`triforce chat`: questions about a (long) document, each answered after the whole conversation so far.

The document is prefilled once at the start; then every line read is a question (or a /command), whose answer
streams as the tiers accept it. At a terminal (standard input and output both), lines are edited and remembered
with readline (the history kept in the cache root); otherwise each line of standard input is one question and each
answer one block of stdout ending in a newline, so that `printf 'q1\\nq2\\n' | triforce chat -p doc.txt` answers
both.

Inside the session a question or command that cannot be carried out is one error line, and the session goes on;
Ctrl-C stops the answer being written (what it had is kept), while at the prompt it ends the session with 130 as
every command ends on Ctrl-C. End of input (Ctrl-D) and /quit end it with 0.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console
from rich.text import Text

from triforce_cli.cli import options as o
from triforce_cli.cli.console import (
    OUT_OF_MEMORY,
    StdoutConsole,
    command_console,
    is_out_of_memory,
    print_error,
    print_note,
)
from triforce_cli.cli.render import (
    PrefillProgress,
    TokenStream,
    answer_line,
    first_token_seconds,
    print_setup,
    print_summary,
)
from triforce_cli.cli.settings import engine_config, load_pipeline
from triforce_cli.decoding.chat import ChatSession, transcript_text
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.errors import PromptError, TriforceError
from triforce_cli.interrupts import INTERRUPTED_EXIT_CODE, interrupted_exit_code
from triforce_cli.runtime.prompts import read_prompt
from triforce_cli.runtime.store import chat_history_file

PROMPT = "> "
HISTORY_LENGTH = 1000  # lines of the terminal history kept across sessions


@o.takes(*o.MODELS, *o.ENGINE, "max_new_tokens", *o.SAMPLING, *o.MACHINE, "prompt_cache")
def chat(prompt_file: o.DocumentFile, **settings) -> None:
    """Ask questions about a (long) document; each answer is the target's own, after the whole conversation."""
    prompt_cache = settings["prompt_cache"]
    out = StdoutConsole(highlight=False)
    with command_console(settings["threads"]) as err:
        config = engine_config(settings)
        if prompt_file == "-":
            raise PromptError("chat reads its questions from standard input: give the document as a file")
        document = read_prompt(prompt_file)
        if prompt_cache is not None:
            check_writable(prompt_cache)  # before the model loads, as generate checks it
        pipe = load_pipeline(settings, config, lambda message: print_note(err, message))
        session = pipe.chat(document)
        prefix_tokens = len(session.conversation.document_prefix_ids)
        print_setup(err, pipe.engine.memory_plan(prefix_tokens), pipe.engine.drafter_description)
        with PrefillProgress(err) as progress:
            restored = session.prefill(progress, prompt_cache)
        how = "restored from --prompt-cache" if restored else "read"
        print_note(err, f"ask about {prompt_file} ({prefix_tokens} tokens {how}); /help lists the commands")
        interactive = sys.stdin.isatty() and sys.stdout.isatty()  # else a prompt would land among the answers
        with line_history(chat_history_file()) if interactive else nullcontext():
            for line in typed_lines(interactive):
                if line == "/quit":
                    break
                if line.startswith("/"):
                    run_command(line, session, err)
                else:
                    answer(session, line, out, err)


@contextmanager
def line_history(path: Path) -> Iterator[None]:
    """Line editing and history for input() (readline), the history of earlier sessions read from path and written
    back at the end; a history that cannot be read or written is only missing. readline is imported here, at a
    terminal only: on import it may write a terminal control sequence to stdout, which a script reads."""
    import readline

    try:
        readline.read_history_file(path)
    except OSError:
        pass  # the first session, or a cache root that cannot be read
    readline.set_history_length(HISTORY_LENGTH)
    try:
        yield
    finally:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass  # a read-only cache root: this session's lines are not kept


def typed_lines(interactive: bool) -> Iterator[str]:
    """The lines read, surrounding whitespace dropped and blank ones skipped, until the end of input: at a terminal
    after a prompt, else each line of standard input."""
    if not interactive:
        yield from filter(None, (line.strip() for line in sys.stdin))
        return
    while True:
        try:
            line = input(PROMPT).strip()
        except EOFError:  # Ctrl-D: the shell's prompt then starts on a line of its own
            print()
            return
        if line:
            yield line


def answer(session: ChatSession, question: str, out: Console, err: Console) -> None:
    """Stream the answer to question, then one line of its figures. A question the session cannot take (one that
    does not fit the context, a cache that cannot grow) is one error line, the conversation left as it was. Ctrl-C
    stops the answer, kept as far as it got; a SIGTERM still ends the command."""
    stream = TokenStream(out, session.pipeline.target.tokenizer)
    try:
        with PrefillProgress(err) as progress:
            result = session.ask(question, on_tokens=stream, on_prefill=progress)
    except TriforceError as error:
        print_error(err, str(error))
        return
    except KeyboardInterrupt:  # before or after the engine's own handling of it, between two of its steps
        result = None
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        print_error(err, OUT_OF_MEMORY)
        return
    stream.finish()
    if result is None or result.stats.stop_reason == "interrupted":
        if interrupted_exit_code() != INTERRUPTED_EXIT_CODE:
            raise KeyboardInterrupt  # not Ctrl-C: the command ends, with 128 + that signal
        print_note(err, "answer stopped; ask on, or end the session with Ctrl-D or /quit")
    else:
        print_note(err, answer_line(result.stats))


def reset_conversation(session: ChatSession, argument: str, err: Console) -> None:
    """/reset: the document alone again."""
    session.reset()
    print_note(err, "back to the document alone")


def save_transcript(session: ChatSession, argument: str, err: Console) -> None:
    """/save FILE: the questions and answers written to FILE; one error line where it cannot be written."""
    if not argument:
        print_error(err, "/save needs a file: /save FILE")
        return
    try:
        Path(argument).expanduser().write_text(transcript_text(session.transcript), encoding="utf-8")
    except OSError as error:
        print_error(err, f"cannot write {argument}: {error.strerror or type(error).__name__}")
        return
    print_note(err, f"saved {len(session.transcript)} messages to {argument}")


def print_stats(session: ChatSession, argument: str, err: Console) -> None:
    """/stats: the last answer's prompt (how much of it the engine had read just before), then generate's summary."""
    turn = session.last_turn
    if turn is None:
        print_note(err, "no answer yet")
        return
    prompt, carried = len(turn.prompt_ids), turn.carried_tokens
    print_note(
        err,
        f"last prompt: {prompt} tokens, {carried} of them read just before (the document, or the previous prompt and"
        f" answer), {prompt - carried} new; first answer token after {first_token_seconds(turn.result.stats):.2f} s",
    )
    print_summary(err, turn.result.stats)


def print_help(session: ChatSession, argument: str, err: Console) -> None:
    """/help: every command and what it does."""
    for usage, (_, description) in COMMANDS.items():
        err.print(Text(f"{usage:<12} {description}"))
    err.print(Text(f"{'/quit':<12} end the session (as Ctrl-D does)"))


Command = Callable[[ChatSession, str, Console], None]  # (session, the text after the command's name, stderr)
COMMANDS: dict[str, tuple[Command, str]] = {  # usage -> (what carries it out, what it does)
    "/reset": (reset_conversation, "forget the questions and answers: the document alone again"),
    "/save FILE": (save_transcript, "write the questions and answers to FILE"),
    "/stats": (print_stats, "the last answer's prompt, timing and acceptance per tier"),
    "/help": (print_help, "these commands; any other line is a question"),
}


def run_command(line: str, session: ChatSession, err: Console) -> None:
    """Carry out a /command (COMMANDS); an unknown one is an error line."""
    name, _, argument = line.partition(" ")
    found = next((run for usage, (run, _) in COMMANDS.items() if usage.split()[0] == name), None)
    if found is None:
        print_error(err, f"unknown command {name}: /help lists them")
        return
    found(session, argument.strip(), err)
