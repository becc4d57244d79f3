"""`triforce bench --scenario qa`: one document, several questions asked in turn as one chat, and the seconds to each
answer: until its first token (what it had to prefill counted) and until its last.

Every mode and peer holds one conversation per run, with its own answers in it, rendered by the target's chat
template (decoding/chat.py ConversationIds), and reuses what it computed for the turn before as its users would:
our modes through prefix reuse in the engine (a ChatSession: the document prefilled once, then each question);
llama.cpp through llama-cpp-python, which keeps what its context evaluated last and computes only the prompt's
positions after the prefix they share; transformers through a DynamicCache passed back to generate, cut to the prefix the next prompt shares. The first answer's times include the document's prefill.
Repeats run every mode's whole conversation in turn, so drift of a noisy machine touches them alike.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from transformers import DynamicCache

from triforce_cli.bench.llama_cpp import LLAMA_CPP_PEER
from triforce_cli.bench.peers import hf_generate
from triforce_cli.bench.runner import OUR_MODES, Bench
from triforce_cli.decoding.chat import ChatSession, ChatTurn, ConversationIds, shared_length
from triforce_cli.decoding.stats import GenerationResult, GenerationStats
from triforce_cli.errors import ConfigError

QA_PEERS = ("hf", LLAMA_CPP_PEER)  # the peers that reuse a conversation's keys and values


@dataclass(frozen=True)
class Answer:
    """One question's answer in one run of a conversation."""

    token_ids: list[int]
    prompt_tokens: int  # the conversation's prompt it was generated after
    reused_tokens: int  # of those, the positions kept from the turn before (0 for the first question)
    first_token_seconds: float  # from the question to its first token; the first includes the document's prefill
    answer_seconds: float  # from the question to its last token


@dataclass
class QARow:
    """One mode's answers to one question over the repeats; times are medians with their range."""

    document: str
    mode: str
    context: int  # the first prompt's tokens: the document as cut, the template and the first question
    question: int  # 1 for the first question
    prompt_tokens: int
    reused_tokens: int
    new_tokens: list[int]
    first_token_seconds: list[float]
    answer_seconds: list[float]
    # the median first-token time over the first answer's (question 2 on): how much of a first prefill it costs
    start_vs_first_answer: float | None = None
    answer_vs_llama_cpp: float | None = None  # median answer time over llama.cpp's for the same question
    matches_autoregressive: bool | None = None  # greedy: the same tokens as our autoregressive mode's answer
    token_ids: list[int] = field(default_factory=list, repr=False)  # the last repeat's answer

    @property
    def median_first_token_seconds(self) -> float:
        return statistics.median(self.first_token_seconds)

    @property
    def median_answer_seconds(self) -> float:
        return statistics.median(self.answer_seconds)


def qa_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    """The modes a QA bench runs: ours and the peers that keep a conversation; a ConfigError names any other."""
    others = [m for m in modes if m not in OUR_MODES and m not in QA_PEERS]
    if others:
        raise ConfigError(
            f"the qa scenario runs our modes and the peers {', '.join(QA_PEERS)}, not {', '.join(others)}"
        )
    return modes


