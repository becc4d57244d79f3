"""`triforce bench --scenario qa`: one document, questions asked in turn; every mode and peer keeps its conversation's
keys and values between questions, the rows say what each prompt reused and how long each answer took, greedy
answers equal our autoregressive mode's; llama.cpp's wiring with a stand-in module; one-line errors."""

import io
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

import triforce_cli.bench.llama_cpp
from triforce_cli.bench.llama_cpp import LlamaCppPeer
from triforce_cli.bench.qa import QABench
from triforce_cli.bench.runner import Bench, BenchConfig
from triforce_cli.cli.app import app
from triforce_cli.cli.render import qa_tables
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions

DOCUMENT = " ".join(f"w{i * 7 % 19}" for i in range(52))
QUESTIONS = ("w1 w2", "w3 w4 w5", "w6")
NEW_TOKENS = 6
CHUNK = 16  # prefill chunk: the document is three of them and a bit


@pytest.fixture(scope="module")
def rows(chat_checkpoint):
    config = EngineConfig(gamma1=2, gamma2=4, max_new_tokens=NEW_TOKENS, prefill_block=CHUNK)
    pipe = Pipeline.load(LoadOptions(target=str(chat_checkpoint), dtype="float32", device="cpu"), config=config)
    bench = Bench(
        pipe,
        BenchConfig(
            modes=("autoregressive", "triforce", "hf"),
            repeats=2,
            warmup=0,
            max_new_tokens=NEW_TOKENS,
            budgets=(16,),
            chunk_sizes=(4,),
            sampling=SamplingConfig(temperature=0),
            ignore_eos=True,
        ),
    )
    return QABench(bench).run_document("doc", DOCUMENT, QUESTIONS)


def test_every_mode_answers_every_question_in_turn_as_autoregressive_does(rows):
    assert [(r.mode, r.question) for r in rows] == [
        (mode, question) for mode in ("autoregressive", "triforce", "hf") for question in (1, 2, 3)
    ]
    assert all(r.matches_autoregressive for r in rows)
    assert all(r.new_tokens == [NEW_TOKENS, NEW_TOKENS] and len(r.answer_seconds) == 2 for r in rows)
    prompts = {r.question: r.prompt_tokens for r in rows if r.mode == "autoregressive"}
    assert all(r.prompt_tokens == prompts[r.question] for r in rows)  # the same answers, so the same conversation
    assert prompts[1] < prompts[2] < prompts[3]


def test_later_questions_reuse_what_the_turn_before_computed(rows):
    for row in rows:
        if row.question == 1:
            assert row.reused_tokens == 0 and row.start_vs_first_answer is None
        else:  # what it holds that the prompt shares, our modes as hf: this template closes a turn without the
            # generation prompt (w22) the answer followed, so the prompt before it, short of that
            before = next(r for r in rows if (r.mode, r.question) == (row.mode, row.question - 1))
            assert row.reused_tokens == before.prompt_tokens - 1
        if row.question > 1:
            assert row.start_vs_first_answer == pytest.approx(
                row.median_first_token_seconds
                / next(r.median_first_token_seconds for r in rows if (r.mode, r.question) == (row.mode, 1))
            )
        assert 0 < row.median_first_token_seconds <= row.median_answer_seconds


class ConversationLlama:
    """Stands in for llama_cpp.Llama as llama-cpp-python keeps a conversation: it remembers the ids it evaluated and
    evaluates only the prompt after the prefix they share; the answer is the next ids counting up."""

    instances: ClassVar[list["ConversationLlama"]] = []

    def __init__(self, **kwargs):
        self.input_ids = np.zeros(kwargs["n_ctx"], dtype=np.intc)
        self.n_tokens = 0
        self.evaluated: list[int] = []  # prompt positions evaluated by each call
        ConversationLlama.instances.append(self)

    def reset(self):
        self.n_tokens = 0

    def set_seed(self, seed):
        pass

    def generate(self, tokens, **kwargs):
        held = self.input_ids[: self.n_tokens].tolist()
        shared = next((i for i, (a, b) in enumerate(zip(held, tokens[:-1])) if a != b), min(len(held), len(tokens) - 1))
        self.evaluated.append(len(tokens) - shared)
        ids = list(tokens)
        while True:
            self.input_ids[: len(ids)] = ids
            self.n_tokens = len(ids)
            ids.append(ids[-1] % 20 + 1)
            yield ids[-1]


