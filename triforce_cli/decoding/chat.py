"""A chat about one long document: questions asked one after another, each answered by the pipeline after the
whole conversation so far, as the target's chat template renders it.

    session = ChatSession(pipe, Path("report.txt").read_text())
    session.prefill()                     # the document read once, before the first question
    print(session.ask("Who wrote it?").text)
    print(session.ask("When?").text)      # after the first question and its answer
    session.reset()                       # the document alone again

Token ids. The first user turn holds the document, a blank line and the first question; each later question adds
the answer before it and a user turn of its own. Turns are rendered with a placeholder for the document
(runtime/prompts.py around_document): the template's text before the document and the text after it are tokenized
apart from it, so the document's ids are the same in every prompt and the template never runs over it. A prompt
extends the one before it: turn k+1's ids are turn k's prompt ids, the ids of its answer as they were generated,
then the tokenized text the template puts between that answer and the end of the next question. Exact prefix reuse
in the engine then has only that last text to prefill, and the answer's last token, whose keys no forward wrote.

Where a template breaks the extension: it rewrites earlier turns (drops the reasoning of earlier answers, as Qwen3's
does, or moves the system prompt into the latest user turn, as Mistral's does); its prompt for the answer is not the
start it gives an answered assistant turn; it trims an answer that starts or ends with whitespace (Llama 3's
``| trim``); or the answer ended on an end-of-sequence token other than the one the template closes a turn with.
That turn's prompt is then the template's whole rendering tokenized around the document: the document's ids stay the
same, behind the template's text before it, but the earlier turns are tokenized anew and their ids need not be
those generated. Reuse goes by ids (the common prefix of the prompt and the ids the engine holds), so such a turn
still keeps the document and whatever comes after it unchanged.
"""

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from safetensors import SafetensorError
from transformers import PreTrainedTokenizerBase

from triforce_cli.decoding.pipeline import Pipeline, prefill_or_restore
from triforce_cli.decoding.prefill import PrefillCallback
from triforce_cli.decoding.prompt_state import PromptCache, StaleEntry
from triforce_cli.decoding.rounds import TokenCallback
from triforce_cli.decoding.stats import GenerationResult, GenerationStats
from triforce_cli.errors import PromptError, TriforceError
from triforce_cli.runtime.prompts import DOCUMENT_PLACEHOLDER, around_document, document_question

SYSTEM = "system"
USER = "user"
ASSISTANT = "assistant"


@dataclass(frozen=True)
class ChatTurn:
    """One question of a session and its answer.

    question: as asked, without the document. prompt_ids: the whole conversation's token ids the answer was
    generated after. result: the answer. carried_tokens: how many leading ids of prompt_ids the engine had read
    just before (the previous prompt and its answer, or the prefilled document): the part exact prefix reuse need
    not prefill again.
    """

    question: str
    prompt_ids: list[int]
    result: GenerationResult
    carried_tokens: int


class ConversationIds:
    """The token ids of a conversation about one document, by the tokenizer's chat template (module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, document: str, system: str | None = None):
        """The document's token ids, and those of the template's text before it.

        Args:
            tokenizer: the target's; a PromptError where it has no chat template.
            document: the text every conversation is about.
            system: a system prompt opening every conversation, or None.
        """
        self.tokenizer, self.system = tokenizer, system
        opening = self._system_messages() + [{"role": USER, "content": DOCUMENT_PLACEHOLDER}]
        before, _ = around_document(tokenizer, opening)
        self.document_ids = self._ids(document)
        self.document_prefix_ids = self._ids(before) + self.document_ids  # what a session prefills at its start

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _system_messages(self) -> list[dict[str, str]]:
        return [] if self.system is None else [{"role": SYSTEM, "content": self.system}]

    def messages(self, turns: list[ChatTurn], question: str) -> list[dict[str, str]]:
        """The chat messages of turns and then question (after the system prompt, where there is one), the
        document's placeholder before the first question."""
        questions = [turn.question for turn in turns] + [question]
        messages = self._system_messages() + [document_question(questions[0])]
        for turn, asked in zip(turns, questions[1:]):
            messages += [{"role": ASSISTANT, "content": turn.result.text}, {"role": USER, "content": asked}]
        return messages

    def _rendered(self, turns: list[ChatTurn], question: str) -> tuple[str, str]:
        """The text before the document and the text after it of the conversation's rendering."""
        return around_document(self.tokenizer, self.messages(turns, question))

    def prompt_ids(self, turns: list[ChatTurn], question: str) -> list[int]:
        """Token ids of the conversation of turns then question, with the prompt for the answer: the last turn's
        prompt and answer ids and the template's text after them, where the template renders the earlier turns
        unchanged; else the whole rendering tokenized around the document.

        Args:
            turns: the questions answered so far, oldest first, each with at least one answer token.
            question: the next question.
        Returns:
            The prompt's token ids; a PromptError where the template changes a message so that it cannot be cut
            around the document.
        """
        before, after = self._rendered(turns, question)
        if turns:
            last = turns[-1]
            answered = DOCUMENT_PLACEHOLDER.join(self._rendered(turns[:-1], last.question))
            answered += self.tokenizer.decode(last.result.token_ids, skip_special_tokens=False)
            rendered = DOCUMENT_PLACEHOLDER.join((before, after))
            if rendered.startswith(answered):
                return last.prompt_ids + last.result.token_ids + self._ids(rendered[len(answered) :])
        return self._ids(before) + self.document_ids + self._ids(after)


