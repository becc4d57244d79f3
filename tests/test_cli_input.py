"""Whatever is typed, `generate` and `bench` end in their output or in one `error:` line with a non-zero exit.

A fuzz test feeds unreadable, out-of-range and random values to every option of both commands through Typer's test
runner (models swapped for tiny in-memory ones, see the `tiny` fixture); Ctrl-C while loading or prefilling; the
JSON error object of `--json`; tables, notes and every command's --help that fit 80 columns.
"""

import io
import json
import random
import re

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

import triforce_cli.decoding.pipeline
from triforce_cli.cli.app import app
from triforce_cli.cli.console import print_note
from triforce_cli.cli.render import bench_tables, memory_plan_line, print_summary
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.sizing import MemoryItem, MemoryPlan

NUMERIC = {
    "generate": (
        "--budget", "--chunk-size", "--draft-window", "--sink-tokens", "--gamma1", "--gamma2", "--refresh-interval",
        "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--threads", "--context-window",
    ),
    "bench": (
        "--context", "--budget", "--chunk-size", "--max-new-tokens", "--repeats", "--warmup", "--temperature",
        "--top-p", "--top-k", "--seed", "--draft-window", "--sink-tokens", "--gamma1", "--gamma2",
        "--refresh-interval", "--threads", "--context-window", "--forward-costs",
    ),
}  # fmt: skip
CHOICES = {
    "generate": ("--mode", "--gamma-policy", "--dtype", "--weights", "--device"),
    "bench": ("--modes", "--gamma-policy", "--dtype", "--weights", "--device", "--builtin"),
}
NOT_A_NUMBER = ("nan", "inf", "-inf", "1e400", "1e400k", "infk", "abc", "", "-1", "-2.5k", "1,,2")
NOT_A_CHOICE = ("abc", "", "-1", "cuda:x", "AUTOREGRESSIVE", "nan")
QUICK = {
    "generate": ("--max-new-tokens", "4", "--temperature", "0"),
    "bench": (
        "--context",
        "96",
        "--max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--modes",
        "autoregressive",
    ),
}


def run(command: str, *args: str, prompt_file=None):
    prompt = ("-p", str(prompt_file)) if prompt_file is not None else ()
    return CliRunner().invoke(app, [command, *prompt, *args], env={"COLUMNS": "80"})


def assert_clean(result, args) -> None:
    """Either success, or a non-zero exit with exactly one stderr line, an `error:` one; never a traceback."""
    assert "Traceback" not in result.output, (args, result.output)
    assert "Value error" not in result.output, (args, result.output)  # pydantic's wording, under typer
    assert isinstance(result.exception, SystemExit | None), (args, repr(result.exception))
    if result.exit_code:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        assert len(errors) == 1 and errors[0] == lines[-1], (args, result.stderr)


def assert_one_line_failure(result, args) -> None:
    assert result.exit_code not in (0, None), (args, result.output)
    assert_clean(result, args)
    assert len([line for line in result.stderr.splitlines() if line.strip()]) == 1, (args, result.stderr)


@pytest.fixture
def fast_bench_peers(monkeypatch):
    """No transformers peers in bench runs: only our modes are fuzzed here."""
    monkeypatch.setattr("triforce_cli.cli.bench.default_modes", lambda target: ("autoregressive",))


