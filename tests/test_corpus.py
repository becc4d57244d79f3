"""Built-in text: the benchmark prompts stay held out from every training document, and the source documents
are source code."""

import fnmatch
import importlib
import inspect
from pathlib import Path

import pytest

from triforce_cli.corpus import DOCUMENTS, builtin_document, library_source_files, shared_texts

BENCHMARK_MODULES = (*DOCUMENTS["stdlib-a"], *DOCUMENTS["stdlib-b"])


@pytest.fixture(scope="module")
def benchmark_lines() -> list[str]:
    """The benchmark prompts' docstring lines of 50 characters or more (short ones recur by chance)."""
    lines = []
    for text in (builtin_document("stdlib-a"), builtin_document("stdlib-b")):
        lines += [line.strip() for line in text.splitlines() if len(line.strip()) >= 50]
    return lines


def test_benchmark_prompts_share_no_module_with_the_training_documents():
    assert not set(BENCHMARK_MODULES) & set(DOCUMENTS["stdlib-train"])


@pytest.mark.parametrize("name", ["stdlib-train", "stdlib-train-source", "stdlib-source", "python-reference"])
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


def test_shared_texts_are_the_text_itself_what_it_holds_and_what_holds_it():
    assert shared_texts("stdlib-train") == {"stdlib-train", "stdlib-train-source", "stdlib-source"}
    assert shared_texts("stdlib-source") == {"stdlib-source", "stdlib-train", "stdlib-train-source"}
    assert shared_texts("stdlib-a") == {"stdlib-a"}
