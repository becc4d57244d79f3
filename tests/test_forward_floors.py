"""The floors of `triforce bench --forward-costs` (bench.forward_costs.ForwardFloor): the bytes and FLOPs of a forward
counted exactly for a known shape, and the rates they are divided by (plan.rates), measured once, kept beside the
measured set-ups and shown by `triforce info`."""

import dataclasses
import json

import pytest
import torch
from helpers import llama_config
from triforce_cli.cache import FullCache, RetrievalCache
from triforce_cli.kernels import half_weights_available
from typer.testing import CliRunner

from triforce_cli.bench.forward_costs import ForwardCost, attended, forward_floor, forward_weight_bytes
from triforce_cli.cli.app import app
from triforce_cli.decoding import tuning
from triforce_cli.decoding.stats import as_record
from triforce_cli.plan import measure, rates
from triforce_cli.runtime.half_weights import use_half_weights
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.native import kernel_error

# llama_config's shape: 2 layers, hidden 32, MLP 48, 4 query heads and 2 KV heads of 8, vocabulary 32, no biases
LINEAR_WEIGHTS = 32 * (32 + 2 * 16) + 32 * 32 + 3 * 32 * 48  # q, k, v, o and the MLP of one layer: 7,680
LAYER_BYTES = 4 * (LINEAR_WEIGHTS + 2 * 32)  # float32, with its two norms
OUTPUT_BYTES = 4 * (32 + 32 * 32)  # the final norm and the output layer
ROW_BYTES = 4 * 32  # one row of the embedding table
CONTEXT, TOKENS = 40, 3
RATES = rates.MachineRates("Test CPU", tuning.machine_key(), 1e9, 5e9, 1e10, 5e9, 2, "now", 0.1, 0.01)


def prefilled(tied: bool = False) -> tuple[Transformer, FullCache]:
    """The tiny model and its full cache holding CONTEXT positions."""
    torch.manual_seed(0)
    model = Transformer.from_hf_config(llama_config(tie_word_embeddings=tied)).eval()
    cache = FullCache(2, 2, 8, 64, torch.float32)
    with torch.inference_mode():
        model(torch.arange(CONTEXT) % 32, 0, cache, num_logits=1)
    return model, cache


def test_a_full_cache_forward_reads_every_weight_and_position_and_computes_every_pair():
    model, full = prefilled()
    floor = forward_floor(model, full, CONTEXT, TOKENS, RATES)
    assert floor.weight_bytes == 2 * LAYER_BYTES + OUTPUT_BYTES + TOKENS * ROW_BYTES
    positions = 2 * (CONTEXT + TOKENS)  # both layers: the context and the new tokens
    assert floor.kv_bytes == positions * 2 * 2 * 8 * 4  # keys and values of 2 KV heads of 8, float32
    pairs = 2 * sum(CONTEXT + row + 1 for row in range(TOKENS))  # the causal mask's (query, key) pairs
    assert floor.attention_flops == 4 * 4 * 8 * pairs
    assert floor.linear_flops == 2 * TOKENS * (2 * LINEAR_WEIGHTS + 32 * 32)
    assert floor.read_ms == pytest.approx(1e3 * (floor.weight_bytes + floor.kv_bytes) / 1e9)
    assert floor.arithmetic_ms == pytest.approx(1e3 * (floor.linear_flops + floor.attention_flops) / 1e10)
    assert floor.bound == "read" and floor.ms == floor.read_ms
    slow_arithmetic = forward_floor(model, full, CONTEXT, TOKENS, dataclasses.replace(RATES, peak_flops=1e8))
    assert slow_arithmetic.bound == "arithmetic" and slow_arithmetic.ms == slow_arithmetic.arithmetic_ms
    no_peak = forward_floor(model, full, CONTEXT, TOKENS, dataclasses.replace(RATES, peak_flops=None))
    assert no_peak.arithmetic_ms == pytest.approx(1e3 * (floor.linear_flops + floor.attention_flops) / 5e9)