@pytest.mark.usefixtures("tiny", "fast_bench_peers")
class TestFuzz:
    @pytest.mark.parametrize("command", ["generate", "bench"])
    @pytest.mark.parametrize(
        ("options", "values"), [(NUMERIC, NOT_A_NUMBER), (CHOICES, NOT_A_CHOICE)], ids=["numbers", "choices"]
    )
    def test_unreadable_values_are_one_line(self, command, options, values, prompt_file, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        for option in options[command]:
            for value in values:
                args = (*QUICK[command], f"{option}={value}")
                assert_one_line_failure(run(command, *args, prompt_file=prompt_file), args)

    @pytest.mark.parametrize("command", ["generate", "bench"])
    def test_random_values_end_cleanly(self, command, prompt_file, tmp_path, monkeypatch):
        """Random magnitudes and signs for every numeric option, and random text for every option: each run
        succeeds or fails in one line."""
        monkeypatch.chdir(tmp_path)
        rng = random.Random(f"fuzz-{command}")
        texts = ["x" * rng.randint(0, 20), "../" * 3, "~", "-", "--", "🙂", "[bold]x[/]", "1e-300", "0x10", "1_000"]
        options = [*NUMERIC[command], *CHOICES[command], "--target", "--draft", "--prompt-cache"]
        for option in options:
            values = [str(rng.choice([-1, 1]) * 10 ** rng.randint(0, 30)), str(rng.uniform(-1e3, 1e3))]
            values += rng.sample(texts, 3)
            for value in values:
                args = (*QUICK[command], f"{option}={value}")
                assert_clean(run(command, *args, prompt_file=prompt_file), args)

    def test_unknown_option_is_one_line(self, prompt_file):
        result = run("generate", "--gamma", "3", prompt_file=prompt_file)
        assert_one_line_failure(result, "--gamma")
        assert "No such option" in result.stderr and "triforce generate --help" in result.stderr

    def test_missing_prompt_file_option_is_one_line(self):
        assert_one_line_failure(run("generate"), "no -p")


@pytest.mark.usefixtures("tiny")
class TestJsonErrors:
    def test_domain_error_is_a_json_object_too(self, prompt_file):
        result = run("generate", "--json", "--budget", "20", "--chunk-size", "16", prompt_file=prompt_file)
        assert result.exit_code == 1
        assert json.loads(result.stdout) == {"error": result.stderr.strip().removeprefix("error: ")}

    def test_usage_error_is_a_json_object_too(self, prompt_file):
        result = run("generate", "--json", "--gamma1", "x", prompt_file=prompt_file)
        assert result.exit_code == 2
        assert "--gamma1" in json.loads(result.stdout)["error"]

    def test_no_json_without_the_flag(self, prompt_file):
        result = run("generate", "--gamma1", "x", prompt_file=prompt_file)
        assert result.stdout == ""


@pytest.mark.usefixtures("tiny")
class TestInterruptBeforeGeneration:
    def test_while_loading(self, prompt_file, monkeypatch):
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(triforce_cli.decoding.pipeline, "load_model", interrupted)
        for extra in ((), ("--json",)):
            result = run("generate", *extra, prompt_file=prompt_file)
            assert result.exit_code == 130 and "Traceback" not in result.output
            assert result.stderr.strip() == "error: interrupted"
            if extra:
                assert json.loads(result.stdout) == {"error": "interrupted"}

    def test_while_prefilling(self, prompt_file, tiny_models, monkeypatch):
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        monkeypatch.setattr(tiny_models["tiny"].model, "forward", interrupted)
        result = run("generate", "--json", prompt_file=prompt_file)
        assert result.exit_code == 130 and "Traceback" not in result.output
        data = json.loads(result.stdout)
        assert data["stop_reason"] == "interrupted" and data["new_tokens"] == 0


@pytest.mark.usefixtures("tiny")
class TestMessages:
    def test_context_message_suggests_a_window_that_fits(self, prompt_file):
        result = run("generate", "--context-window", "256", "--max-new-tokens", "400", prompt_file=prompt_file)
        # 224 prompt tokens + 400 > the 512 positions of the tiny model: 624 positions need 1k
        assert result.exit_code == 1 and "--context-window 1k" in result.stderr, result.stderr

    def test_cpu_allocation_failure_is_out_of_memory(self, prompt_file, monkeypatch):
        def exhausted(self, *args, **kwargs):
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

        monkeypatch.setattr(Engine, "generate", exhausted)
        result = run("generate", "--json", prompt_file=prompt_file)
        assert result.exit_code == 1 and json.loads(result.stdout) == {"error": result.stderr.strip()[7:]}
        assert "out of memory" in result.stderr

    def test_other_runtime_errors_are_not_hidden(self, prompt_file, monkeypatch):
        def broken(self, *args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(Engine, "generate", broken)
        result = run("generate", prompt_file=prompt_file)
        assert isinstance(result.exception, RuntimeError)


@pytest.mark.usefixtures("tiny")
class TestEightyColumns:
    def test_generate_summary(self, prompt_file):
        result = run("generate", "--max-new-tokens", "8", "--temperature", "0", prompt_file=prompt_file)
        assert result.exit_code == 0, result.output
        tables = [line for line in result.stderr.splitlines() if set(line) & set("│┃┏┗┡└┌")]
        assert len(tables) > 10, result.stderr
        for line in tables:
            assert len(line) <= 80 and "…" not in line, line
        assert "acceptance per tier" in result.stderr
        assert max(len(line) for line in result.stderr.splitlines()) <= 80, result.stderr  # the notes too

    def test_bench_tables(self, prompt_file, tiny, tmp_path):
        from rich.console import Console

        from triforce_cli.bench.runner import BenchRow

        rows = [
            BenchRow("a-long-prompt-name.txt", mode, 32768, 1024, 16, 412.5, [61.2, 70.1, 69.0], "throughput")
            for mode in ("autoregressive", "triforce-ngram", "streaming-ngram", "hf-assisted")
        ]
        rows[1].acceptance = [
            {"proposer": "ngram/drafter", "verifier": "retrieval", "acceptance_rate": 0.51, "mean_drafted": 2.0,
             "judged_acceptance_rate": 0.55, "mean_accepted_length": 2.1, "verifications": 120},
        ]  # fmt: skip
        console = Console(width=80, record=True, file=io.StringIO())
        for table in bench_tables(rows):
            console.print(table)
        text = console.export_text()
        for line in text.splitlines():
            assert len(line) <= 80 and "…" not in line, line
        assert "triforce-ngram" in text and "ngram/drafter" in text and "[min-max]" in text
        assert "throughput" not in text  # one policy and one retrieval setting: nothing swept to name

    def test_swept_settings_are_named(self):
        from rich.console import Console

        from triforce_cli.bench.runner import BenchRow

        rows = [BenchRow("p", "triforce", 1024, None, 16, 1.0, [20.0], policy) for policy in ("fixed", "throughput")]
        rows.append(BenchRow("p", "autoregressive", 1024, None, None, 1.0, [25.0]))
        console = Console(width=80, record=True, file=io.StringIO())
        for table in bench_tables(rows):
            console.print(table)
        text = console.export_text()
        assert (
            "triforce auto/16 fixed" in text and text.count("throughput") == 2
        )  # one row in each of the two tables  # the cell may wrap

    def test_print_summary_at_80(self, tmp_path):
        from rich.console import Console

        from triforce_cli.decoding.speculative import AcceptanceStats
        from triforce_cli.decoding.stats import GenerationStats

        stats = GenerationStats("triforce", "n-gram prompt lookup (training-free), else a-drafter", 32768, 256)
        stats.acceptance = [AcceptanceStats("ngram/drafter", "retrieval", 300, 150, 120, 90)]
        texts = []
        for compile_seconds in (0.0, 123.456):  # a row of its own only where steps were compiled
            stats.compile_seconds = compile_seconds
            console = Console(width=80, record=True, file=io.StringIO())
            print_summary(console, stats)
            texts.append(console.export_text())
            for line in texts[-1].splitlines():
                assert len(line) <= 80 and "…" not in line, line
        assert "compile" not in texts[0]
        assert re.search(r"│ compile +│ 123\.46 s \(decode steps, before the prefill\)", texts[1])


def test_threads_must_be_positive(prompt_file):
    for value in ("0", "-3"):
        assert_one_line_failure(run("generate", "--threads", value, prompt_file=prompt_file), value)


def command_paths(command, path: tuple[str, ...] = ()):
    """The words that name the application and each of its commands and groups, and the click command each names."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from command_paths(sub, (*path, name))


@pytest.mark.parametrize(
    ("path", "command"),
    [pytest.param(*named, id=" ".join(named[0]) or "triforce") for named in command_paths(typer.main.get_command(app))],
)
def test_help_shows_what_each_value_is_within_80_columns(path, command):
    """Every option that takes a value names it (TOKENS, FILE, N, auto|cpu|cuda[:N]), none Typer's <int range>,
    <str> or <path>; and the help fits 80 columns."""
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert not re.search(r"(^|\s)--?[\w-]+ <", result.stdout, flags=re.MULTILINE), result.stdout
    assert not re.search(r"<(int|float|str|path|list|bool)", result.stdout), result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80, result.stdout
    options = [param for param in command.params if param.param_type_name == "option"]
    assert all(param.is_flag or param.metavar for param in options), [param.name for param in options]


def test_weights_help_says_what_auto_picks():
    """auto is the measured fastest form on a CPU in float32 (decoding/tuning.py), dense elsewhere
    (runtime/forms.resolve_weights): no longer 'half on x86 CPUs'."""
    help_text = " ".join(CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "80"}).stdout.split())
    assert "auto: on a CPU in float32 the one measured fastest for the target here" in help_text
    assert "dense elsewhere" in help_text and "x86" not in help_text


SIZE = re.compile(r"\d+(?:\.\d+)? [KMG]?i?B")


class TestNotesAt80:
    PLAN = MemoryPlan(
        "cuda:0",
        (
            MemoryItem("weights", 15 * 2**30, 0),
            MemoryItem("retrieval cache", 1536 * 2**20, 0),
            MemoryItem("drafter cache", 90 * 2**20, 0),
            MemoryItem("full KV cache", 0, 16 * 2**30),
            MemoryItem("on-chip layers and ring", 3 * 2**30, 0),
        ),
    )

    def printed(self, message: str, width: int = 80) -> list[str]:
        console = Console(width=width, record=True, file=io.StringIO())
        print_note(console, message)
        return console.export_text().splitlines()

    @pytest.mark.parametrize("width", [80, 40])
    def test_memory_note_wraps_between_items(self, width):
        message = memory_plan_line(self.PLAN)
        lines = self.printed(message, width)
        assert len(message) > 80 and len(lines) > 1
        assert all(len(line) <= width for line in lines), lines
        assert all(line.startswith("  ") and not line.startswith("   ") for line in lines[1:]), lines
        assert " ".join(line.strip() for line in lines) == message
        assert sum(len(SIZE.findall(line)) for line in lines) == len(SIZE.findall(message)) == 7  # none split
        assert all(re.search(r"[,;:)]$", line) for line in lines[:-1]), lines  # each break ends an item

    def test_a_long_path_stays_whole_on_a_line_of_its_own(self):
        path = "/home/someone/" + "a-very-long-folder-name/" * 4 + "drafter"
        message = f"drafter written to {path}: use it with --draft {path}"
        assert self.printed(message) == [f"drafter written to {path}:", f"  use it with --draft {path}"]

    def test_short_note_is_one_line(self):
        message = "drafter: n-gram prompt lookup (training-free), else smollm2-135m-instruct"
        assert self.printed(message) == [message]
