"""Built-in text: documentation of the Python standard library, for benchmark prompts and drafter training.

Real prose, reference text and code written by the Python developers (PSF licence), present wherever Python runs, so
benchmarks and `triforce distill` need no download. Each module document is the docstrings of a fixed list of
modules and their public members, in a fixed order; a source document (SOURCES) is the Python source code of
another document's modules (code, comments and the same docstrings), and "stdlib-source" that of the whole standard
library but the benchmark documents' modules; "python-reference" is the language reference topics pydoc shows. The
benchmark documents (stdlib-a, stdlib-b, and stdlib-b-source, the code of stdlib-b) share no module with the
training text (stdlib-train, stdlib-train-source, stdlib-source, python-reference), so a drafter trained on the
latter is measured on held-out text. BENCH_PROMPTS turn documents into the bench's prompts: most continue a
document, some ask for something about it in a chat turn; those requests are the only text here written by us.
"""

import importlib
import inspect
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics

DOCUMENTS = {
    "stdlib-a": (
        "argparse", "collections", "json", "logging", "pathlib", "subprocess", "typing", "unittest",
        "email.message", "http.client", "xml.etree.ElementTree", "zipfile", "tarfile", "shutil", "tempfile",
    ),
    "stdlib-b": (
        "asyncio", "datetime", "decimal", "fractions", "functools", "itertools", "statistics", "threading",
        "socket", "ssl", "sqlite3", "csv", "textwrap", "difflib", "heapq", "inspect", "pickle", "urllib.request",
    ),
    "stdlib-train": (
        "abc", "ast", "base64", "bdb", "binascii", "bisect", "bz2", "calendar", "cmath", "cmd", "code", "codecs",
        "colorsys", "concurrent.futures", "configparser", "contextlib", "contextvars", "copy", "copyreg",
        "dataclasses", "dbm", "dis", "doctest", "email.headerregistry", "email.parser", "email.policy",
        "email.utils", "enum", "filecmp", "fileinput", "fnmatch", "ftplib", "getopt", "getpass", "gettext", "glob",
        "graphlib", "gzip", "hashlib", "hmac", "html", "html.parser", "http.cookiejar", "http.cookies",
        "http.server", "imaplib", "importlib", "importlib.metadata", "io", "ipaddress", "keyword", "linecache",
        "locale", "logging.config", "logging.handlers", "lzma", "mailbox", "mimetypes", "netrc", "numbers",
        "operator", "optparse", "os", "pdb", "pkgutil", "platform", "plistlib", "poplib", "pprint", "profile",
        "pstats", "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "selectors", "shelve",
        "shlex", "signal", "site", "smtplib", "socketserver", "stat", "string", "struct", "symtable", "sysconfig",
        "timeit", "tokenize", "tomllib", "trace", "traceback", "tracemalloc", "types", "unittest.mock",
        "urllib.parse", "urllib.robotparser", "uuid", "warnings", "wave", "weakref", "webbrowser",
        "wsgiref.handlers", "xml.dom.minidom", "xml.sax.handler", "xmlrpc.client", "xmlrpc.server", "zipapp",
        "zipimport", "zoneinfo",
    ),
}  # fmt: skip
BENCHMARK = ("stdlib-a", "stdlib-b")  # the documents whose modules every training text leaves out
# the Python source code of another document's modules
SOURCES = {"stdlib-train-source": "stdlib-train", "stdlib-b-source": "stdlib-b"}
LIBRARY_SOURCE = "stdlib-source"
REFERENCE = "python-reference"
BUILTIN_NAMES = (*DOCUMENTS, *SOURCES, LIBRARY_SOURCE, REFERENCE)
# Built-in texts that hold the text of others: a module's source holds its docstrings; the library's source holds
# every source document, and so its document, but those of benchmark documents.
HOLDS = {
    **{name: {of} for name, of in SOURCES.items()},
    LIBRARY_SOURCE: {text for name, of in SOURCES.items() if of not in BENCHMARK for text in (name, of)},
}
# Folders of the standard library that LIBRARY_SOURCE leaves out (and config-* ones): tests, GUI and packaging
# tools, pydoc_data (the python-reference text) and distutils (deprecated; it repeats shutil's archive functions).
NOT_LIBRARY = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3",
               "ensurepip", "pydoc_data", "distutils", "__pycache__"}  # fmt: skip


