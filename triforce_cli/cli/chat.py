"""`triforce chat`: questions about a (long) document, each answered after the whole conversation so far.

The document is prefilled once at the start; then every line read is a question (or a /command; a question that
starts with "/" is written "//"), whose answer streams as the tiers accept it. Lines between one that starts with
three double quotes (BLOCK) and one that ends with them are one question, as ollama reads them. At a terminal
(standard input and output both), lines are edited and remembered with readline (the history kept in the cache
root), and a paste of several lines is one question (bracketed paste); otherwise each line of standard input is one question and each answer one
block of stdout ending in a newline, so that `printf 'q1\\nq2\\n' | triforce chat -p doc.txt` answers both.

Inside the session a question or command that cannot be carried out is one error line, and the session goes on;
Ctrl-C stops the answer being written (what it had is kept), while at the prompt it ends the session with 130 as
every command ends on Ctrl-C. End of input (Ctrl-D) and /quit end it with 0.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Annotated

import typer
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
from triforce_cli.cli.settings import check_draft_used, engine_config, load_pipeline
from triforce_cli.decoding.chat import ChatSession, state_path, transcript_text, transcript_turns
from triforce_cli.decoding.prompt_state import check_writable
from triforce_cli.errors import PromptError, TriforceError
from triforce_cli.interrupts import INTERRUPTED_EXIT_CODE, interrupted_exit_code
from triforce_cli.runtime.prompts import read_prompt
from triforce_cli.runtime.store import chat_history_file

PROMPT = "> "
MORE_PROMPT = "... "  # inside a """ block
BLOCK = '"""'  # opens and closes a question of several lines
HISTORY_LENGTH = 1000  # lines of the terminal history kept across sessions


DocumentFile = Annotated[
    str, typer.Option("--prompt-file", "-p", metavar="FILE", help="Text file of the document to ask about.")
]
SystemPrompt = Annotated[
    str | None,
    typer.Option(metavar="TEXT", help="A system prompt opening the conversation.", show_default=False),
]


def chat(
    prompt_file: DocumentFile,
    system: SystemPrompt = None,
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
    temperature: o.Temperature = o.SAMPLING_DEFAULTS.temperature,
    top_p: o.TopP = o.SAMPLING_DEFAULTS.top_p,
    top_k: o.TopK = o.SAMPLING_DEFAULTS.top_k,
    seed: o.Seed = o.SAMPLING_DEFAULTS.seed,
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
) -> None:
    """Ask questions about a (long) document; each answer is the target's own, after the whole conversation."""
    settings = locals()  # cli/settings.py picks the library's settings from them by name
    out = StdoutConsole(highlight=False)
    with command_console(threads) as err:
        config = engine_config(settings)
        check_draft_used(draft, config.uses_drafter, f"`mode` {config.mode}")
        if prompt_file == "-":
            raise PromptError("chat reads its questions from standard input: give the document as a file")
        document = read_prompt(prompt_file)
        if prompt_cache is not None:
            check_writable(prompt_cache)  # before the model loads, as generate checks it
        pipe = load_pipeline(settings, config, lambda message: print_note(err, message))
        session = ChatSession(pipe, document, system)
        prefix_tokens = len(session.conversation.document_prefix_ids)
        print_setup(err, pipe.engine.memory_plan(prefix_tokens), pipe.engine.drafter_description)
        with PrefillProgress(err) as progress:
            restored = session.prefill(progress, prompt_cache)
        how = "restored from --prompt-cache" if restored else "read"
        print_note(err, f"ask about {prompt_file} ({prefix_tokens} tokens {how}); /help lists the commands")
        interactive = sys.stdin.isatty() and sys.stdout.isatty()  # else a prompt would land among the answers
        with line_history(chat_history_file()) if interactive else nullcontext():
            prompt = [PROMPT]
            for line in questions(typed_lines(interactive, prompt), prompt):
                if line == "/quit":
                    break
                if line.startswith("/") and not line.startswith("//"):
                    run_command(line, session, err, out)
                else:
                    answer(session, line.removeprefix("/"), out, err)


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
    readline.parse_and_bind("set enable-bracketed-paste on")  # a paste of several lines comes as one line
    try:
        yield
    finally:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass  # a read-only cache root: this session's lines are not kept


def typed_lines(interactive: bool, prompt: list[str] | None = None) -> Iterator[str]:
    """The lines read, without their line ends, until the end of input: at a terminal after a prompt (prompt[0],
    which a reader may change between lines), else each line of standard input. A paste at a terminal comes as one
    line holding several."""
    prompt = prompt if prompt is not None else [PROMPT]
    if not interactive:
        yield from (line.rstrip("\r\n") for line in sys.stdin)
        return
    while True:
        try:
            line = input(prompt[0])
        except EOFError:  # Ctrl-D: the shell's prompt then starts on a line of its own
            print()
            return
        yield line