def shared_length(first: list[int], second: list[int]) -> int:
    """How many leading ids the two lists share."""
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


class ChatSession:
    """A conversation about one document with a loaded pipeline (module docstring).

    Attributes:
        pipeline: generates every answer, with its settings at the time (mode, sampling, max_new_tokens).
        conversation: the token ids of the conversation's prompts.
        turns: the questions answered so far, oldest first; a question interrupted before its first answer token
            is left out.
        last_turn: the latest question asked and its generation, answered or not; None before the first.
    """

    def __init__(self, pipeline: Pipeline, document: str, system: str | None = None):
        """A session about document, nothing prefilled yet; the document is checked to fit with room for an answer.

        Args:
            pipeline: the loaded models.
            document: what the conversation is about (surrounding whitespace dropped). A PromptError where it is
                empty, where the target's tokenizer has no chat template, or where the document leaves no room in
                the context for an answer.
            system: a system prompt opening the conversation, or None (a template that takes no system turn
                refuses it: a PromptError with its message).

        Unless the pipeline's config sizes the caches already (EngineConfig.cache_positions), they are sized for the
        target's whole context (Pipeline.size_for_whole_context): each next question reuses the conversation's keys
        and values, which a full cache grown for a longer prompt would lose.
        """
        document = document.strip()
        if not document:
            raise PromptError("the document is empty")
        self.pipeline = pipeline
        self.conversation = ConversationIds(pipeline.target.tokenizer, document, system)
        pipeline.engine.check_prompt(self.conversation.document_prefix_ids)
        pipeline.size_for_whole_context()
        self.turns: list[ChatTurn] = []
        self.last_turn: ChatTurn | None = None
        self._read_ids: list[int] = []  # what the engine read last: the prefilled document, or a prompt and answer

    @property
    def last_result(self) -> GenerationResult | None:
        """The latest question's generation (None before the first)."""
        return None if self.last_turn is None else self.last_turn.result

    @property
    def transcript(self) -> list[tuple[str, str]]:
        """(role, text) of every question and answer so far, oldest first; the document is not repeated."""
        return [message for turn in self.turns for message in ((USER, turn.question), (ASSISTANT, turn.result.text))]

    def prefill(self, on_prefill: PrefillCallback | None = None, prompt_cache: Path | None = None) -> bool:
        """Read the template's text before the document and the document into the target's full cache now, once,
        so that the first question's prompt extends what the engine holds and prefills only its own tokens
        (prefix reuse keeps the document, Engine.generate).

        Args:
            on_prefill: receives (model name, tokens done, tokens total) as the prefill goes on.
            prompt_cache: a folder of saved prefills (decoding/prompt_state.py): the document's is restored from
                it where saved there, else prefilled and saved.
        Returns:
            Whether the document came from prompt_cache.
        """
        ids = self.conversation.document_prefix_ids
        cache = None if prompt_cache is None else self.pipeline.prompt_cache(prompt_cache)
        _, restored = prefill_or_restore(self.pipeline.engine, ids, cache, on_prefill)
        self._read_ids = ids
        return restored

    def prompt_ids(self, question: str) -> list[int]:
        """The token ids the next ask(question) generates after: the whole conversation and the question."""
        return self.conversation.prompt_ids(self.turns, question.strip())

    def ask(
        self,
        question: str,
        on_tokens: TokenCallback | None = None,
        on_prefill: PrefillCallback | None = None,
    ) -> GenerationResult:
        """Answer question after the conversation so far, which it then joins with what was generated (also when
        Ctrl-C stopped the answer, as long as it has a token).

        Args:
            question: the next question (surrounding whitespace dropped).
            on_tokens: receives each step's new token ids and the tier that sampled each.
            on_prefill: receives (model name, tokens done, tokens total) while the prompt is prefilled.
        Returns:
            The answer's generation, at most max_new_tokens long or what the context still holds, whichever is
            fewer. A PromptError, the conversation left as it was, where the question is empty, the chat template
            refuses the conversation, or the conversation with it leaves no room for an answer.
        """
        question = question.strip()
        if not question:
            raise PromptError("the question is empty")
        try:
            question.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8, read as lone surrogates
            raise PromptError("the question is not UTF-8 text") from None
        prompt_ids = self.conversation.prompt_ids(self.turns, question)
        room = self.context_tokens - len(prompt_ids)
        if room < 1:
            raise PromptError(
                f"the conversation with this question holds {len(prompt_ids)} tokens; the {self.context_tokens}-token"
                " context leaves no room for an answer: /reset starts again from the document"
            )
        wanted = self.pipeline.config.max_new_tokens
        if room < wanted:
            self.pipeline.reconfigure(max_new_tokens=room)
        try:
            result = self.pipeline.generate_ids(prompt_ids, on_prefill, on_tokens)
        finally:
            if room < wanted:
                self.pipeline.reconfigure(max_new_tokens=wanted)
        self.last_turn = ChatTurn(question, prompt_ids, result, shared_length(prompt_ids, self._read_ids))
        self._read_ids = prompt_ids + result.token_ids
        if result.token_ids:
            self.turns.append(self.last_turn)
        return result

    @property
    def context_tokens(self) -> int:
        """The target's context: the most tokens a conversation and its next answer may hold."""
        return self.pipeline.context_tokens

    @property
    def used_tokens(self) -> int:
        """Tokens the conversation holds now: the last prompt and its answer, or the document alone."""
        if not self.turns:
            return len(self.conversation.document_prefix_ids)
        last = self.turns[-1]
        return len(last.prompt_ids) + len(last.result.token_ids)

    def retry(
        self,
        on_tokens: TokenCallback | None = None,
        on_prefill: PrefillCallback | None = None,
    ) -> GenerationResult:
        """Ask the latest question again, its answer (if it had one) dropped from the conversation first; a
        PromptError before any question."""
        if self.last_turn is None:
            raise PromptError("no question to ask again yet")
        if self.turns and self.turns[-1] is self.last_turn:
            self.turns.pop()
        return self.ask(self.last_turn.question, on_tokens, on_prefill)

    def load(self, transcript: list[tuple[str, str]]) -> None:
        """Take up a saved conversation: transcript's questions and answers (transcript_turns) become the turns, in
        place of those so far, as if they had been asked here. The answers' token ids are their text tokenized
        again, and nothing is prefilled: the next question's prompt reads what the engine does not hold yet (the
        document's prefill stays where it is held).

        Args:
            transcript: (role, text) pairs, user and assistant alternating, a user first; a PromptError otherwise.
        """
        roles = [role for role, _ in transcript]
        if not transcript or roles != [USER, ASSISTANT] * (len(transcript) // 2):
            raise PromptError("a saved conversation alternates user and assistant messages, a user's first")
        turns: list[ChatTurn] = []
        tokenizer = self.pipeline.target.tokenizer
        for (_, question), (_, answer) in zip(transcript[::2], transcript[1::2]):
            prompt_ids = self.conversation.prompt_ids(turns, question)
            answer_ids = tokenizer(answer, add_special_tokens=False).input_ids
            if not answer_ids:
                raise PromptError("a saved conversation holds an empty answer")
            stats = GenerationStats("loaded", None, len(prompt_ids), new_tokens=len(answer_ids))
            turns.append(ChatTurn(question, prompt_ids, GenerationResult(answer_ids, answer, stats), 0))
        if len(turns[-1].prompt_ids) + len(turns[-1].result.token_ids) >= self.context_tokens:
            raise PromptError(f"the saved conversation does not fit the {self.context_tokens}-token context")
        self.turns, self.last_turn = turns, None

    def _state_file(self, path: Path) -> PromptCache:
        """The prompt cache whose key (model, dtype, weights, rotary, attention, prefill chunk and ids) a saved
        conversation state is written and checked with; path's folder is only read or written there."""
        engine = self.pipeline.engine
        return PromptCache(
            path.parent, self.pipeline.target, None, engine.prefill_block, self.pipeline.config.max_new_tokens
        )

    def save_state(self, path: Path) -> bool:
        """Write what the engine holds of the conversation (Engine.held_state: its prompts and answers, as far as
        a later prompt may keep them) to path (safetensors), with the last turn's prompt length, question and
        answer ids, so that load_state takes the conversation up without reading it again.

        Returns:
            Whether it was written: not before an answer, nor where the engine holds another prompt than the last
            turn's (a question stopped before its first token). An OSError where path cannot be written.
        """
        last = self.turns[-1] if self.turns else None
        if last is None or self._read_ids != last.prompt_ids + last.result.token_ids:
            return False
        state = self.pipeline.engine.held_state()
        held = [] if state is None else state.prompt_ids.tolist()
        if len(held) < len(last.prompt_ids) or held != self._read_ids[: len(held)]:
            return False
        turn = {"prompt_tokens": len(last.prompt_ids), "question": last.question, "answer_ids": last.result.token_ids}
        try:
            self._state_file(path).write_file(path, state, {"turn": json.dumps(turn)})
        except SafetensorError as error:
            raise OSError(str(error)) from None
        return True

    def load_state(self, path: Path) -> str | None:
        """Put the state save_state wrote to path back in the engine, for the conversation load took up from its
        transcript: the last turn then has the token ids it was generated with, and the next question prefills only
        what follows what the state holds.

        Returns:
            None where it was restored; else why not (another model or setting, a state of another conversation, a
            file that cannot be read), the conversation then read again from its text by the next question.
        """
        try:
            state, metadata = self._state_file(path).read_file(path)
            turn = json.loads(metadata.get("turn", ""))
            prompt_tokens, question, answer_ids = turn["prompt_tokens"], turn["question"], turn["answer_ids"]
        except StaleEntry as reason:
            return f"{path} {reason}"
        except (ValueError, KeyError, TypeError):
            return f"{path} does not hold a conversation's state"
        held, last = state.prompt_ids.tolist(), self.turns[-1] if self.turns else None
        text = self.pipeline.target.tokenizer.decode(answer_ids, skip_special_tokens=True)
        document = self.conversation.document_prefix_ids
        if last is None or (question, text) != (last.question, last.result.text) or held[: len(document)] != document:
            return f"{path} holds the state of another conversation"
        if not prompt_tokens <= len(held) <= prompt_tokens + len(answer_ids):
            return f"{path} does not hold a conversation's state"
        try:
            self.pipeline.engine.restore(state)
        except (TriforceError, ValueError) as error:
            return f"{path} cannot be restored: {error}"
        result = replace(last.result, token_ids=list(answer_ids))
        self.turns[-1] = replace(last, prompt_ids=held[:prompt_tokens], result=result, carried_tokens=0)
        self._read_ids = held
        return None

    def reset(self) -> None:
        """Back to the document alone: the next question is the first turn again. Nothing is prefilled: the
        document's ids begin the next prompt as they began every prompt before."""
        self.turns.clear()


def state_path(transcript: Path) -> Path:
    """Where /save writes a conversation's state beside its transcript: FILE.kv.safetensors."""
    return transcript.with_name(f"{transcript.name}.kv.safetensors")


def transcript_text(transcript: list[tuple[str, str]]) -> str:
    """The transcript as text: each message as 'role: text', a blank line between messages."""
    return "".join(f"{role}: {text}\n\n" for role, text in transcript)


MESSAGE_START = re.compile(rf"(?:\A|\n\n)({USER}|{ASSISTANT}): ")


def transcript_turns(text: str) -> list[tuple[str, str]]:
    """The (role, text) messages of a transcript_text: a message begins with 'user: ' or 'assistant: ' at the
    start or after a blank line (so a message holding a blank line followed by such a word is read as two)."""
    pieces = MESSAGE_START.split(text)  # [before, role, text, role, text, ...]
    if pieces[0].strip() or len(pieces) < 3:
        raise PromptError("not a conversation written by /save: messages start with 'user: ' or 'assistant: '")
    messages = list(zip(pieces[1::2], pieces[2::2]))
    role, last = messages[-1]
    messages[-1] = (role, last.removesuffix("\n\n"))
    return messages
