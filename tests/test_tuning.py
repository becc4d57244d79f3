"""The fastest exact configuration (decoding.tuning): measured once per machine and checkpoint, kept in the cache
folder, applied to `--weights auto` and unset threads, shown by `triforce info`."""

import json
import os

import pytest
import torch
from conftest import save_checkpoint
from typer.testing import CliRunner

from kernels import half_weights_available
from triforce_cli.cli.app import app
from triforce_cli.decoding import tuning
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.runtime.loading import resolve_checkpoint
from triforce_cli.runtime.model import Transformer


@pytest.fixture
def checkpoint_folder(tmp_path, monkeypatch):
    """A tiny dense checkpoint, a cache folder of its own, measurements switched on."""
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tuning.TUNING_ENV, raising=False)
    folder = tmp_path / "tiny"
    save_checkpoint(folder, seed=3)
    return folder


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def counting_measure(monkeypatch) -> list[str]:
    calls = []
    real = tuning.measure

    def measure(spec, checkpoint):
        calls.append(spec)
        return real(spec, checkpoint)

    monkeypatch.setattr(tuning, "measure", measure)
    return calls


def test_measured_once_then_kept_until_the_checkpoint_changes(checkpoint_folder, monkeypatch, threads_restored):
    calls = counting_measure(monkeypatch)
    compiled = []  # compiling for real takes minutes: recorded, the steps stay eager
    monkeypatch.setattr(Transformer, "compile_steps", lambda model, *args: compiled.append(model))
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    notes = []
    first = tuning.fastest_configuration(str(checkpoint_folder), checkpoint, notes.append)
    forms = {label.split(" weights")[0] for label in first.ms_per_token}
    assert forms == ({"half", "dense"} if half_weights_available() else {"dense"})  # no GGUF file: no gguf form
    assert len(first.ms_per_token) == len(forms) * len(tuning.thread_counts()) + len(compiled)
    assert first.ms_per_token[first.choice.label] == min(first.ms_per_token.values())
    assert notes[0].startswith("measuring") and first.choice.label in notes[-1]

    again = tuning.fastest_configuration(str(checkpoint_folder), checkpoint)
    assert again == first and len(calls) == 1  # read back, not measured
    kept = list(tuning.tuning_folder().glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["choice"]["weights"] == first.choice.weights

    weights = checkpoint.weight_files[0]
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    tuning.fastest_configuration(str(checkpoint_folder), resolve_checkpoint(str(checkpoint_folder)))
    assert len(calls) == 2  # a changed checkpoint is measured anew


def test_compiled_steps_are_measured_only_where_dense_comes_close(checkpoint_folder, monkeypatch, threads_restored):
    compiled = []
    monkeypatch.setattr(Transformer, "compile_steps", lambda model, *args: compiled.append(model))
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    for dense_ms, expect_compiled in ((10.0, True), (30.0, False)):
        compiled.clear()
        monkeypatch.setattr(
            tuning, "_decode_ms", lambda engine, *args, ms=dense_ms: ms if engine.target.weights == "dense" else 9.0
        )
        measured = tuning.measure(str(checkpoint_folder), checkpoint)
        has_compiled = any("compile on" in label for label in measured.ms_per_token)
        assert has_compiled == expect_compiled == bool(compiled)


def fixed_tuning(monkeypatch, choice: tuning.Choice) -> None:
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda spec, checkpoint: tuning.Tuning("tiny", "cpu", choice, {}, "now", tuning.machine_key()),
    )


@pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")
def test_auto_settings_take_the_measured_choice(checkpoint_folder, monkeypatch, threads_restored):
    fixed_tuning(monkeypatch, tuning.Choice("half", 1))
    torch.set_num_threads(2)
    config = EngineConfig(mode="autoregressive")
    pipe = Pipeline.load(str(checkpoint_folder), config=config, device="cpu", tune=True)
    assert pipe.target.weights == "half" and torch.get_num_threads() == 1

    torch.set_num_threads(2)
    pipe = Pipeline.load(str(checkpoint_folder), config=config, device="cpu", tune=True, threads=2)
    assert pipe.target.weights == "half" and torch.get_num_threads() == 2  # threads the user set stay
    pipe = Pipeline.load(str(checkpoint_folder), config=config, device="cpu", weights="dense", tune=True)
    assert pipe.target.weights == "dense"  # weights the user named stay

    monkeypatch.setenv(tuning.TUNING_ENV, "off")
    monkeypatch.setattr(tuning, "fastest_configuration", lambda *args: pytest.fail("measured with tuning off"))
    pipe = Pipeline.load(str(checkpoint_folder), config=config, device="cpu", tune=True)
    assert pipe.target.weights == "half"  # the rule: half weights on an x86 CPU, nothing measured


def test_info_shows_the_kept_choice(checkpoint_folder, monkeypatch, threads_restored):
    label = "dense weights, 1 thread, compile off"
    fixed = tuning.Tuning("tiny", "cpu", tuning.Choice("dense", 1), {label: 1.5}, "now", tuning.machine_key())
    monkeypatch.setattr(tuning, "measure", lambda spec, checkpoint: fixed)
    tuning.fastest_configuration(str(checkpoint_folder), resolve_checkpoint(str(checkpoint_folder)))
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "dense weights, 1 thread, compile off" in result.output
    facts = json.loads(CliRunner().invoke(app, ["info", "--json"]).output)
    assert facts["tuned"][0]["choice"] == {"weights": "dense", "threads": 1, "compiled": False}
    other_machine = tuning.tuning_folder() / "elsewhere.json"  # measured on another CPU, torch or version
    other_machine.write_text(json.dumps({**facts["tuned"][0], "machine": "another CPU"}))
    assert len(json.loads(CliRunner().invoke(app, ["info", "--json"]).output)["tuned"]) == 1
