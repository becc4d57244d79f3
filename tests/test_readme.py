"""The README's commands: the two set-up commands come first and CI runs the second; every `triforce` command
shown in the README and docs/ parses with the options it is given; the cheap ones run."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from triforce_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[str]:
    return re.findall(r"```(?:bash|console)\n(.*?)```", path.read_text(), flags=re.DOTALL)


def commands(block: str) -> list[str]:
    """Shell lines of a code block, continuations joined, prompts ('$ ') and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.removeprefix("$ ").split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def triforce_commands() -> list[tuple[str, str]]:
    found = []
    for path in DOCUMENTS:
        for block in code_blocks(path):
            for line in commands(block):
                for part in line.split("&&"):
                    if part.strip().startswith("triforce "):
                        found.append((path.relative_to(ROOT).as_posix(), part.strip()))
    return found


def test_the_two_setup_commands_come_first_and_ci_runs_the_tests_the_readme_names():
    first, second = (commands(block) for block in code_blocks(ROOT / "README.md")[:2])
    setup = "bash scripts/install.sh && triforce generate --prompt-file examples/logbook.txt --chat --max-new-tokens 64"
    assert first == [setup]
    assert second == ["bash scripts/install.sh --test && python3 -m pytest -q"]
    ci = [line for line in commands((ROOT / ".ci" / "run").read_text()) if not line.startswith(("set ", "cd "))]
    assert ci == second


def test_readme_shows_commands_of_every_command():
    shown = {shlex.split(line)[1] for _, line in triforce_commands()}
    assert {"generate", "chat", "bench", "distill", "cache"} <= shown


@pytest.mark.parametrize(("document", "line"), triforce_commands(), ids=lambda v: v if "/" in v or "." in v else None)
def test_every_documented_command_parses(document, line):
    """Each command's options and values are accepted (types, choices, token counts), without running it."""
    words = shlex.split(line)[1:]
    command = typer.main.get_command(app)
    context = command.context_class(command, info_name="triforce")
    while hasattr(command, "get_command"):  # a group: its next word names the command
        name, words = words[0], words[1:]
        command = command.get_command(context, name)
        context = command.context_class(command, info_name=name, parent=context)
    command.make_context(context.info_name, words, parent=context.parent)


@pytest.mark.parametrize("line", ["triforce cache list", "triforce --help", "triforce generate --help"])
def test_cheap_commands_run(line, tmp_path, monkeypatch):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, shlex.split(line)[1:])
    assert result.exit_code == 0, result.output


@pytest.mark.embedded
def test_the_first_setup_command_generates(tmp_path):
    """The README's first command past the install, as a user runs it (in a process of its own)."""
    first = commands(code_blocks(ROOT / "README.md")[0])[0].split("&&")[1].strip()
    words = shlex.split(first.replace("--max-new-tokens 64", "--max-new-tokens 8"))
    run = [sys.executable, "-m", "triforce_cli", *words[1:]]
    result = subprocess.run(run, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "Traceback" not in result.stderr


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated one numbered from -1."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    anchors: set[str] = set()
    for title in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.MULTILINE):
        anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        numbered, count = anchor, 0
        while numbered in anchors:
            count += 1
            numbered = f"{anchor}-{count}"
        anchors.add(numbered)
    return anchors


def relative_links() -> list[tuple[str, str]]:
    found = []
    for path in DOCUMENTS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                found.append((path.relative_to(ROOT).as_posix(), target))
    return found


@pytest.mark.parametrize(("document", "target"), relative_links())
def test_every_relative_link_reaches_a_file_and_heading(document, target):
    """A link between the documents names a file that exists and, with #anchor, one of its headings."""
    file, _, anchor = target.partition("#")
    linked = (ROOT / document).parent / file if file else ROOT / document
    assert linked.exists(), f"{document}: {target}: no such file"
    if anchor:
        assert anchor in heading_anchors(linked), f"{document}: {target}: no such heading"
