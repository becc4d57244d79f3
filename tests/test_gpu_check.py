"""scripts/gpu_check.py's pieces on the CPU (tests/test_gpu_path.py runs its engine runs end to end): the memory
limit on an unindexed CUDA device, the random model built in its dtype without a float32 copy, the context clamp,
what a run's failure is recorded as, figures appended as they come, the profile's files, and no import of a package
the check does not use."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from memory_accounting import MemoryLedger

from triforce_cli.errors import ConfigError
from triforce_cli.plan.model import ModelShape

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_script()

SMALL = ModelShape(  # large enough that the weights outweigh the buffers beside them
    name="small",
    num_layers=4,
    hidden_size=256,
    intermediate_size=768,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=4096,
    tie_word_embeddings=False,
)


def test_the_memory_limit_names_the_current_device_by_index(monkeypatch):
    """torch.cuda.set_per_process_memory_fraction refuses a device without an index: the limit names the current
    one, as a share of its memory."""
    held = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda share, device: held.append((share, device))
    )
    gpu_check.hold_memory(torch.device("cuda"), 24)
    gpu_check.hold_memory(torch.device("cuda"), 0)  # 0: the whole card, nothing set
    gpu_check.hold_memory(torch.device("cpu"), 24)
    assert held == [(0.3, torch.device("cuda", 0))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_random_model_is_built_in_its_dtype_without_a_float32_copy(dtype):
    """Built on the meta device in dtype, then materialised: the most it ever holds is its own weights (and the
    float32 RoPE frequencies), never a float32 copy of a bfloat16 model's weights beside them."""
    with MemoryLedger() as ledger:
        loaded = gpu_check.random_model(SMALL, torch.device("cpu"), dtype)
    weights = sum(p.numel() for p in loaded.model.parameters()) * dtype.itemsize
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    assert loaded.model.inv_freq.dtype == torch.float32 and loaded.model.inv_freq.device.type == "cpu"
    assert weights <= ledger.peak("cpu") < 1.1 * weights
    assert all(p.std() > 0.01 for p in loaded.model.parameters() if p.dim() == 2)


def test_a_context_is_clamped_to_the_models_positions_less_the_new_tokens():
    assert gpu_check.fitted_context(131072, 32) == 131040
    assert gpu_check.fitted_context(32768, 32) == 32768


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (ConfigError("`budget` too large"), "refused"),
        (torch.OutOfMemoryError("CUDA out of memory.\nmore"), "out of memory"),
        (gpu_check.RunTimeout("took over 5 s"), "timeout"),
        (RuntimeError("CUDA error: an illegal memory access"), "error"),
    ],
)
def test_a_runs_failure_is_recorded_as_its_outcome(error, outcome):
    recorded, detail = gpu_check.failure(error)
    assert recorded == outcome and "\n" not in detail


def test_a_run_past_its_time_limit_times_out_and_the_next_runs():
    with pytest.raises(gpu_check.RunTimeout), gpu_check.time_limit(1):
        while True:
            pass
    with gpu_check.time_limit(1):  # the alarm was cleared
        pass


def test_figures_are_appended_as_they_come(tmp_path):
    results = gpu_check.Results(tmp_path / "out", "runs")
    results.add({"context": 1}, "first")
    assert (tmp_path / "out" / "runs.jsonl").read_text() == '{"context": 1}\n'  # on disk before the next
    results.add({"context": 2}, "second")
    results.note("done")
    lines = (tmp_path / "out" / "runs.jsonl").read_text().splitlines()
    assert [json.loads(line)["context"] for line in lines] == [1, 2]
    assert (tmp_path / "out" / "summary.txt").read_text() == "[runs] first\n[runs] second\n[runs] done\n"


def test_the_floors_are_the_bytes_and_flops_at_the_measured_rates():
    hardware = SimpleNamespace(bandwidth=1e12, flops=1e14)
    shape = gpu_check.TINY
    weights = (shape.num_layers * shape.layer_parameters + shape.output_parameters) * 2
    bandwidth, flops = gpu_check.step_floors(shape, 4, 1000, 2, hardware)
    assert bandwidth == (weights + shape.kv_elements(1000) * 2) / 1e12
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * 1000 * 4
    assert flops == (weights * 4 + attention) / 1e14  # two FLOPs per weight per token, bytes = 2 per weight
    assert gpu_check.prefill_flops(shape, 2048) > 2 * gpu_check.prefill_flops(shape, 1024)  # attention grows as T^2


def test_the_profile_writes_its_tables_and_step_costs(tmp_path):
    """On the CPU: a host-time table of the eager steps (the default there, profiled once), the synchronisation
    report, and a step cost for every tier and token count."""
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "profile", "--device", "cpu"]
    command += ["--shape", "tiny", "--context", "512", "--prompt-tokens", "32", "--new-tokens", "3"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "aten::" in (tmp_path / "profile-eager-by-host-time.txt").read_text()
    assert (tmp_path / "sync-warnings-eager.txt").exists()
    records = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    costs = [(r["tier"], r["tokens"]) for r in records if "tier" in r]
    tiers = ("full", "retrieval", "drafter")
    assert costs == [(tier, tokens) for tier in tiers for tokens in gpu_check.STEP_TOKENS]
    assert all(r["ms"] > 0 and r["bandwidth_floor_ms"] > 0 for r in records if "tier" in r)


def test_the_check_imports_no_package_it_does_not_use():
    """The GPU machine may lack the web stack, gguf and the test extra: the check's script and the CLI it runs
    import without them."""
    blocked = ("openai", "fastapi", "uvicorn", "starlette", "gguf", "llama_cpp", "flash_attn", "scipy", "matplotlib")
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r})); import runpy; "
        f"runpy.run_path({str(ROOT / 'scripts' / 'gpu_check.py')!r}, run_name='check'); "
        "import triforce_cli.cli.app"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