def test_keys_and_values_count_at_the_cache_element_size_and_a_tied_table_once():
    model, _ = prefilled(tied=True)
    half_cache = FullCache(2, 2, 8, 64, torch.float16)
    half_cache.length = CONTEXT  # what it holds does not matter, only how many positions and in what dtype
    floor = forward_floor(model, half_cache, CONTEXT, TOKENS, RATES)
    assert floor.kv_bytes == 2 * (CONTEXT + TOKENS) * 2 * 2 * 8 * 2  # float16: 2 bytes an element
    assert floor.weight_bytes == 2 * LAYER_BYTES + OUTPUT_BYTES  # the output layer reads the whole table


@pytest.mark.skipif(not half_weights_available(), reason="torch build without fbgemm")
def test_weights_count_as_stored():
    model, _ = prefilled()
    use_half_weights(model)  # the linears' weights in float16, the norms and the embedding table in float32
    half_layer = 2 * LINEAR_WEIGHTS + 4 * 2 * 32
    expected = 2 * half_layer + 4 * 32 + 2 * 32 * 32 + TOKENS * ROW_BYTES
    assert forward_weight_bytes(model, TOKENS) == expected


def test_a_retrieval_cache_forward_reads_its_chunks_and_recent_positions():
    model, full = prefilled()
    retrieval = RetrievalCache(full, 16, 8, 8 + TOKENS)
    retrieval.select_chunks()  # every complete chunk of the 40 positions selected from: none recent
    floor = forward_floor(model, retrieval, CONTEXT, TOKENS, RATES)
    assert floor.kv_bytes == 2 * (16 + TOKENS) * 2 * 2 * 8 * 4
    assert floor.attention_flops == 4 * 4 * 8 * 2 * sum(16 + row + 1 for row in range(TOKENS))
    assert floor.weight_bytes == forward_floor(model, full, CONTEXT, TOKENS, RATES).weight_bytes


def test_a_sliding_window_limits_what_a_full_cache_layer_must_read():
    assert attended(43, 3, None) == (43, 41 + 42 + 43)
    assert attended(43, 3, 8) == (10, 3 * 8)  # the window's last 7 keys before the new rows, and the 3 new ones
    assert attended(5, 3, 8) == (5, 3 + 4 + 5)  # a window longer than the view
    model, full = prefilled()
    model.config = dataclasses.replace(model.config, sliding_windows=(8, None))
    floor = forward_floor(model, full, CONTEXT, TOKENS, RATES)
    assert floor.kv_bytes == (10 + CONTEXT + TOKENS) * 2 * 2 * 8 * 4


def test_cost_over_floor_and_its_record():
    model, full = prefilled()
    floor = forward_floor(model, full, CONTEXT, TOKENS, RATES)
    cost = ForwardCost("p", CONTEXT, "full", TOKENS, [3 * floor.ms, 2 * floor.ms, 4 * floor.ms], floor)
    assert cost.over_floor == pytest.approx(3.0)
    assert ForwardCost("p", CONTEXT, "full", TOKENS, [1.0]).over_floor is None  # no rates: no floor
    record = as_record(cost)
    assert record["over_floor"] == pytest.approx(3.0)
    assert record["floor"]["bound"] == "read" and record["floor"]["kv_bytes"] == floor.kv_bytes


@pytest.fixture
def measured_rates(tmp_path, monkeypatch):
    """A cache folder of its own, and rates 'measured' as fixed figures on a quiet machine; the calls counted."""
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(rates, "read_bandwidth", lambda: calls.append("read") or 12.5e9)
    monkeypatch.setattr(rates, "matmul_flops", lambda: calls.append("flops") or 150e9)
    # 100 GFLOP/s a core, on as many cores as torch runs threads
    monkeypatch.setattr(rates, "peak_flops", lambda: calls.append("peak") or 100e9 * torch.get_num_threads())
    monkeypatch.setattr(rates, "physical_cores", lambda: 2)
    monkeypatch.setattr(rates, "others_share", lambda before, after: 0.02)
    return calls


