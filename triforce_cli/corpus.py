"""Built-in benchmark prompts: documentation text of the Python standard library.

Real prose and reference text written by the Python developers (PSF licence), present wherever Python runs, so
benchmarks need no download and no text written by us. Each document is the docstrings of a fixed list of
modules and their public members, in a fixed order.
"""

import importlib
import inspect

DOCUMENTS = {
    "stdlib-a": (
        "argparse", "collections", "json", "logging", "pathlib", "subprocess", "typing", "unittest",
        "email.message", "http.client", "xml.etree.ElementTree", "zipfile", "tarfile", "shutil", "tempfile",
    ),
    "stdlib-b": (
        "asyncio", "datetime", "decimal", "fractions", "functools", "itertools", "statistics", "threading",
        "socket", "ssl", "sqlite3", "csv", "textwrap", "difflib", "heapq", "inspect", "pickle", "urllib.request",
    ),
}


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


def builtin_document(name: str) -> str:
    """The named built-in document (see DOCUMENTS)."""
    return "\n\n".join(module_text(module) for module in DOCUMENTS[name])
