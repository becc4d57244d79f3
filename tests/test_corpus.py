"""Built-in text: the benchmark prompts stay held out from every training document."""

import fnmatch
import importlib
import inspect

from triforce_cli.corpus import DOCUMENTS, builtin_document

BENCHMARK_MODULES = (*DOCUMENTS["stdlib-a"], *DOCUMENTS["stdlib-b"])


def test_benchmark_prompts_share_no_module_with_the_training_documents():
    assert not set(BENCHMARK_MODULES) & set(DOCUMENTS["stdlib-train"])


def test_source_document_is_the_code_of_the_training_modules_without_benchmark_docstrings():
    source = builtin_document("stdlib-train-source")
    assert inspect.getsource(fnmatch) in source and inspect.getsource(importlib.import_module("graphlib")) in source
    assert "def fnmatch(name, pat):" in source  # code, not only docstrings
    for module in BENCHMARK_MODULES:
        opening = (inspect.getdoc(importlib.import_module(module)) or "")[:120]
        assert not opening or opening not in source, module