class QABench:
    """The QA scenario over a Bench's pipeline, settings and peers (runner.Bench)."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.config = bench.config
        qa_modes(self.config.modes)

    def run_document(
        self,
        name: str,
        document: str,
        questions: tuple[str, ...],
        on_run: Callable[[str, int], None] | None = None,
    ) -> list[QARow]:
        """Every mode's conversation about document, the questions asked in turn, repeated; the rows per mode and
        question. A PromptError where the target has no chat template or a prompt does not fit its context."""
        answers: dict[str, list[list[Answer]]] = {mode: [] for mode in self.config.modes}
        for repeat in range(-self.config.warmup, self.config.repeats):
            for mode in self.config.modes:
                if on_run is not None:
                    on_run(mode, repeat)
                run = self._converse(mode, document, questions)
                if repeat >= 0:
                    answers[mode].append(run)
        context = answers[self.config.modes[0]][0][0].prompt_tokens  # the first prompt, the same for every mode
        return _rows(name, context, answers, self.config.sampling.greedy)

    def _converse(self, mode: str, document: str, questions: tuple[str, ...]) -> list[Answer]:
        if mode == LLAMA_CPP_PEER:
            return self._llama_cpp(document, questions)
        if mode == "hf":
            return self._hf(document, questions)
        return self._ours(mode, document, questions)

    def _ours(self, mode: str, document: str, questions: tuple[str, ...]) -> list[Answer]:
        pipe = self.bench.pipe
        engine = self.bench.engine_for(mode, cache_positions=pipe.context_tokens)
        session = ChatSession(replace(pipe, engine=engine, status=None), document)
        started = time.perf_counter()
        session.prefill()
        document_seconds = time.perf_counter() - started
        answers = []
        for number, question in enumerate(questions):
            started = time.perf_counter()
            result = session.ask(question)
            seconds = time.perf_counter() - started - result.stats.compile_seconds
            before = document_seconds if number == 0 else 0.0
            prompt_tokens = result.stats.prompt_tokens
            reused = 0 if number == 0 else result.stats.reused_tokens
            first = before + result.stats.prefill_seconds
            answers.append(Answer(result.token_ids, prompt_tokens, reused, first, before + seconds))
        return answers

    def _llama_cpp(self, document: str, questions: tuple[str, ...]) -> list[Answer]:
        peer = self.bench.llama_cpp
        peer.forget()
        eos_ids = set() if self.config.ignore_eos else self.bench.pipe.target.eos_token_ids
        return self._peer_conversation(
            document, questions, lambda ids: peer.answer(ids, self.config.max_new_tokens, self.config.sampling, eos_ids)
        )

    def _hf(self, document: str, questions: tuple[str, ...]) -> list[Answer]:
        model = self.bench.hf_model("target")
        cache = DynamicCache()
        held: list[int] = []  # the ids whose keys and values cache holds

        def answer(prompt_ids: list[int]):
            nonlocal held
            kept = min(shared_length(held, prompt_ids), len(prompt_ids) - 1)
            cache.crop(kept - cache.get_seq_length())  # a count to remove (negative), in transformers 5
            run = hf_generate(
                model,
                prompt_ids,
                self.config.max_new_tokens,
                self.config.sampling,
                ignore_eos=self.config.ignore_eos,
                cache=cache,
            )
            held = (prompt_ids + run.token_ids)[: cache.get_seq_length()]
            return run, kept

        return self._peer_conversation(document, questions, answer)

    def _peer_conversation(self, document: str, questions: tuple[str, ...], answer) -> list[Answer]:
        """A peer's conversation: each prompt built from the peer's own answers, as a ChatSession builds ours.
        answer(prompt_ids) -> (TimedRun, positions it kept)."""
        target = self.bench.pipe.target
        conversation = ConversationIds(target.tokenizer, document)
        turns: list[ChatTurn] = []
        answers = []
        for number, question in enumerate(questions):
            prompt_ids = conversation.prompt_ids(turns, question)
            run, kept = answer(prompt_ids)
            answers.append(
                Answer(
                    run.token_ids, len(prompt_ids), 0 if number == 0 else kept, run.prefill_seconds, run.answer_seconds
                )
            )
            text = target.tokenizer.decode(run.token_ids, skip_special_tokens=True)
            result = GenerationResult(run.token_ids, text, GenerationStats("peer", None, len(prompt_ids)))
            if run.token_ids:
                turns.append(ChatTurn(question, prompt_ids, result, kept))
        return answers


def _rows(document: str, context: int, answers: dict[str, list[list[Answer]]], greedy: bool) -> list[QARow]:
    rows = []
    for mode, runs in answers.items():
        for number in range(len(runs[0])):
            each = [run[number] for run in runs]
            rows.append(
                QARow(
                    document,
                    mode,
                    context,
                    number + 1,
                    each[-1].prompt_tokens,
                    each[-1].reused_tokens,
                    [len(a.token_ids) for a in each],
                    [a.first_token_seconds for a in each],
                    [a.answer_seconds for a in each],
                    token_ids=each[-1].token_ids,
                )
            )
    first = {r.mode: r for r in rows if r.question == 1}
    llama_cpp = {r.question: r for r in rows if r.mode == LLAMA_CPP_PEER}
    reference = {r.question: r.token_ids for r in rows if r.mode == "autoregressive"}
    for row in rows:
        if row.question > 1:
            row.start_vs_first_answer = row.median_first_token_seconds / first[row.mode].median_first_token_seconds
        if row.question in llama_cpp:
            row.answer_vs_llama_cpp = row.median_answer_seconds / llama_cpp[row.question].median_answer_seconds
        if greedy and row.question in reference:
            row.matches_autoregressive = row.token_ids == reference[row.question]
    return rows
