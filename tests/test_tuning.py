"""The fastest exact configuration (decoding.tuning): measured once per machine and checkpoint, kept in the cache
folder only when the machine was quiet, applied to `--weights auto` and unset threads, shown by `triforce info`."""

import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import save_checkpoint
from triforce_cli.kernels import half_weights_available
from typer.testing import CliRunner

from triforce_cli.cli.app import app
from triforce_cli.decoding import tuning
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.runtime.environment import cpu_description, physical_cores
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
def quiet_machine(monkeypatch):
    """Measurements taken as on a quiet machine, whatever else runs beside the tests: no other program's CPU time,
    and tiny models' millisecond timings never judged too spread."""
    monkeypatch.setattr(tuning, "others_share", lambda before, after: 0.0)
    monkeypatch.setattr(tuning, "MAX_SPREAD", float("inf"))


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


def test_measured_once_then_kept_until_the_checkpoint_changes(
    checkpoint_folder, monkeypatch, threads_restored, quiet_machine
):
    calls = counting_measure(monkeypatch)
    compiled = []  # compiling for real takes minutes: recorded, the steps stay eager
    monkeypatch.setattr(Transformer, "compile_steps", lambda model, *args: compiled.append(model))
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    notes = []
    first = tuning.fastest_configuration(str(checkpoint_folder), checkpoint, notes.append)
    forms = {label.split(" weights")[0] for label in first.ms_per_token}
    assert forms == ({"half", "dense"} if half_weights_available() else {"dense"})  # no GGUF file: no gguf form
    assert len(first.ms_per_token) == len(forms) * len(tuning.thread_counts()) + len(compiled)
    on_every_core = [ms for label, ms in first.ms_per_token.items() if f", {physical_cores()} thread" in label]
    assert first.ms_per_token[first.choice.label] <= min(on_every_core)  # fewer threads only where faster
    assert notes[0].startswith("measuring") and first.choice.label in notes[-1]

    again = tuning.fastest_configuration(str(checkpoint_folder), checkpoint)
    assert again == first and len(calls) == 1  # read back, not measured
    kept = list(tuning.tuning_folder().glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["choice"]["weights"] == first.choice.weights

    save_checkpoint(checkpoint_folder, seed=4)  # other weights in the same place
    tuning.fastest_configuration(str(checkpoint_folder), resolve_checkpoint(str(checkpoint_folder)))
    assert len(calls) == 2  # a changed checkpoint is measured anew


def test_compiled_steps_are_measured_only_where_dense_comes_close(
    checkpoint_folder, monkeypatch, threads_restored, quiet_machine
):
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


def made_tuning(checkpoint, choice: tuning.Choice, ms_per_token=None, **conditions) -> tuning.Tuning:
    """A measurement of checkpoint as measure() returns one, taken on a quiet machine unless conditions say else."""
    files = tuning.checkpoint_paths(checkpoint)
    quiet = {"load": 0.1, "others_share": 0.01, "spread": 0.02, "prefill_chunk_ms": [5.0, 6.0]}
    return tuning.Tuning(
        "tiny", "cpu", choice, ms_per_token or {}, "now", tuning.machine_key(), files, **{**quiet, **conditions}
    )


def fixed_tuning(monkeypatch, choice: tuning.Choice) -> None:
    monkeypatch.setattr(tuning, "measure", lambda spec, checkpoint: made_tuning(checkpoint, choice))


@pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")
def test_auto_settings_take_the_measured_choice(checkpoint_folder, monkeypatch, threads_restored):
    fixed_tuning(monkeypatch, tuning.Choice("half", 1))
    torch.set_num_threads(2)
    config = EngineConfig(mode="autoregressive")
    pipe = Pipeline.load(LoadOptions(target=str(checkpoint_folder), device="cpu", tune=True), config=config)
    assert pipe.target.weights == "half" and torch.get_num_threads() == 1

    torch.set_num_threads(2)
    pipe = Pipeline.load(LoadOptions(target=str(checkpoint_folder), device="cpu", tune=True, threads=2), config=config)
    assert pipe.target.weights == "half" and torch.get_num_threads() == 2  # threads the user set stay
    pipe = Pipeline.load(
        LoadOptions(target=str(checkpoint_folder), device="cpu", weights="dense", tune=True), config=config
    )
    assert pipe.target.weights == "dense"  # weights the user named stay

    monkeypatch.setenv(tuning.TUNING_ENV, "off")
    monkeypatch.setattr(tuning, "fastest_configuration", lambda *args: pytest.fail("measured with tuning off"))
    pipe = Pipeline.load(LoadOptions(target=str(checkpoint_folder), device="cpu", tune=True), config=config)
    assert pipe.target.weights == "half"  # the rule: half weights on an x86 CPU, nothing measured


def test_info_shows_the_kept_choice_and_when_and_how_busy(checkpoint_folder, monkeypatch, threads_restored):
    label = "dense weights, 1 thread, compile off"
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    fixed = made_tuning(checkpoint, tuning.Choice("dense", 1), {label: 1.5}, load=0.42, others_share=0.03)
    monkeypatch.setattr(tuning, "measure", lambda spec, checkpoint: fixed)
    tuning.fastest_configuration(str(checkpoint_folder), checkpoint)
    result = CliRunner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    assert "dense weights, 1 thread, compile off" in result.output
    assert "measured now, load average 0.42, other programs 3% of the CPU" in " ".join(result.output.split())
    facts = json.loads(CliRunner().invoke(app, ["info", "--json"]).output)
    assert facts["tuned"][0]["choice"] == {"weights": "dense", "threads": 1, "compiled": False}
    other_machine = tuning.tuning_folder() / "elsewhere.json"  # measured on another CPU, torch or version
    other_machine.write_text(json.dumps({**facts["tuned"][0], "machine": "another CPU"}))
    assert len(json.loads(CliRunner().invoke(app, ["info", "--json"]).output)["tuned"]) == 1


def test_decode_threads_are_fewer_than_the_cores_only_when_clearly_faster_every_time():
    assert tuning._decode_threads({1: [18.1, 18.3, 18.0], 2: [20.6, 20.5, 20.7]}) == 1  # 12% faster in each run
    assert tuning._decode_threads({1: [18.0, 25.0, 18.0], 2: [20.0, 20.0, 20.0]}) == 2  # not in every run
    assert tuning._decode_threads({1: [19.8, 19.7, 19.9], 2: [20.0, 20.0, 20.0]}) == 2  # within the margin
    assert tuning._decode_threads({1: [9.0, 9.0], 2: [8.0, 8.0], 4: [10.0, 10.0]}) == 2  # the fastest clear one


def busy_loops(count: int) -> list[subprocess.Popen]:
    """count processes that keep a core busy each, as a compiler next to the tool would."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(0.5)  # running before the measurement begins
    return loops


def test_a_measurement_under_load_is_not_kept_and_the_next_quiet_run_keeps_the_best(
    checkpoint_folder, monkeypatch, threads_restored
):
    monkeypatch.setattr(Transformer, "compile_steps", lambda model, *args: None)
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    notes = []
    loops = busy_loops(physical_cores())
    try:
        loaded_run = tuning.fastest_configuration(str(checkpoint_folder), checkpoint, notes.append)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert loaded_run.busy_reason is not None and "busy while measuring" in notes[-1]
    assert loaded_run.choice == tuning.rule_choice(checkpoint)  # the rule, every physical core
    assert not list(tuning.tuning_folder().glob("*.json"))  # nothing kept: the next run measures again

    cores = physical_cores()
    best = tuning.Choice(tuning.weight_forms(checkpoint)[0], cores)  # the most compact form on every core

    def decode_ms(engine, *args) -> float:  # a quiet machine's steady timings: the most compact form is fastest
        form = 1.0 + tuning.weight_forms(checkpoint).index(engine.target.weights)
        return form * (2.0 if torch.get_num_threads() < cores else 1.0)

    monkeypatch.setattr(tuning, "_decode_ms", decode_ms)
    monkeypatch.setattr(tuning, "others_share", lambda before, after: 0.0)
    quiet_run = tuning.fastest_configuration(str(checkpoint_folder), checkpoint, notes.append)
    assert quiet_run.choice == best and quiet_run.busy_reason is None
    assert tuning.remembered(checkpoint).choice == best  # kept for the runs after it


def test_prefill_runs_on_every_core_and_decoding_on_the_measured_threads(
    checkpoint_folder, monkeypatch, threads_restored
):
    if physical_cores() < 2:
        pytest.skip("one core: prefill and decoding threads cannot differ")
    fixed_tuning(monkeypatch, tuning.Choice("dense", 1))
    seen = []
    forward = Transformer.forward

    def recording_forward(model, *args, **kwargs):
        seen.append((kwargs.get("decoding", True), torch.get_num_threads()))
        return forward(model, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", recording_forward)
    config = EngineConfig(mode="autoregressive", max_new_tokens=4, ignore_eos=True)
    pipe = Pipeline.load(
        LoadOptions(target=str(checkpoint_folder), device="cpu", weights="auto", tune=True), config=config
    )
    pipe.generate_ids(list(range(1, 20)))
    assert {threads for decoding, threads in seen if not decoding} == {physical_cores()}
    assert {threads for decoding, threads in seen if decoding} == {1}

    seen.clear()  # threads the user set hold for prefill too
    torch.set_num_threads(1)
    pipe = Pipeline.load(LoadOptions(target=str(checkpoint_folder), device="cpu", tune=True, threads=1), config=config)
    pipe.generate_ids(list(range(1, 20)))
    assert {threads for _, threads in seen} == {1}


def test_a_run_much_slower_than_its_measurement_says_so(checkpoint_folder, monkeypatch, threads_restored):
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    kept = made_tuning(checkpoint, tuning.Choice("dense", 1), prefill_chunk_ms=[5.0, 6.0])
    note = tuning.slower_than_measured(kept, [0.010, 0.012, 0.004])
    assert "2.0x slower than when its set-up was measured (now)" in note
    assert "triforce cache clear --measurements" in note
    assert tuning.slower_than_measured(kept, [0.006, 0.006, 0.1]) is None  # its first chunks as measured
    assert tuning.slower_than_measured(kept, [0.5]) is None  # a prompt shorter than the measured prefill
    busy = made_tuning(checkpoint, tuning.Choice("dense", 2), prefill_chunk_ms=[5.0, 6.0], others_share=0.6)
    assert tuning.slower_than_measured(busy, [0.010, 0.012, 0.004]) is None  # not kept: no yardstick

    quick = made_tuning(checkpoint, tuning.Choice("dense", 1), prefill_chunk_ms=[1e-6])  # no run is this quick
    monkeypatch.setattr(tuning, "measure", lambda spec, checkpoint: quick)
    notes = []
    config = EngineConfig(mode="autoregressive", max_new_tokens=2)
    pipe = Pipeline.load(
        LoadOptions(target=str(checkpoint_folder), device="cpu", tune=True), config=config, status=notes.append
    )
    pipe.generate_ids(list(range(1, 20)))
    assert "slower than when its set-up was measured" in notes[-1]


def test_measurements_no_run_can_use_are_dropped(checkpoint_folder, monkeypatch, threads_restored):
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    fixed_tuning(monkeypatch, tuning.Choice("dense", 1))
    tuning.fastest_configuration(str(checkpoint_folder), checkpoint)
    earlier_layout = tuning.tuning_folder() / "earlier.json"  # without the files it was measured on
    earlier_layout.write_text(json.dumps({"target": "model", "choice": {"weights": "dense", "threads": 1}}))
    assert len(tuning.remembered_tunings()) == 1 and not earlier_layout.exists()
    assert "measurements in" in CliRunner().invoke(app, ["cache", "list"]).output

    for file in checkpoint_folder.iterdir():  # the checkpoint is deleted (a temporary folder, say)
        file.unlink()
    checkpoint_folder.rmdir()
    listed = CliRunner().invoke(app, ["cache", "list"])
    assert listed.exit_code == 0 and "measurements in" not in listed.output  # nothing left to list
    assert tuning.remembered_tunings() == [] and not list(tuning.tuning_folder().glob("*.json"))


# ms per token of a candidate's repeats, in the order they are timed: a quiet but jittery virtual machine slows a
# few runs by 25-35%; a program busy on one of the cores slows most of them
JITTER = [10.0, 13.0, 10.2, 10.1, 13.5, 10.3, 10.1]
LOAD = [10.0, 17.0, 19.0, 12.0, 18.0, 20.0, 16.0]


def patterned_decode_ms(checkpoint, pattern: list[float]):
    """A timer for tuning._decode_ms: each candidate's n-th run takes pattern[n], the most compact form and every
    core fastest (half the time of the others), so the choice and its spread are known."""
    cores, forms, runs = physical_cores(), tuning.weight_forms(checkpoint), {}

    def decode_ms(engine, *args) -> float:
        key = (engine.target.weights, torch.get_num_threads())
        runs[key] = runs.get(key, -1) + 1
        slower = 1.0 + (forms.index(key[0]) > 0) + (key[1] < cores)
        return slower * pattern[runs[key] % len(pattern)]

    return decode_ms


@pytest.mark.parametrize(("pattern", "kept"), [(JITTER, True), (LOAD, False)], ids=["jitter", "load"])
def test_a_jittery_quiet_machine_keeps_the_measurement_and_a_loaded_one_does_not(
    checkpoint_folder, monkeypatch, threads_restored, pattern, kept
):
    monkeypatch.setattr(Transformer, "compile_steps", lambda model, *args: None)
    monkeypatch.setattr(tuning, "others_share", lambda before, after: None)  # the timings alone tell
    checkpoint = resolve_checkpoint(str(checkpoint_folder))
    monkeypatch.setattr(tuning, "_decode_ms", patterned_decode_ms(checkpoint, pattern))
    notes = []
    measured = tuning.fastest_configuration(str(checkpoint_folder), checkpoint, notes.append)
    best = tuning.Choice(tuning.weight_forms(checkpoint)[0], physical_cores())
    assert (tuning.remembered(checkpoint) is not None) == kept == (measured.busy_reason is None)
    if kept:
        assert measured.choice == best and measured.spread == pytest.approx(0.02)
        assert measured.ms_per_token[best.label] == 10.0  # the fastest run
    else:
        assert measured.spread == pytest.approx(0.7) and "busy while measuring" in notes[-1]
        assert "the median of repeated timings lay 70% above the fastest" in notes[-1]


def test_the_cpu_name_tells_generations_apart(tmp_path):
    """Two virtual machines that both call their CPU "AMD EPYC" but are of different generations get different
    names, so a measurement kept on one is never served on the other (measurements.machine_key)."""
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
    block += "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f\n\n"
    names = []
    for family, model in ((25, 17), (26, 2)):
        cpuinfo = tmp_path / f"cpuinfo-{family}"
        cpuinfo.write_text("".join(block.format(n=n, family=family, model=model) for n in range(2)))
        names.append(cpu_description(cpuinfo))
    assert names == [
        ("AMD EPYC (family 25, model 17)", ["avx2", "fma", "avx512f"]),
        ("AMD EPYC (family 26, model 2)", ["avx2", "fma", "avx512f"]),
    ]
