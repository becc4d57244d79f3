"""The package picture in docs/architecture.md ("Import direction") is the code's: every arrow drawn is an import,
every import between packages is drawn, and no package reaches back up."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"triforce_cli": "", "kernels": "kernels", "cache": "cache", "offload": "offload"}  # folder -> package


def package_of(path: Path) -> str:
    """The package a source file belongs to, named inside triforce_cli: 'decoding', 'kernels', 'errors', ..."""
    folder, *rest = path.relative_to(ROOT).parts
    if FOLDERS[folder]:
        return FOLDERS[folder]
    return rest[0] if len(rest) > 1 else Path(rest[0]).stem


def imported_packages(tree: ast.AST) -> set[str]:
    """The triforce_cli packages a module imports (absolute imports; relative ones stay inside a package)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name.split(".")[1] for name in names if name.startswith("triforce_cli.")}


def code_graph() -> dict[str, set[str]]:
    files = [path for folder in FOLDERS for path in (ROOT / folder).rglob("*.py")]
    files.remove(ROOT / "triforce_cli" / "__init__.py")  # the library API, imported by name on first use
    packages = {package_of(path) for path in files}
    graph: dict[str, set[str]] = {package: set() for package in packages}
    for path in files:
        source = package_of(path)
        graph[source] |= (imported_packages(ast.parse(path.read_text())) & packages) - {source}
    return graph


def drawn_graph() -> dict[str, set[str]]:
    """The arrows of the first code block after the heading: lines 'package → imported, imported'."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Import direction") :]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)
    graph = {}
    for line in block.splitlines():
        source, _, targets = line.partition("→")
        graph[source.strip()] = {name.strip() for name in targets.split(",") if name.strip() not in ("", "-")}
    return graph


def test_the_drawn_imports_are_the_code_imports():
    assert drawn_graph() == code_graph()


def test_imports_point_one_way():
    graph = code_graph()
    order: list[str] = []  # packages whose imports are all placed before them
    while len(order) < len(graph):
        ready = sorted(p for p in graph if p not in order and graph[p] <= set(order))
        assert ready, f"an import cycle among {sorted(set(graph) - set(order))}"
        order += ready
    assert order.index("kernels") < order.index("cache") < order.index("offload") < order.index("decoding")