def test_rates_are_measured_once_kept_beside_the_set_ups_and_shown_by_info(measured_rates):
    notes = []
    first = rates.machine_rates(notes.append)
    assert (first.read_bandwidth, first.flops, first.peak_flops, first.core_peak_flops) == (12.5e9, 150e9, 200e9, 100e9)
    assert first.arithmetic_rate == 200e9 and notes[0].startswith("measuring")
    again = rates.machine_rates(notes.append)
    assert again == first and measured_rates == ["read", "flops", "peak", "peak"] and len(notes) == 1  # read back
    assert tuning.remembered_tunings() == [] and rates.rates_path().exists()  # no set-up, and not dropped as one

    shown = " ".join(CliRunner().invoke(app, ["info"]).output.split())
    assert "read bandwidth 12.5 GB/s, float32 FMA peak 200.0 GFLOP/s, float32 matrix product 150.0 GFLOP/s" in shown
    assert "other programs 2% of the CPU" in shown
    assert json.loads(CliRunner().invoke(app, ["info", "--json"]).output)["rates"]["read_bandwidth"] == 12.5e9

    assert CliRunner().invoke(app, ["cache", "clear", "--measurements"]).exit_code == 0
    assert rates.remembered_rates() is None
    assert "not measured yet" in CliRunner().invoke(app, ["info"]).output


def test_rates_measured_on_a_busy_machine_serve_the_run_and_are_not_kept(measured_rates, monkeypatch):
    monkeypatch.setattr(rates, "others_share", lambda before, after: 0.6)
    notes = []
    busy = rates.machine_rates(notes.append)
    assert busy.read_bandwidth == 12.5e9 and "not kept" in notes[-1]
    assert rates.remembered_rates() is None


def test_rates_measured_while_something_outside_took_the_cores_are_not_kept(measured_rates, monkeypatch):
    """Two cores computing what one does: another virtual machine on the host had one, which no process here shows."""
    monkeypatch.setattr(rates, "peak_flops", lambda: 110e9)
    notes = []
    shared = rates.machine_rates(notes.append)
    assert shared.peak_flops == 110e9 and rates.remembered_rates() is None
    assert "its 2 cores computed 50% of 2 times one core's rate" in notes[-1] and "not kept" in notes[-1]


def test_rates_of_another_machine_are_measured_anew(measured_rates):
    rates.machine_rates()
    record = json.loads(rates.rates_path().read_text())
    rates.rates_path().write_text(json.dumps({**record, "machine": "another CPU"}))
    assert rates.remembered_rates() is None
    rates.machine_rates()
    assert measured_rates == ["read", "flops", "peak", "peak"] * 2


def test_rates_kept_before_the_fma_peak_was_measured_are_measured_anew(measured_rates):
    rates.machine_rates()
    record = json.loads(rates.rates_path().read_text())
    del record["peak_flops"]
    rates.rates_path().write_text(json.dumps(record))
    assert rates.remembered_rates() is None


LANES = {"avx512": 16, "avx2": 8, "scalar": 1}


@pytest.mark.skipif(kernel_error() is not None, reason="the CPU extension is not built here")
def test_the_fma_peak_counts_every_lane_of_the_body_that_runs(body):
    """Each body's FMA chains, counted by its lanes: a vector body's rate over the plain one's is near its lane
    count (every lane an FMA a cycle or two), so a miscounted lane or a chain the compiler dropped shows."""
    rate = measure.peak_flops(1 << 16)
    torch.ops.triforce_cpu.use_isa("scalar")
    plain = measure.peak_flops(1 << 16)
    torch.ops.triforce_cpu.use_isa(body)
    assert 0 < plain and LANES[body] / 3 <= rate / plain <= 3 * LANES[body]