def test_the_llama_cpp_peer_reports_the_prefix_its_context_kept(monkeypatch, chat_checkpoint):
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(Llama=ConversationLlama))
    monkeypatch.setattr(triforce_cli.bench.llama_cpp, "llama_cpp_available", lambda: True)
    config = SimpleNamespace(max_position_embeddings=128)
    peer = LlamaCppPeer(Path("model.gguf"), config, threads=2)
    llm = ConversationLlama.instances[-1]
    greedy = SamplingConfig(temperature=0)
    first, kept = peer.answer([1, 2, 3, 4], 3, greedy, eos_ids=set())
    assert first.token_ids == [5, 6, 7] and kept == 0
    _, kept = peer.answer([1, 2, 3, 4, 5, 6, 7, 9, 9], 2, greedy, eos_ids=set())
    assert kept == 6 and llm.evaluated == [4, 3]  # 1-4 and the first two answer ids were evaluated already
    peer.forget()
    assert peer.answer([1, 2, 3], 1, greedy, eos_ids=set())[1] == 0


def invoke_bench(*args):
    return CliRunner().invoke(app, ["bench", "--scenario", "qa", *map(str, args)])


def test_the_command_prints_each_answer_and_writes_json(chat_checkpoint, tmp_path):
    document, questions = tmp_path / "doc.txt", tmp_path / "questions.txt"
    document.write_text(DOCUMENT)
    questions.write_text("\n".join(QUESTIONS) + "\n\n")
    result = invoke_bench(
        *("--target", chat_checkpoint, "-p", document, "--questions", questions, "--context", 40),
        *("--modes", "autoregressive,triforce", "--budget", 16, "--chunk-size", 4, "--max-new-tokens", 4),
        *("--repeats", 1, "--warmup", 0, "--out", tmp_path / "qa.json"),
    )
    assert result.exit_code == 0, result.output
    assert "doc.txt, 40 tokens, questions in turn" in result.stdout
    payload = json.loads((tmp_path / "qa.json").read_text())
    assert [(r["mode"], r["question"]) for r in payload["rows"]] == [
        (mode, q) for mode in ("autoregressive", "triforce") for q in (1, 2, 3)
    ]
    assert payload["rows"][0]["context"] == 40 and "processor" in payload["machine"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--modes", "hf-lookup"), "the qa scenario runs our modes and the peers hf, llama.cpp, not hf-lookup"),
        (("--out", "rows.csv"), "the qa scenario writes its results as .json"),
        (("--questions", "EMPTY"), "holds no question"),
        (("--questions", "MISSING"), "cannot be read: No such file or directory"),
    ],
)
def test_bad_input_is_one_line(chat_checkpoint, tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    files = {"EMPTY": str(empty), "MISSING": str(tmp_path / "missing.txt")}
    args = tuple(files.get(a, a) for a in args)
    result = invoke_bench("--target", chat_checkpoint, "--context", 40, *args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert message in result.output


def test_the_table_fits_80_columns_without_cutting_a_cell(rows):
    console = Console(width=80, record=True, file=io.StringIO())
    with_llama_cpp = [replace(row, answer_vs_llama_cpp=0.25) for row in rows]
    for table in qa_tables(rows) + qa_tables(with_llama_cpp):
        console.print(table)
    text = console.export_text()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    assert "autoregressive" in text and "triforce" in text
