"""Real `triforce` processes side by side and cut short: two first runs at once, SIGKILL at several moments, SIGTERM,
a reader that closes stdout, two first builds of the CPU kernels.

Each test starts the command line as a subprocess (``python -m triforce_cli`` from this checkout) on a tiny
checkpoint, with a cache folder of its own that already holds the CPU kernels conftest built, so that only the
kernel test compiles them; every subprocess has a time limit.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import save_word_checkpoint
from triforce_cli.kernels.native import library_name
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.runtime.native import kernel_error, kernel_folder
from triforce_cli.runtime.store import INDUCTOR_CACHE_VARIABLE, PARTIAL_SUFFIX

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 120  # seconds any one run may take
# seconds a first build may take while another runs beside it: each then has half the cores (a build alone takes
# 40-50 s of the 2-core EPYC), and a busy host stretched two at once past LIMIT
BUILD_LIMIT = 300
CLOSED_STDOUT_EXIT_CODE = 141  # 128 + SIGPIPE
TERMINATED_EXIT_CODE = 143  # 128 + SIGTERM
GREEDY = ("--temperature", "0", "--max-new-tokens", "8")
LEGEND = "tokens by tier"  # the note generate prints just before it prefills

# The kernels conftest built in the default cache folder, copied into each test's own.
BUILT_KERNELS = kernel_folder() / library_name()


def command(*args) -> list[str]:
    return [sys.executable, "-m", "triforce_cli", *map(str, args)]


def environment(cache: Path, **changes: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TRIFORCE_CACHE": str(cache), **changes}


@contextmanager
def started(argv: list[str], env: dict[str, str], stdout=subprocess.PIPE, stderr=subprocess.PIPE, **options):
    """A running process, killed on the way out if a failed assertion left it running."""
    proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env, cwd=ROOT, **options)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=LIMIT)


def finished(proc: subprocess.Popen, limit: float = LIMIT) -> tuple[str, str]:
    stdout, stderr = proc.communicate(timeout=limit)
    return (stdout or b"").decode(), (stderr or b"").decode()


def wait_until(proc: subprocess.Popen, condition: Callable[[], bool], what: str, pause: float = 0.01) -> None:
    """Poll condition while proc runs; fail if proc ends or LIMIT passes first."""
    deadline = time.monotonic() + LIMIT
    while not condition():
        assert proc.poll() is None, f"the process ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {LIMIT} s"
        time.sleep(pause)


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=False, capture_output=True, env=env, cwd=ROOT, timeout=LIMIT)


def run_json(*args, cache: Path) -> dict:
    result = run(command(*args, "--json"), environment(cache))
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)


def partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(PARTIAL_SUFFIX)) if folder.is_dir() else []


def assert_quiet(stderr: str) -> None:
    assert "Traceback" not in stderr and "Exception ignored" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_word_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")


def words(path: Path, count: int) -> Path:
    path.write_text(" ".join(f"w{i % 31}" for i in range(count)))
    return path


@pytest.fixture(scope="module")
def prompt(tmp_path_factory) -> Path:
    """3000 tokens: a prefill long enough to be killed in (a few tenths of a second), within the tiny context."""
    return words(tmp_path_factory.mktemp("prompt") / "prompt.txt", 3000)


def cache_folder(root: Path) -> Path:
    """A cache folder holding the CPU kernels already built for this machine, where there are."""
    kernels = root / "kernels" / kernel_folder().name
    kernels.mkdir(parents=True)
    if BUILT_KERNELS.is_file():
        shutil.copy2(BUILT_KERNELS, kernels / BUILT_KERNELS.name)
    return root


@pytest.fixture
def cache(tmp_path) -> Path:
    """The test's own cache folder."""
    return cache_folder(tmp_path / "cache")


@pytest.fixture(scope="module")
def fresh(checkpoint, prompt, tmp_path_factory) -> dict:
    """The prompt's greedy continuation from a run with no prompt cache."""
    own_cache = cache_folder(tmp_path_factory.mktemp("fresh") / "cache")
    data = run_json("generate", "-p", prompt, "--target", checkpoint, *GREEDY, cache=own_cache)
    assert not data["prompt_cached"] and data["new_tokens"] == 8
    return data


# ---------------------------------------------------------------------------------------------- the prompt cache