def questions(lines: Iterator[str], prompt: list[str] | None = None) -> Iterator[str]:
    """The questions and commands in lines, surrounding whitespace dropped and blank ones skipped: a line, or the
    lines from one that starts with BLOCK (three double quotes) to one that ends with it, joined by newlines with the quotes dropped (a
    block the input ends in is a question still). prompt[0] is MORE_PROMPT while a block is read, else PROMPT."""
    prompt = prompt if prompt is not None else [PROMPT]
    for line in lines:
        if not line.strip().startswith(BLOCK):
            if line.strip():
                yield line.strip()
            continue
        block = [line.strip().removeprefix(BLOCK)]
        prompt[0] = MORE_PROMPT
        while not block[-1].rstrip().endswith(BLOCK):
            following = next(lines, None)
            if following is None:
                break
            block.append(following)
        prompt[0] = PROMPT
        text = "\n".join(block).rstrip().removesuffix(BLOCK).strip()
        if text:
            yield text


def answer(session: ChatSession, question: str | None, out: Console, err: Console) -> None:
    """Stream the answer to question (None: the latest question again, ChatSession.retry), then one line of its
    figures. A question the session cannot take (one that does not fit the context, a cache that cannot grow) is
    one error line, the conversation left as it was. Ctrl-C stops the answer, kept as far as it got; a SIGTERM
    still ends the command."""
    stream = TokenStream(out, session.pipeline.target.tokenizer)
    try:
        with PrefillProgress(err) as progress:
            if question is None:
                result = session.retry(on_tokens=stream, on_prefill=progress)
            else:
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


def reset_conversation(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/reset: the document alone again."""
    session.reset()
    print_note(err, "back to the document alone")


def save_transcript(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/save FILE: the questions and answers written to FILE, and what the engine holds of them beside it
    (state_path), for /load to take up without reading the conversation again; one error line where it cannot be
    written."""
    if not argument:
        print_error(err, "/save needs a file: /save FILE")
        return
    path = Path(argument).expanduser()
    state = state_path(path)
    try:
        path.write_text(transcript_text(session.transcript), encoding="utf-8")
        state.unlink(missing_ok=True)  # a state saved before with another conversation
        with_state = session.save_state(state)
    except OSError as error:
        print_error(err, f"cannot write {argument}: {error.strerror or error}")
        return
    kept = f", and its state to {state}" if with_state else ""
    print_note(err, f"saved {len(session.transcript)} messages to {argument}{kept}")


def retry_question(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/retry: the latest question asked again, its answer dropped."""
    answer(session, None, out, err)


def load_conversation(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/load FILE: the conversation /save wrote to FILE taken up in place of this one; one error line where it
    cannot be read or does not fit."""
    if not argument:
        print_error(err, "/load needs a file: /load FILE")
        return
    try:
        text = Path(argument).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        print_error(err, f"cannot read {argument}: {getattr(error, 'strerror', None) or type(error).__name__}")
        return
    try:
        session.load(transcript_turns(text))
    except PromptError as error:
        print_error(err, f"cannot load {argument}: {error}")
        return
    state = state_path(Path(argument).expanduser())
    refused = session.load_state(state) if state.is_file() else None
    if refused is not None:
        print_note(err, f"{refused}: the next question reads the conversation again")
    how = " with its state" if state.is_file() and refused is None else ""
    loaded = f"loaded {len(session.turns)} questions and answers{how} from {argument}"
    print_note(err, f"{loaded}; {context_meter(session)}")


def context_meter(session: ChatSession) -> str:
    """How much of the context the conversation holds."""
    used, context = session.used_tokens, session.context_tokens
    return f"context: {used} of {context} tokens used ({100 * used / context:.0f}%), {context - used} left"


def print_stats(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/stats: how much of the context the conversation holds, the last answer's prompt (how much of it the engine
    had read just before), then generate's summary."""
    print_note(err, context_meter(session))
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


def print_help(session: ChatSession, argument: str, out: Console, err: Console) -> None:
    """/help: every command and what it does."""
    for usage, (_, description) in COMMANDS.items():
        err.print(Text(f"{usage:<12} {description}"))
    err.print(Text(f"{'/quit':<12} end the session (as Ctrl-D does)"))
    err.print(
        Text(f"{BLOCK:<12} a question of several lines: from a line that starts with {BLOCK} to one that ends with it")
    )


# (session, the text after the command's name, stdout, stderr)
Command = Callable[[ChatSession, str, Console, Console], None]
COMMANDS: dict[str, tuple[Command, str]] = {  # usage -> (what carries it out, what it does)
    "/retry": (retry_question, "ask the latest question again, its answer dropped"),
    "/reset": (reset_conversation, "forget the questions and answers: the document alone again"),
    "/save FILE": (save_transcript, "write the questions and answers to FILE, their KV state beside it"),
    "/load FILE": (load_conversation, "take up the questions and answers /save wrote to FILE, with their state"),
    "/stats": (print_stats, "the context used, the last answer's prompt, timing and acceptance per tier"),
    "/help": (print_help, 'these commands; any other line is a question ("//" starts one with "/")'),
}


def run_command(line: str, session: ChatSession, err: Console, out: Console) -> None:
    """Carry out a /command (COMMANDS); an unknown one is an error line."""
    name, _, argument = line.partition(" ")
    found = next((run for usage, (run, _) in COMMANDS.items() if usage.split()[0] == name), None)
    if found is None:
        print_error(err, f"unknown command {name}: /help lists them")
        return
    found(session, argument.strip(), out, err)
