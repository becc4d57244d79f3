"""`triforce chat` and the ChatSession under it.

The library tests run a ChatSession on a tiny random target whose answers depend on the whole conversation, with a
word-level tokenizer and chat template (helpers: chat_model, WORD_CHAT_TEMPLATE), so that a prompt's token ids
can be compared with the tokenized rendering of the whole conversation. The command-line tests run `triforce chat`
on the same model through the loader swap of conftest's `tiny` fixture, questions scripted on stdin. The tests
marked embedded check the turns' token ids on the embedded model's own chat template, and one scripted chat on it.
"""

import builtins
import itertools
import os
import pty
import re
import readline
import select
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import CHAT_WORDS, WORD_CHAT_TEMPLATE, chat_model, save_word_checkpoint, small_config, word_tokenizer
from transformers import AutoTokenizer
from typer.testing import CliRunner

import triforce_cli.cli.chat
from triforce_cli.cli.app import app
from triforce_cli.cli.chat import line_history, questions, typed_lines
from triforce_cli.decoding.chat import (
    ChatSession,
    ChatTurn,
    ConversationIds,
    state_path,
    transcript_text,
    transcript_turns,
)
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.decoding.stats import GenerationResult, GenerationStats
from triforce_cli.errors import PromptError
from triforce_cli.runtime.loading import resolve_checkpoint
from triforce_cli.runtime.native import kernel_folder
from triforce_cli.runtime.prompts import DOCUMENT_PLACEHOLDER

DOCUMENT = " ".join(f"w{i % 19}" for i in range(120))
QUESTIONS = ("w5 w6", "w7 w8 w9", "w1")
NEW_TOKENS = 12
GREEDY = SamplingConfig(temperature=0)
TOO_LONG = " ".join(["w2"] * 600)  # past the tiny model's 512 positions whatever came before
# the command-line settings of small_config(max_new_tokens=NEW_TOKENS, sampling=GREEDY), on the chat model
CLI_ARGS = (
    "--target", "chat",
    "--budget", "32", "--chunk-size", "8", "--draft-window", "24", "--sink-tokens", "4",
    "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0",
)  # fmt: skip


@pytest.fixture
def pipe(tiny) -> Pipeline:
    return Pipeline.load(
        LoadOptions(target="chat"),
        config=small_config(max_new_tokens=NEW_TOKENS, sampling=GREEDY, prefill_block=16, gamma_policy="fixed"),
    )  # prefill chunks of 16: the document is several, so prefix reuse keeps some; every tier drafts (the tiny
    # target drafting for itself would never pay at the costed default's prices, so it would not draft)