@dataclass(frozen=True)
class BenchPrompt:
    """A built-in prompt of `triforce bench`: a built-in document continued as raw text where request is None;
    otherwise the document, then the request, as one user turn of the model's chat template. Prompts of several
    kinds, since how much drafting gains depends on how much of the answer repeats the prompt."""

    document: str  # one of BUILTIN_NAMES
    request: str | None = None


BENCH_PROMPTS = {
    **{name: BenchPrompt(name) for name in DOCUMENTS},
    # about datetime: the first module stdlib-b documents at length (asyncio's members belong to its submodules, so
    # it has one line there), so every context length the document is cut to keeps what the answer needs
    "qa-stdlib-b": BenchPrompt(
        "stdlib-b",
        "How do I get the number of days between two dates, and the time 90 minutes after a given datetime? "
        "Answer briefly, with a short example.",
    ),
    "summary-stdlib-a": BenchPrompt(
        "stdlib-a",
        "Summarise the documentation above in a few paragraphs: what each module is for and its main functions.",
    ),
    "code-stdlib-b": BenchPrompt("stdlib-b-source"),
}
# the default prompts: one of each kind (documentation and code continued, a question and a summary)
BENCH_DEFAULT = ("stdlib-a", "qa-stdlib-b", "summary-stdlib-a", "code-stdlib-b")
# `triforce bench --scenario qa`: questions asked in turn about a built-in document, each answerable from the part
# every context length keeps (the document's first modules); DOCUMENT_QUESTIONS for any other document
QA_QUESTIONS = {
    "stdlib-b": (
        "How do I get the number of days between two dates? Answer briefly, with a short example.",
        "And how do I get the time 90 minutes after a given datetime?",
        "Which class represents a fixed offset from UTC? Answer in one sentence.",
    ),
    "stdlib-a": (
        "How do I add a positional argument and an optional flag with argparse? Answer briefly, with an example.",
        "How do I count how often each word occurs in a list? A short example, please.",
        "Which function writes an object to a file as JSON? Answer in one sentence.",
    ),
}
DOCUMENT_QUESTIONS = (
    "Summarise the document in three sentences.",
    "What is the most important point it makes? Answer briefly.",
    "Quote one sentence from it that supports that point.",
)


def module_text(name: str) -> str:
    module = importlib.import_module(name)
    parts = [f"# {name}\n\n{inspect.getdoc(module) or ''}"]
    for member_name, member in sorted(vars(module).items()):
        if member_name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        doc = inspect.getdoc(member)
        if doc:
            parts.append(f"## {name}.{member_name}\n\n{doc}")
    return "\n\n".join(parts)


def module_source(name: str) -> str:
    """The module's Python source; empty for a module built from C."""
    try:
        return inspect.getsource(importlib.import_module(name))
    except (OSError, TypeError):
        return ""


def shared_texts(name: str) -> set[str]:
    """The built-in texts that share text with the named one: itself, those it holds and those that hold it."""
    return {name, *HOLDS.get(name, ()), *(other for other, held in HOLDS.items() if name in held)}


def library_source_files() -> list[Path]:
    """The standard library's Python files in path order, less NOT_LIBRARY and the benchmark prompts' modules
    (whose docstrings are those prompts): their files, and the whole folder of those that are packages."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    benchmark = {
        Path(module.__file__).resolve()
        for document in BENCHMARK
        for name in DOCUMENTS[document]
        if getattr(module := importlib.import_module(name), "__file__", None)
    }
    left_out = {file.parent for file in benchmark if file.name == "__init__.py"}  # benchmark packages
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [
            name
            for name in subfolders
            if name not in NOT_LIBRARY and not name.startswith("config-") and Path(folder, name) not in left_out
        ]
        files += [Path(folder, name) for name in names if name.endswith(".py") and Path(folder, name) not in benchmark]
    return sorted(files)


def builtin_document(name: str) -> str:
    """The named built-in document (one of BUILTIN_NAMES)."""
    if name == REFERENCE:
        return "\n\n".join(topics[key] for key in sorted(topics))
    if name == LIBRARY_SOURCE:
        return "\n\n".join(path.read_text(encoding="utf-8") for path in library_source_files())
    if name in SOURCES:
        return "\n\n".join(source for module in DOCUMENTS[SOURCES[name]] if (source := module_source(module)))
    return "\n\n".join(module_text(module) for module in DOCUMENTS[name])