def test_two_runs_saving_the_same_prompt_at_once(checkpoint, prompt, cache, fresh, tmp_path):
    """Both save the same entry at the same moment: both succeed with the fresh output, one whole entry is left and
    a third run is served from it."""
    folder = tmp_path / "prompts"
    args = ("generate", "-p", prompt, "--target", checkpoint, "--prompt-cache", folder, *GREEDY, "--json")
    with started(command(*args), environment(cache)) as first, started(command(*args), environment(cache)) as second:
        outputs = [finished(first), finished(second)]
    for proc, (stdout, stderr) in zip((first, second), outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert json.loads(stdout)["token_ids"] == fresh["token_ids"]
    assert len(list(folder.glob("prompt-*.safetensors"))) == 1 and not partials(folder)
    third = run_json(*args[:-1], cache=cache)
    assert third["prompt_cached"] and third["token_ids"] == fresh["token_ids"]


@pytest.mark.parametrize("moment", ["starting", "prefilling", "saving"])
def test_a_run_killed_at_any_moment_leaves_nothing_served_wrongly(
    checkpoint, prompt, cache, fresh, tmp_path, monkeypatch, moment
):
    """SIGKILL while Python starts, while the prompt is prefilled, or as soon as the saved prefill shows in the
    folder (its partial where the poll catches the write, which takes about a millisecond, else the entry just
    renamed into place; test_prompt_cache.py plants what a kill mid-write leaves): the next run gives the fresh
    output, served from the saved entry only where the killed run finished it, and `cache list` shows no partial."""
    folder = tmp_path / "prompts"
    notes = tmp_path / "stderr.txt"
    args = ("generate", "-p", prompt, "--target", checkpoint, "--prompt-cache", folder, *GREEDY)

    def saved() -> bool:
        return folder.is_dir() and any(p.name.startswith("prompt-") for p in folder.iterdir())

    with notes.open("wb") as stderr, started(command(*args), environment(cache), stderr=stderr) as proc:
        if moment == "starting":
            time.sleep(0.5)
        elif moment == "prefilling":
            wait_until(proc, lambda: LEGEND in notes.read_text(), "prefill")
        else:
            wait_until(proc, saved, "saved prefill", pause=0.001)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.kill()
        proc.communicate(timeout=LIMIT)
    if moment != "saving":
        assert not saved()
    kept = list(folder.glob("prompt-*.safetensors")) if folder.is_dir() else []
    after = run_json(*args, cache=cache)
    assert after["token_ids"] == fresh["token_ids"]
    assert after["prompt_cached"] == bool(kept)
    monkeypatch.setenv("TRIFORCE_CACHE", str(cache))
    monkeypatch.setenv("COLUMNS", "400")  # entry names whole on one line
    listed = CliRunner().invoke(app, ["cache", "list", "--prompt-cache", str(folder)])
    assert listed.exit_code == 0 and folder.name in listed.stdout, listed.output
    assert PARTIAL_SUFFIX not in listed.stdout
    assert len(list(folder.glob("prompt-*.safetensors"))) == 1  # the next run saved it, or found it whole


def test_two_first_runs_measure_at_once(checkpoint, prompt, cache):
    """Two first runs of a target both measure its fastest configuration (decoding.tuning) at once: both succeed,
    and what is left is at most one whole measurement and no partial. Each run is the other's load on a small
    machine, so neither may keep its measurement (decoding.tuning.BUSY_SHARE): then the next run measures again.
    Compiled steps are measured with the compile left out, as in test_tuning.py: compiling for real takes minutes."""
    launch = (
        "from triforce_cli.runtime.model import Transformer; Transformer.compile_steps = lambda model, *args: None; "
        "from triforce_cli.__main__ import main; main()"
    )
    argv = [sys.executable, "-c", launch, "generate", "-p", str(prompt), "--target", str(checkpoint), *GREEDY]
    env = environment(cache, TRIFORCE_TUNING="on")
    with started(argv, env) as first, started(argv, env) as second:
        outputs = [finished(first), finished(second)]
    for proc, (stdout, stderr) in zip((first, second), outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert "measuring the fastest configuration" in stderr
    kept = list((cache / "tuning").iterdir()) if (cache / "tuning").is_dir() else []
    assert len(kept) <= 1 and all(path.suffix == ".json" for path in kept), kept
    assert all(json.loads(path.read_text())["target"] == "tiny" for path in kept)
    busy = sum("busy while measuring" in stderr for _, stderr in outputs)
    assert busy + len(kept) >= 1  # a run that kept nothing said why


# ---------------------------------------------------------------------------------------------- compiled steps


def test_compiled_steps_are_timed_apart_and_kept_in_the_cache_folder(checkpoint, cache, tmp_path):
    """--compile: a first run compiles its decode step (autoregressive: one graph) before the prefill, reports the
    seconds as compile_seconds, and torch's inductor keeps the graph in the cache folder's inductor/ rather than
    the system's temporary folder; a second process finds it there and writes nothing new. One compile (seconds)."""
    prompt = words(tmp_path / "prompt.txt", 40)
    env = environment(cache)
    env.pop(INDUCTOR_CACHE_VARIABLE, None)  # as a shell starts the command: this test process's torch set it
    args = ("generate", "-p", prompt, "--target", checkpoint, "--mode", "autoregressive", "--compile", *GREEDY)
    runs = []
    for _ in range(2):
        result = run(command(*args, "--json"), env)
        assert result.returncode == 0, result.stderr.decode()
        graphs = sorted((cache / "inductor" / "fxgraph").rglob("*"))
        runs.append((json.loads(result.stdout), graphs))
    (first, graphs), (second, graphs_then) = runs
    assert first["compile_seconds"] > 0 and first["ms_per_token"] > 0
    assert graphs and graphs_then == graphs
    assert second["token_ids"] == first["token_ids"]


# ---------------------------------------------------------------------------------------------- SIGTERM


def test_sigterm_while_prefilling_stops_like_ctrl_c(checkpoint, cache, tmp_path):
    """No token yet: nothing on stdout, 'interrupted' on stderr, exit status 143, no traceback."""
    long_prompt = words(tmp_path / "long.txt", 12000)
    notes = tmp_path / "stderr.txt"
    args = ("generate", "-p", long_prompt, "--target", checkpoint, "--context-window", "16k", *GREEDY)
    with notes.open("wb") as stderr, started(command(*args), environment(cache), stderr=stderr) as proc:
        wait_until(proc, lambda: LEGEND in notes.read_text(), "prefill")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = finished(proc)
    assert proc.returncode == TERMINATED_EXIT_CODE, notes.read_text()
    assert stdout.strip() == ""  # stopped before the first token: during the prefill
    assert "interrupted" in notes.read_text() and "Traceback" not in notes.read_text()


def test_sigterm_while_decoding_keeps_the_text_so_far(checkpoint, cache, tmp_path):
    """The tokens generated before SIGTERM stay on stdout; 'interrupted' on stderr, exit status 143, no traceback."""
    out = tmp_path / "stdout.txt"
    args = ("generate", "-p", words(tmp_path / "short.txt", 20), "--target", checkpoint, "--temperature", "0")
    args += ("--max-new-tokens", "60000", "--context-window", "64k")
    with out.open("wb") as stdout, started(command(*args), environment(cache), stdout=stdout) as proc:
        wait_until(proc, lambda: out.read_text().strip(), "token on stdout")
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = finished(proc)
    assert proc.returncode == TERMINATED_EXIT_CODE, stderr
    text = out.read_text().split()
    assert text and all(word.startswith("w") or word == "[UNK]" for word in text)
    assert "interrupted" in stderr and "Traceback" not in stderr


# ---------------------------------------------------------------------------------------------- a closed stdout


def test_a_reader_closing_stdout_mid_stream_ends_the_run_quietly(checkpoint, cache, tmp_path):
    """`triforce generate ... | head -c 10`: the run stops at its next token, with exit status 141 (128 + SIGPIPE,
    what a shell reports for any program cut off so) and nothing on stderr but its notes."""
    args = ("generate", "-p", words(tmp_path / "short.txt", 20), "--target", checkpoint, "--temperature", "0")
    args += ("--max-new-tokens", "60000", "--context-window", "64k")
    with started(command(*args), environment(cache)) as proc:
        assert proc.stdout.read(10)
        proc.stdout.close()
        proc.wait(timeout=LIMIT)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == CLOSED_STDOUT_EXIT_CODE, stderr
    assert_quiet(stderr)
    assert "error" not in stderr


def test_a_reader_gone_before_the_json_ends_the_run_quietly(checkpoint, prompt, cache):
    """--json writes its one object at the end: a reader that closed stdout before then gets the same quiet exit."""
    args = ("generate", "-p", prompt, "--target", checkpoint, *GREEDY, "--json")
    with started(command(*args), environment(cache)) as proc:
        proc.stdout.close()
        proc.wait(timeout=LIMIT)
        stderr = proc.stderr.read().decode()
    assert proc.returncode == CLOSED_STDOUT_EXIT_CODE, stderr
    assert_quiet(stderr)
    assert stderr.strip() == ""


# ---------------------------------------------------------------------------------------------- the CPU kernels

LOAD_KERNELS = (
    "import sys; from pathlib import Path; import torch; from triforce_cli.kernels.native import load_native; "
    "load_native(Path(sys.argv[1])); print(torch.ops.triforce_cpu.isa())"
)


@pytest.mark.skipif(kernel_error() is not None, reason=f"the CPU kernels cannot be built here: {kernel_error()}")
def test_two_first_builds_at_once_and_one_killed_midway(tmp_path):
    """Two processes build the kernels into the same empty folder at once while a third, started with them, is
    killed a few seconds into its build: both load the kernels, one library is left, and a later load in that
    folder (beside the killed build's leftovers and a lock file such as cpp_extension's in-place build leaves when
    killed) loads it without building or waiting. Compiles the kernels twice (tens of seconds)."""
    folder = tmp_path / "kernels"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", LOAD_KERNELS, str(folder)]
    with (
        started(argv, env) as first,
        started(argv, env) as second,
        started(argv, env, start_new_session=True) as killed,
    ):
        time.sleep(5)
        assert killed.poll() is None, "the third build ended before it could be killed"
        os.killpg(killed.pid, signal.SIGKILL)  # its compiler too
        outputs = [finished(first, BUILD_LIMIT), finished(second, BUILD_LIMIT)]
    for proc, (stdout, stderr) in zip((first, second), outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert stdout.strip() in ("avx512", "avx2", "scalar")
    (library,) = folder.glob("*.so")
    assert library.name == library_name()
    assert len(list(folder.glob("build-*"))) <= 1  # the killed build's workspace at most: the others removed theirs
    built = library.stat().st_ino
    (folder / "lock").touch()
    later = run(argv, env)
    assert later.returncode == 0 and later.stdout.decode().strip() == outputs[0][0].strip(), later.stderr.decode()
    assert library.stat().st_ino == built  # loaded as it was: a build would have renamed a new file into place
