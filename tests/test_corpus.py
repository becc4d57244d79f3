"""Built-in text: the benchmark prompts stay held out from every training document, the source documents are
source code, and the bench's chat prompts ask about what their cut documents hold."""

import fnmatch
import heapq
import importlib
import inspect
from pathlib import Path

import pytest

from triforce_cli.corpus import (
    BENCH_DEFAULT,
    BENCH_PROMPTS,
    DOCUMENTS,
    builtin_document,
    library_source_files,
    shared_texts,
)

BENCHMARK_MODULES = (*DOCUMENTS["stdlib-a"], *DOCUMENTS["stdlib-b"])
TRAINING_TEXTS = ("stdlib-train", "stdlib-train-source", "stdlib-source", "python-reference")


@pytest.fixture(scope="module")
def benchmark_lines() -> list[str]:
    """The benchmark prompts' docstring and code lines of 50 characters or more (short ones recur by chance)."""
    lines = []
    for text in map(builtin_document, ("stdlib-a", "stdlib-b", "stdlib-b-source")):
        lines += [line.strip() for line in text.splitlines() if len(line.strip()) >= 50]
    return lines


def test_benchmark_prompts_share_no_module_with_the_training_documents():
    assert not set(BENCHMARK_MODULES) & set(DOCUMENTS["stdlib-train"])


@pytest.mark.parametrize("name", TRAINING_TEXTS)
def test_training_text_holds_almost_none_of_the_benchmark_text(name, benchmark_lines):
    lines = {line.strip() for line in builtin_document(name).splitlines()}
    shared = sum(line in lines for line in benchmark_lines)
    assert shared < 0.01 * len(benchmark_lines), f"{shared} of {len(benchmark_lines)} benchmark lines in {name}"


def test_source_documents_are_code_of_modules_outside_the_benchmark():
    train_source = builtin_document("stdlib-train-source")
    assert inspect.getsource(fnmatch) in train_source and "def fnmatch(name, pat):" in train_source
    files = library_source_files()
    names = {file.name for file in files}
    assert {"fnmatch.py", "ast.py", "_pyio.py"} <= names  # a training module's file and one of no document
    for module in BENCHMARK_MODULES:
        path = getattr(importlib.import_module(module), "__file__", None)
        left_out = str(Path(path).resolve()).removesuffix("__init__.py") if path else None
        assert left_out is None or all(not str(file.resolve()).startswith(left_out) for file in files)
    assert not any("test" in file.parts or "distutils" in file.parts for file in files)


def test_the_code_prompt_continues_the_source_of_the_stdlib_b_modules():
    assert BENCH_PROMPTS["code-stdlib-b"].document == "stdlib-b-source"
    assert BENCH_PROMPTS["code-stdlib-b"].request is None
    source = builtin_document("stdlib-b-source")
    assert "heapq" in DOCUMENTS["stdlib-b"] and inspect.getsource(heapq) in source
    assert "def heappush(heap, item):" in source and inspect.getsource(fnmatch) not in source  # a training module


def test_shared_texts_are_the_text_itself_what_it_holds_and_what_holds_it():
    assert shared_texts("stdlib-train") == {"stdlib-train", "stdlib-train-source", "stdlib-source"}
    assert shared_texts("stdlib-source") == {"stdlib-source", "stdlib-train", "stdlib-train-source"}
    assert shared_texts("stdlib-a") == {"stdlib-a"}
    assert shared_texts("stdlib-b") == {"stdlib-b", "stdlib-b-source"}  # the library's source leaves both out


@pytest.mark.parametrize("name", BENCH_DEFAULT)
def test_the_default_bench_prompts_share_no_text_with_training_text(name):
    assert not shared_texts(BENCH_PROMPTS[name].document) & set(TRAINING_TEXTS)


def test_chat_prompts_ask_about_the_start_of_their_document():
    """The bench cuts a document to the context length, so a request must concern what its first tokens hold."""
    asked = {name: prompt for name, prompt in BENCH_PROMPTS.items() if prompt.request is not None}
    assert set(asked) == {"qa-stdlib-b", "summary-stdlib-a"}
    question = asked["qa-stdlib-b"].request
    assert "dates" in question and "datetime" in question and "example" in question
    start = builtin_document("stdlib-b")[:2000]  # a few hundred tokens
    assert "## datetime.date\n" in start and "## datetime.timedelta\n" in start
    assert "Summarise the documentation above" in asked["summary-stdlib-a"].request