def conversation_ids(tokenizer, questions: list[str], answers: list[str], system: str | None = None) -> list[int]:
    """The whole conversation as the template renders it, the document written out, tokenized in one piece."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages += [{"role": "user", "content": f"{DOCUMENT}\n\n{questions[0]}"}]
    for answer, question in zip(answers, questions[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def answered(question: str, prompt_ids: list[int], answer_ids: list[int], tokenizer) -> ChatTurn:
    """The turn of question whose answer was answer_ids, as a session records it."""
    stats = GenerationStats("autoregressive", None, len(prompt_ids), new_tokens=len(answer_ids))
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    return ChatTurn(question, prompt_ids, GenerationResult(answer_ids, text, stats), 0)


# ---------------------------------------------------------------------------------------------- the session


def test_each_prompt_extends_the_one_before_and_is_the_whole_conversation(pipe):
    session = ChatSession(pipe, DOCUMENT)
    session.prefill()
    for question in QUESTIONS:
        session.ask(question)
    turns, prefix = session.turns, session.conversation.document_prefix_ids
    assert len(turns) == len(QUESTIONS) and all(len(turn.result.token_ids) == NEW_TOKENS for turn in turns)
    assert turns[0].prompt_ids[: len(prefix)] == prefix and turns[0].carried_tokens == len(prefix)
    assert turns[0].result.stats.reused_tokens == len(prefix)  # the document, read once
    for before, after in itertools.pairwise(turns):
        read = before.prompt_ids + before.result.token_ids
        assert after.prompt_ids[: len(read)] == read
        assert after.carried_tokens == len(read) < len(after.prompt_ids)
        # the last prompt and its answer are kept but the answer's last token, whose keys no forward wrote yet
        assert after.result.stats.reused_tokens == len(read) - 1
    tokenizer = pipe.target.tokenizer
    answers = [turn.result.text for turn in turns]
    for k, turn in enumerate(turns):
        assert turn.prompt_ids == conversation_ids(tokenizer, list(QUESTIONS[: k + 1]), answers[:k])
    assert session.transcript == [
        (role, text)
        for question, answer in zip(QUESTIONS, answers)
        for role, text in (("user", question), ("assistant", answer))
    ]


def test_greedy_answers_are_the_targets_on_the_whole_conversation(pipe):
    """Each answer of a triforce session is what autoregressive greedy decoding of the target writes after the same
    ids; and the conversation matters: a question asked after others is answered otherwise than asked first."""
    session = ChatSession(pipe, DOCUMENT)
    session.prefill()
    results = [session.ask(question) for question in QUESTIONS]
    assert any(a.accepted < a.drafted for result in results for a in result.stats.acceptance)  # drafts rejected too
    pipe.reconfigure(mode="autoregressive")
    for turn in session.turns:
        assert turn.result.token_ids == pipe.generate_ids(turn.prompt_ids).token_ids
    asked_first = ChatSession(pipe, DOCUMENT).ask(QUESTIONS[1])
    assert asked_first.token_ids != results[1].token_ids


def test_each_turn_prefills_only_what_is_new_and_answers_as_a_fresh_engine(pipe, monkeypatch):
    """Three questions: after the document, each turn's prefill computes only the positions the engine does not
    hold (counted as the full cache's prefill forwards compute them): the first question's own tokens, then the last
    answer's last token (no forward wrote its keys yet), the template's end of turn and the next question. Each
    greedy answer is a fresh engine's on the same conversation, prefilled whole, in triforce mode and
    autoregressive (resting on the numeric contract, test_numeric_contract.py)."""
    model = pipe.target.model
    real, prefilled = model.forward, []

    def forward(tokens, start, cache, num_logits=None, decoding=True):
        if not decoding and cache is pipe.engine._caches.full:
            prefilled.append(len(tokens))
        return real(tokens, start, cache, num_logits=num_logits, decoding=decoding)

    monkeypatch.setattr(model, "forward", forward)
    session = ChatSession(pipe, DOCUMENT)
    session.prefill()
    counts = []
    for question in QUESTIONS:
        prefilled.clear()
        session.ask(question)
        counts.append(sum(prefilled))
    monkeypatch.undo()
    turns = session.turns
    assert counts[0] == len(turns[0].prompt_ids) - len(session.conversation.document_prefix_ids)
    for before, after, count in zip(turns, turns[1:], counts[1:]):
        new = len(after.prompt_ids) - len(before.prompt_ids) - len(before.result.token_ids)
        assert count == new + 1 == len(after.prompt_ids) - after.result.stats.reused_tokens
    for mode in ("triforce", "autoregressive"):
        fresh = Engine(pipe.target, replace(pipe.config, mode=mode), prefill_threads=pipe.engine.prefill_threads)
        for turn in turns:
            answer = fresh.generate(turn.prompt_ids)
            fresh._caches.holds = None  # nothing kept for the next conversation: each prefilled whole
            assert answer.token_ids == turn.result.token_ids, mode


def test_reset_goes_back_to_the_document_alone(pipe):
    session = ChatSession(pipe, DOCUMENT)
    first = session.ask(QUESTIONS[0])
    session.ask(QUESTIONS[1])
    session.reset()
    assert session.transcript == [] and session.last_result is not None
    assert session.prompt_ids(QUESTIONS[1]) == conversation_ids(pipe.target.tokenizer, [QUESTIONS[1]], [])
    assert session.ask(QUESTIONS[0]).token_ids == first.token_ids
    assert session.transcript == [("user", QUESTIONS[0]), ("assistant", first.text)]


def test_a_question_that_does_not_fit_leaves_the_conversation_as_it_was(pipe):
    session = ChatSession(pipe, DOCUMENT)
    session.ask(QUESTIONS[0])
    with pytest.raises(PromptError, match="the 512-token context leaves no room for an answer"):
        session.ask(TOO_LONG)
    with pytest.raises(PromptError, match="the question is empty"):
        session.ask("  \n")
    with pytest.raises(PromptError, match="the question is not UTF-8 text"):
        session.ask("caf\udce9 \udcff?")  # bytes of Latin-1 read from a terminal as lone surrogates
    assert len(session.turns) == 1 and session.last_turn.question == QUESTIONS[0]
    session.ask(QUESTIONS[1])
    first, second = session.turns
    assert second.prompt_ids[: len(first.prompt_ids) + NEW_TOKENS] == first.prompt_ids + first.result.token_ids


def test_an_interrupted_answer_is_kept_as_far_as_it_got(pipe):
    session = ChatSession(pipe, DOCUMENT)
    streamed = []

    def stop_at_three(tokens, origins):
        streamed.extend(tokens)
        if len(streamed) >= 3:
            raise KeyboardInterrupt

    result = session.ask(QUESTIONS[0], on_tokens=stop_at_three)
    assert result.stats.stop_reason == "interrupted" and result.token_ids == streamed and 3 <= len(streamed) < 12
    assert session.transcript == [("user", QUESTIONS[0]), ("assistant", result.text)]
    following = session.prompt_ids(QUESTIONS[1])
    assert following[: len(session.turns[0].prompt_ids) + len(streamed)] == session.turns[0].prompt_ids + streamed


def test_a_question_interrupted_before_its_first_token_is_left_out(pipe):
    session = ChatSession(pipe, DOCUMENT)

    def stop(name, done, total):
        raise KeyboardInterrupt

    result = session.ask(QUESTIONS[0], on_prefill=stop)
    assert result.stats.stop_reason == "interrupted" and result.token_ids == []
    assert session.turns == [] and session.last_result is result


def test_a_tokenizer_without_chat_template_or_an_empty_document_cannot_chat(tiny):
    with pytest.raises(PromptError, match="needs a chat template, and this model's tokenizer has none"):
        ChatSession(Pipeline.load(LoadOptions(target="tiny")), DOCUMENT)
    with pytest.raises(PromptError, match="the document is empty"):
        ChatSession(Pipeline.load(LoadOptions(target="chat")), " \n ")


def test_a_template_that_rewrites_earlier_turns_gets_its_whole_rendering():
    """A template that drops earlier answers (as reasoning templates drop earlier thinking) cannot be extended: the
    prompt is its whole rendering, the document's ids the same as ever."""
    forgetful = WORD_CHAT_TEMPLATE.replace(
        "{{ message['content'] }}", "{{ message['content'] if message['role'] == 'user' else '' }}"
    )
    tokenizer = word_tokenizer(CHAT_WORDS, "w31", forgetful)
    conversation = ConversationIds(tokenizer, DOCUMENT)
    first = conversation.prompt_ids([], QUESTIONS[0])
    turn = answered(QUESTIONS[0], first, [3, 4, 5], tokenizer)
    second = conversation.prompt_ids([turn], QUESTIONS[1])
    assert second == conversation_ids(tokenizer, list(QUESTIONS[:2]), ["w3 w4 w5"])
    assert second[: len(first) + 3] != first + [3, 4, 5]
    assert second[: len(conversation.document_prefix_ids)] == conversation.document_prefix_ids


# ---------------------------------------------------------------------------------------------- the command


def run_chat(document: Path, *args: str, input: str | None = None):
    return CliRunner().invoke(app, ["chat", "-p", str(document), *CLI_ARGS, *args], input=input)


@pytest.fixture
def document(tmp_path) -> Path:
    path = tmp_path / "document.txt"
    path.write_text(DOCUMENT + "\n", encoding="utf-8")
    return path


def answers_of(pipe: Pipeline, questions) -> list[str]:
    session = ChatSession(pipe, DOCUMENT)
    return [session.ask(question).text for question in questions]


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def flat(text: str) -> str:
    """text with its wrapped lines joined (notes wrap at the console's width)."""
    return " ".join(text.split())


def test_scripted_questions_print_one_answer_each(pipe, document):
    result = run_chat(document, input=f"{QUESTIONS[0]}\n\n   \n{QUESTIONS[1]}\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == answers_of(pipe, QUESTIONS[:2])
    assert "ask about" in result.stderr and "Traceback" not in result.output


def test_the_documents_prefill_is_kept_in_the_prompt_cache_for_the_next_chat(pipe, document, tmp_path):
    """--prompt-cache: the first chat prefills the document and saves it; the next restores it, keeps its whole
    prefill chunks for the first question and answers as the first did."""
    folder = tmp_path / "prompts"
    first = run_chat(document, "--prompt-cache", str(folder), input=f"{QUESTIONS[0]}\n")
    assert first.exit_code == 0, first.output
    assert "tokens read" in flat(first.stderr) and len(list(folder.glob("*.safetensors"))) == 1
    again = run_chat(document, "--prompt-cache", str(folder), input=f"{QUESTIONS[0]}\n/stats\n")
    assert again.exit_code == 0, again.output
    assert "tokens restored from --prompt-cache" in flat(again.stderr)
    assert again.stdout.splitlines()[0] == first.stdout.splitlines()[0] == answers_of(pipe, QUESTIONS[:1])[0]


def test_a_restored_document_is_kept_for_the_first_question(pipe, tmp_path):
    saving = ChatSession(pipe, DOCUMENT)
    assert saving.prefill(prompt_cache=tmp_path) is False
    expected = saving.ask(QUESTIONS[0])
    restoring = ChatSession(pipe, DOCUMENT)
    assert restoring.prefill(prompt_cache=tmp_path) is True
    answer = restoring.ask(QUESTIONS[0])
    assert answer.stats.reused_tokens == len(restoring.conversation.document_prefix_ids)
    assert answer.token_ids == expected.token_ids


def test_reset_save_and_stats(pipe, document, tmp_path):
    before, after = tmp_path / "before.txt", tmp_path / "after.txt"
    script = [QUESTIONS[0], f"/save {before}", "/reset", QUESTIONS[1], "/stats", f"/save {after}", "/help"]
    result = run_chat(document, input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    first, second = result.stdout.splitlines()
    assert first == answers_of(pipe, QUESTIONS[:1])[0]
    assert second == answers_of(pipe, QUESTIONS[1:2])[0]  # after /reset: the first question about the document
    assert before.read_text() == f"user: {QUESTIONS[0]}\n\nassistant: {first}\n\n"
    assert after.read_text() == f"user: {QUESTIONS[1]}\n\nassistant: {second}\n\n"
    prompt = conversation_ids(pipe.target.tokenizer, [QUESTIONS[1]], [])
    prefix = ChatSession(pipe, DOCUMENT).conversation.document_prefix_ids
    stats = flat(result.stderr)
    assert f"last prompt: {len(prompt)} tokens, {len(prefix)} of them read just before" in stats
    for shown in ("per-token latency", "prompt tokens", "acceptance per tier", "retrieval → target"):
        assert shown in stats
    assert "/save FILE" in result.stderr and "/quit" in result.stderr
    assert not error_lines(result)


def test_what_cannot_be_done_inside_the_session_is_one_line_and_the_session_goes_on(pipe, document, tmp_path):
    script = [f"/save {tmp_path}", "/save", "/bogus", TOO_LONG, QUESTIONS[0], "/quit", QUESTIONS[1]]
    result = run_chat(document, input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    assert error_lines(result) == [
        f"error: cannot write {tmp_path}: Is a directory",
        "error: /save needs a file: /save FILE",
        "error: unknown command /bogus: /help lists them",
        error_lines(result)[3],
    ]
    assert "the 512-token context leaves no room for an answer" in error_lines(result)[3]
    assert result.stdout.splitlines() == answers_of(pipe, QUESTIONS[:1])  # /quit: the last question not asked
    assert "Traceback" not in result.output


def saved_conversation(pipe: Pipeline, folder: Path) -> tuple[Path, list[int], list[int]]:
    """Two questions answered and saved with their state (transcript and state files in folder); the transcript's
    path, the ids the engine held when it was saved, and the greedy answer to the third question after them."""
    session = ChatSession(pipe, DOCUMENT)
    session.prefill()
    for asked in QUESTIONS[:2]:
        session.ask(asked)
    transcript = folder / "conversation.txt"
    transcript.write_text(transcript_text(session.transcript), encoding="utf-8")
    assert session.save_state(state_path(transcript))
    last = session.turns[-1]
    held = last.prompt_ids + last.result.token_ids[:-1]  # the answer's last token: no forward wrote its keys
    return transcript, held, session.ask(QUESTIONS[2]).token_ids


def loaded_session(pipe: Pipeline, transcript: Path) -> tuple[ChatSession, str | None]:
    """A new session on pipe that takes up transcript and its state, nothing prefilled; why the state was refused."""
    session = ChatSession(pipe, DOCUMENT)
    session.load(transcript_turns(transcript.read_text(encoding="utf-8")))
    return session, session.load_state(state_path(transcript))


def test_a_conversation_loaded_with_its_state_prefills_only_the_next_question(pipe, tmp_path):
    transcript, held, expected = saved_conversation(pipe, tmp_path)
    fresh = Pipeline.load(
        LoadOptions(target="chat"), config=small_config(max_new_tokens=NEW_TOKENS, sampling=GREEDY, prefill_block=16)
    )  # a new process's: nothing held
    session, refused = loaded_session(fresh, transcript)
    assert refused is None
    prompt = session.prompt_ids(QUESTIONS[2])
    answer = session.ask(QUESTIONS[2])
    assert prompt[: len(held)] == held and answer.stats.reused_tokens == len(held)
    assert answer.token_ids == expected


def test_a_state_saved_with_other_settings_is_refused_in_one_line_and_the_conversation_read_again(pipe, tmp_path):
    transcript, _, expected = saved_conversation(pipe, tmp_path)
    other = Pipeline.load(
        LoadOptions(target="chat"), config=small_config(max_new_tokens=NEW_TOKENS, sampling=GREEDY, prefill_block=8)
    )
    session, refused = loaded_session(other, transcript)
    assert refused == f"{state_path(transcript)} was saved for another model or setting"
    answer = session.ask(QUESTIONS[2])
    assert answer.stats.reused_tokens == 0 and answer.token_ids == expected


def test_save_then_load_in_a_new_chat_takes_the_conversation_up_with_its_state(pipe, document, tmp_path):
    saved = tmp_path / "saved.txt"
    first = run_chat(document, input="\n".join([*QUESTIONS[:2], f"/save {saved}", QUESTIONS[2]]) + "\n")
    assert first.exit_code == 0, first.output
    assert f"and its state to {state_path(saved)}" in flat(first.stderr)
    again = run_chat(document, input=f"/load {saved}\n{QUESTIONS[2]}\n/stats\n")
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines() == first.stdout.splitlines()[2:]
    stats = flat(again.stderr)
    assert "loaded 2 questions and answers with its state" in stats
    found = re.search(r"last prompt: (\d+) tokens.*?\((\d+) prompt tokens kept from an earlier prompt", stats)
    assert found is not None  # kept: all but the answer's last token, the template's text and the question
    assert 0 < int(found.group(1)) - int(found.group(2)) < 16
    assert not error_lines(again)


@pytest.mark.usefixtures("tiny")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--target", "tiny"), "error: a chat turn needs a chat template, and this model's tokenizer has none"),
        (("-p", "-"), "error: chat reads its questions from standard input: give the document as a file"),
    ],
)
def test_a_session_that_cannot_start_is_one_line_and_exit_1(document, args, message):
    result = run_chat(document, *args, input=f"{QUESTIONS[0]}\n")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines() == [message] and result.stdout == ""


@pytest.fixture
def signal_at_forward(monkeypatch, tiny):
    """Have the chat model's n-th forward from now on raise KeyboardInterrupt through the stop signal given, as the
    signal's handler does (the handler of the command's own watch, which notes which signal it was)."""

    def arm(n: int, signum: int):
        model = tiny["models"]["chat"].model
        calls = {"n": 0}
        original = model.forward

        def forward(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == n:
                signal.raise_signal(signum)
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "forward", forward)

    return arm


def test_ctrl_c_stops_the_answer_and_the_session_goes_on(document, tmp_path, signal_at_forward):
    # autoregressive: forward 1 prefills the document, 2 the first prompt, 3 and 4 sample its second and third tokens
    signal_at_forward(5, signal.SIGINT)
    transcript = tmp_path / "transcript.txt"
    script = f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n/save {transcript}\n"
    result = run_chat(document, "--mode", "autoregressive", input=script)
    assert result.exit_code == 0, result.output
    stopped, following = result.stdout.splitlines()
    assert len(stopped.split()) == 3 and len(following.split()) == NEW_TOKENS
    assert "answer stopped" in result.stderr and not error_lines(result)
    assert transcript.read_text().split("\n\n")[1] == f"assistant: {stopped}"


def test_sigterm_during_an_answer_ends_the_session_with_143(document, signal_at_forward):
    signal_at_forward(5, signal.SIGTERM)
    result = run_chat(document, "--mode", "autoregressive", input=f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n")
    assert result.exit_code == 143
    assert len(result.stdout.split()) == 3  # the stopped answer; the next question is not asked
    assert error_lines(result) == ["error: interrupted"]


def test_ctrl_c_at_the_prompt_ends_the_session_with_130(pipe, document, monkeypatch):
    def one_question_then_ctrl_c(interactive, prompt=None):
        yield QUESTIONS[0]
        raise KeyboardInterrupt

    monkeypatch.setattr(triforce_cli.cli.chat, "typed_lines", one_question_then_ctrl_c)
    result = run_chat(document, input="")
    assert result.exit_code == 130
    assert result.stdout.splitlines() == answers_of(pipe, QUESTIONS[:1])
    assert error_lines(result) == ["error: interrupted"] and "Traceback" not in result.output


def test_at_a_terminal_lines_come_after_a_prompt_until_ctrl_d(monkeypatch, capsys):
    typed = iter(["  w5 w6 ", "", "/stats"])

    def terminal_input(prompt):
        print(prompt, end="")
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", terminal_input)
    assert list(questions(typed_lines(interactive=True))) == ["w5 w6", "/stats"]
    assert capsys.readouterr().out == "> > > > \n"  # a prompt per line read, and a newline after Ctrl-D


def test_the_terminal_history_is_kept_across_sessions(tmp_path):
    history = tmp_path / "cache" / "chat-history"
    readline.clear_history()
    with line_history(history):
        readline.add_history("w5 w6")
    readline.clear_history()
    with line_history(history):
        assert readline.get_history_item(readline.get_current_history_length()) == "w5 w6"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with line_history(blocked / "chat-history"):  # a cache root that cannot be written: no history, no error
        readline.add_history("w7")
    assert blocked.read_text() == ""


def read_until(fd: int, seen: bytearray, marker: bytes, count: int = 1, timeout: float = 120) -> None:
    """Read the terminal's output into seen until marker is there count times (or the process is gone)."""
    deadline = time.monotonic() + timeout
    while seen.count(marker) < count and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                seen += os.read(fd, 4096)
            except OSError:  # the process closed the terminal
                return


def test_at_a_real_terminal_a_question_is_answered_and_kept_in_the_history(tmp_path):
    """`triforce chat` in a pseudo-terminal, as a user runs it: a prompt, the answer written there, a paste of two
    lines answered as one question, Ctrl-D ends the session with 0, and the question is in the history file the next
    session reads."""
    folder = save_word_checkpoint(tmp_path / "word-llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = WORD_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    document = tmp_path / "words.txt"
    document.write_text(" ".join(f"w{i % 31}" for i in range(60)))
    config = EngineConfig(max_new_tokens=4, sampling=GREEDY)
    session = ChatSession(Pipeline.load(LoadOptions(target=str(folder)), config=config), document.read_text())
    expected, pasted = session.ask(QUESTIONS[0]).text, session.ask("w7 w8\nw9").text
    command = [sys.executable, "-m", "triforce_cli", "chat", "-p", str(document), "--target", str(folder)]
    command += ["--max-new-tokens", "4", "--temperature", "0"]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernel_folder().parent)  # the CPU extension as built for the tests: no rebuild
    env = {**os.environ, "TRIFORCE_CACHE": str(cache)}
    terminal, user_side = pty.openpty()
    process = subprocess.Popen(
        command, stdin=user_side, stdout=user_side, stderr=user_side, env=env, start_new_session=True
    )
    os.close(user_side)
    seen = bytearray()
    try:
        read_until(terminal, seen, b"> ")
        time.sleep(0.3)  # readline is waiting for a key
        os.write(terminal, f"{QUESTIONS[0]}\r".encode())
        read_until(terminal, seen, b"> ", count=2)
        time.sleep(0.3)
        os.write(terminal, b"\x1b[200~w7 w8\nw9\x1b[201~\r")  # a paste of two lines (bracketed paste): one question
        read_until(terminal, seen, b"> ", count=3)
        time.sleep(0.3)
        os.write(terminal, b"\x04")  # Ctrl-D
        assert process.wait(timeout=60) == 0, bytes(seen).decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(terminal)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", bytes(seen).decode())  # the colours and cursor moves left out
    assert f"> {QUESTIONS[0]}" in shown and expected in shown and "Traceback" not in shown
    assert pasted in shown.split("w9", 1)[1]  # the answer to the two lines asked as one question
    history = (cache / "chat-history").read_text().splitlines()
    assert QUESTIONS[0] in history and history[-1] == "w9"  # the paste kept as one entry of two lines


# ---------------------------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def embedded_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_checkpoint(None).folder)


@pytest.mark.embedded
def test_on_the_embedded_template_each_prompt_extends_the_last_where_the_answer_ends_its_turn(embedded_tokenizer):
    """SmolLM2's template renders earlier turns unchanged: after an answer that ends with <|im_end|> (its turn's
    end) or was cut short, the next prompt is the last prompt, the answer's ids and the template's text after them,
    and it reads as the whole conversation. An answer that ended on another special token breaks the extension:
    that prompt is the template's rendering, the document's ids unchanged."""
    tokenizer = embedded_tokenizer
    document = Path(triforce_cli.cli.chat.__file__).read_text().strip()
    conversation = ConversationIds(tokenizer, document)
    questions = ["What does this module do?", "Which exit code does /quit give?", "And Ctrl-C?"]
    first = conversation.prompt_ids([], questions[0])
    assert first[: len(conversation.document_prefix_ids)] == conversation.document_prefix_ids
    ended = tokenizer("It runs `triforce chat`.", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    cut = tokenizer(" Zero, as Ctrl", add_special_tokens=False).input_ids
    turns = [answered(questions[0], first, ended, tokenizer)]
    second = conversation.prompt_ids(turns, questions[1])
    turns.append(answered(questions[1], second, cut, tokenizer))
    third = conversation.prompt_ids(turns, questions[2])
    for prompt, turn in ((second, turns[0]), (third, turns[1])):
        read = turn.prompt_ids + turn.result.token_ids
        assert prompt[: len(read)] == read
    messages = [{"role": "user", "content": f"{document}\n\n{questions[0]}"}]
    for turn, question in zip(turns, questions[1:]):
        messages += [{"role": "assistant", "content": turn.result.text}, {"role": "user", "content": question}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(third) == rendered
    other_end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    broken = conversation.prompt_ids([answered(questions[0], first, ended[:-1] + [other_end], tokenizer)], questions[1])
    assert broken[: len(first) + len(ended)] != first + ended[:-1] + [other_end]
    assert DOCUMENT_PLACEHOLDER not in tokenizer.decode(broken)
    assert broken[: len(conversation.document_prefix_ids)] == conversation.document_prefix_ids


@pytest.mark.embedded
def test_a_scripted_chat_on_the_embedded_model_answers_as_the_target_does(tmp_path):
    """Two questions piped to `triforce chat` (triforce mode, the shipped drafter): each answer is printed on stdout
    as the transcript keeps it, and is what greedy autoregressive decoding of the target answers in the same
    conversation."""
    document = tmp_path / "note.txt"
    document.write_text(
        "Meeting note, 12 March. The team agreed to move the release of version 2.4 from April to June, because "
        "the new storage engine needs two more months of testing. Maria leads the testing; Tom writes the "
        "migration guide. The next meeting is on 26 March."
    )
    questions = ["Who writes the migration guide?", "When is the next meeting?"]
    transcript = tmp_path / "transcript.txt"
    script = "".join(f"{line}\n" for line in (*questions, f"/save {transcript}"))
    args = ["chat", "-p", str(document), "--max-new-tokens", "16", "--temperature", "0"]
    result = CliRunner().invoke(app, args, input=script)
    assert result.exit_code == 0, (result.output, result.exception)
    messages = [message.split(": ", 1) for message in transcript.read_text().split("\n\n") if message]
    answers = [text for role, text in messages if role == "assistant"]
    assert [role for role, _ in messages] == ["user", "assistant", "user", "assistant"]
    assert all(answer.strip() for answer in answers)
    assert result.stdout == "".join(f"{answer}\n" for answer in answers)
    config = EngineConfig(mode="autoregressive", max_new_tokens=16, sampling=GREEDY)
    session = ChatSession(Pipeline.load(config=config), document.read_text())
    assert [session.ask(question).text for question in questions] == answers


# ---------------------------------------------------------------------------------------------- a long session
def test_a_system_prompt_opens_every_prompt(pipe):
    session = ChatSession(pipe, DOCUMENT, system="w3 w4")
    tokenizer = pipe.target.tokenizer
    first = session.ask(QUESTIONS[0])
    assert session.turns[0].prompt_ids == conversation_ids(tokenizer, [QUESTIONS[0]], [], system="w3 w4")
    assert first.token_ids == pipe.generate_ids(session.turns[0].prompt_ids).token_ids
    assert session.turns[0].prompt_ids != ChatSession(pipe, DOCUMENT).prompt_ids(QUESTIONS[0])
    session.ask(QUESTIONS[1])
    second = conversation_ids(tokenizer, list(QUESTIONS[:2]), [first.text], system="w3 w4")
    assert session.turns[1].prompt_ids == second


def test_a_template_that_refuses_a_system_prompt_says_so():
    target = chat_model()
    target.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + WORD_CHAT_TEMPLATE
    )
    pipe = Pipeline(target, None, Engine(target, small_config(max_new_tokens=4, sampling=GREEDY)))
    with pytest.raises(PromptError, match="chat template refuses the conversation: System role not supported"):
        ChatSession(pipe, DOCUMENT, system="w3")
    assert ChatSession(pipe, DOCUMENT).ask(QUESTIONS[0]).token_ids  # without one it chats


def test_an_answer_is_capped_to_what_the_context_still_holds(pipe):
    session = ChatSession(pipe, DOCUMENT)
    prompt = session.prompt_ids("w2")
    question = " ".join(["w2"] * (512 - len(prompt) - 4 + 1))  # leaves 4 positions
    result = session.ask(question)
    assert len(session.turns[0].prompt_ids) == 508 and len(result.token_ids) == 4
    assert session.used_tokens == session.context_tokens == 512
    assert pipe.config.max_new_tokens == NEW_TOKENS  # the cap was for that answer only
    with pytest.raises(PromptError, match="no room for an answer"):  # the context is full
        session.ask(QUESTIONS[0])


def test_retry_asks_the_latest_question_again_in_place_of_its_answer(pipe):
    session = ChatSession(pipe, DOCUMENT)
    first = session.ask(QUESTIONS[0])
    second = session.ask(QUESTIONS[1])
    again = session.retry()
    assert again.token_ids == second.token_ids  # greedy: the same answer, after the same prompt
    assert [turn.question for turn in session.turns] == list(QUESTIONS[:2])
    assert session.turns[1].prompt_ids[: len(session.turns[0].prompt_ids)] == session.turns[0].prompt_ids
    assert session.transcript[:2] == [("user", QUESTIONS[0]), ("assistant", first.text)]
    with pytest.raises(PromptError, match="no question"):
        ChatSession(pipe, DOCUMENT).retry()


def test_a_saved_conversation_is_loaded_and_goes_on_as_it_would_have(pipe):
    session = ChatSession(pipe, DOCUMENT)
    for question in QUESTIONS[:2]:
        session.ask(question)
    saved = transcript_text(session.transcript)
    assert transcript_turns(saved) == session.transcript
    third = session.ask(QUESTIONS[2])
    loaded = ChatSession(pipe, DOCUMENT)
    loaded.load(transcript_turns(saved))
    assert loaded.transcript == session.transcript[:4]
    assert loaded.prompt_ids(QUESTIONS[2]) == session.turns[2].prompt_ids
    assert loaded.ask(QUESTIONS[2]).token_ids == third.token_ids
    with pytest.raises(PromptError, match="not a conversation"):
        transcript_turns("hello\n")
    with pytest.raises(PromptError, match="alternates"):
        loaded.load([("assistant", "w1")])


def test_triple_quotes_make_one_question_of_several_lines():
    lines = ["w1", '"""w2', "  w3", '"""', '"""w4"""', "", '"""', "w5"]
    assert list(questions(iter(lines))) == ["w1", "w2\n  w3", "w4", "w5"]


def test_system_retry_load_stats_and_an_escaped_slash_in_the_command(pipe, document, tmp_path):
    saved = tmp_path / "saved.txt"
    session = ChatSession(pipe, DOCUMENT, system="w3 w4")
    expected = [session.ask(question).text for question in QUESTIONS[:2]]
    script = [
        QUESTIONS[0],
        "/retry",
        f"/save {saved}",
        "/reset",
        f"/load {saved}",
        QUESTIONS[1],
        "/stats",
        "//w1",
        '"""w5',
        'w6"""',
    ]
    result = run_chat(document, "--system", "w3 w4", input="\n".join(script) + "\n")
    assert result.exit_code == 0, result.output
    answers = result.stdout.splitlines()
    assert answers[:3] == [expected[0], expected[0], expected[1]]  # the question, retried, then after /load
    assert len(answers) == 5 and not error_lines(result)  # "//w1" and the block were asked too
    stats = flat(result.stderr)
    assert "loaded 1 questions and answers" in stats
    used = len(session.turns[1].prompt_ids) + len(session.turns[1].result.token_ids)
    assert f"context: {used} of 512 tokens used" in stats
    slash = session.ask("/w1")  # "//w1" asks "/w1": the word tokenizer reads "/" as a word of its own
    assert answers[3] == slash.text
