"""The prices of the costed speculation-length policy: forwards priced from bytes, FLOPs and the machine's rates."""

import dataclasses
import itertools
import json
import math

import torch
from helpers import full_cache_for, make_model, rich_model
from triforce_cli.cache import RetrievalCache, StreamingCache

from triforce_cli.decoding import step_costs
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.speculative import ModelTier, Tier
from triforce_cli.decoding.step_costs import NOMINAL, MachineBalance, forward_seconds, linear_weights, machine_balance
from triforce_cli.decoding.tuning import machine_key
from triforce_cli.plan.rates import MachineRates, rates_path
from triforce_cli.runtime.model import weight_bytes

READ_ONLY = MachineBalance(read_bandwidth=1e9, flops=math.inf, layer_overhead_s=0.0, transfer_bandwidth=1e9)


def prefilled(length: int):
    model = rich_model(0).model
    cache = full_cache_for(model, capacity=length + 16)
    model(torch.randint(0, 32, (length,)), 0, cache)
    return model, cache


def test_a_read_bound_forward_costs_its_weights_and_the_keys_it_reads():
    model, full = prefilled(200)
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 200 * full.keys.element_size()
    weights = weight_bytes(model.model.layers, model.model.norm, model.lm_head)
    assert forward_seconds(model, full, 1, READ_ONLY) == (weights + kv) / 1e9
    assert forward_seconds(model, full, 5, READ_ONLY) == forward_seconds(model, full, 1, READ_ONLY)


def test_each_verified_token_adds_its_arithmetic():
    model, full = prefilled(200)
    balance = MachineBalance(read_bandwidth=1e9, flops=1e9, layer_overhead_s=1e-4, transfer_bandwidth=1e9)
    prices = [forward_seconds(model, full, n, balance) for n in range(1, 6)]
    cfg = model.config
    per_token = (2 * linear_weights(model) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 200) / 1e9
    assert all(math.isclose(b - a, per_token) for a, b in itertools.pairwise(prices))


def test_the_first_token_pays_the_work_once_a_forward_and_the_second_saves_a_share_of_its_own():
    model, full = prefilled(200)
    cfg = model.config
    per_token = (2 * linear_weights(model) + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 200) / 1e9
    once = (3 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 200 + 0.5 * linear_weights(model)) / 1e9
    work = MachineBalance(1e15, 1e9, 0.0, 1e9, forward_overhead_s=1e-3, key_work=3, weight_work=0.5)
    prices = [forward_seconds(model, full, n, work) for n in range(1, 5)]
    assert math.isclose(prices[0], 1e-3 + once + per_token)  # bound by that work, not by the (instant) read
    assert all(math.isclose(b - a, per_token) for a, b in itertools.pairwise(prices))  # each further token's own
    shared = dataclasses.replace(work, second_token_share=0.25)
    prices = [forward_seconds(model, full, n, shared) for n in range(1, 5)]
    assert math.isclose(prices[1] - prices[0], 0.75 * per_token)  # the second token saves a quarter
    assert all(math.isclose(b - a, per_token) for a, b in itertools.pairwise(prices[1:]))  # the third on, nothing
    slow_read = dataclasses.replace(work, read_bandwidth=1e6)  # a read far longer than any work
    assert math.isclose(
        forward_seconds(model, full, 2, slow_read) - forward_seconds(model, full, 1, slow_read), per_token
    )


def test_the_lower_tiers_cost_less_than_the_full_cache():
    model, full = prefilled(200)
    retrieval = RetrievalCache(full, budget=32, chunk_size=8, recent_capacity=16)
    cfg = model.config
    streaming = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16, 8, full.keys.dtype)
    balance = NOMINAL["cpu"]
    full_price = forward_seconds(model, full, 1, balance)
    assert forward_seconds(model, streaming, 1, balance) < forward_seconds(model, retrieval, 1, balance) < full_price


def retrieval_tier(model, cache: RetrievalCache) -> ModelTier:
    return ModelTier(
        name=Tier.RETRIEVAL, model=model, cache=cache, sampling=SamplingConfig(), generator=None, refresh_interval=4
    )


def test_a_retrieval_tiers_choice_of_chunks_costs_its_copies_its_summaries_and_a_fixed_cost_a_head():
    """One choice: the chosen keys and values read and written, the summaries of the prompt's chunks scored at
    summary_work passes, and select_overhead_s per layer and KV head; more chunks in the prompt cost more; a tier
    without chunks to choose (the drafter's) costs none, and its verifications come one to a choice."""
    model, full = prefilled(200)
    retrieval = RetrievalCache(full, budget=32, chunk_size=8, recent_capacity=16)
    tier = retrieval_tier(model, retrieval)
    cfg = model.config
    balance = MachineBalance(1e9, 1e12, 0.0, 1e9, select_overhead_s=1e-4, summary_work=12)
    chosen = 2 * cfg.num_layers * cfg.num_kv_heads * 32 * cfg.head_dim * retrieval.keys.element_size()
    summaries = cfg.num_layers * cfg.num_kv_heads * (200 // 8) * cfg.head_dim * retrieval.chunk_keys.element_size()
    expected = cfg.num_layers * cfg.num_kv_heads * 1e-4 + (2 * chosen + 12 * summaries) / 1e9
    assert math.isclose(step_costs.selection_seconds(tier, balance), expected)
    assert step_costs.refresh_interval(tier) == 4
    longer_model, longer = prefilled(400)
    longer_tier = retrieval_tier(longer_model, RetrievalCache(longer, 32, 8, 16))
    assert step_costs.selection_seconds(longer_tier, balance) > step_costs.selection_seconds(tier, balance)
    streaming = StreamingCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16, 8, full.keys.dtype)
    drafter = ModelTier(name=Tier.DRAFTER, model=model, cache=streaming, sampling=SamplingConfig(), generator=None)
    assert step_costs.selection_seconds(drafter, balance) == 0.0 and step_costs.refresh_interval(drafter) == 1


def test_the_rates_plan_keeps_price_the_cpu_else_nominal_figures(monkeypatch, tmp_path):
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path))
    assert machine_balance("cpu") == NOMINAL["cpu"]  # none kept
    kept = MachineRates("Test CPU", machine_key(), 5e9, 7e10, None, None, 2, "now", None, None)
    rates_path().parent.mkdir(parents=True, exist_ok=True)
    rates_path().write_text(json.dumps(dataclasses.asdict(kept)))  # as plan.rates.machine_rates keeps them
    balance = machine_balance("cpu")
    assert (balance.read_bandwidth, balance.flops) == (5e9, 7e10)  # no FMA peak kept: the matrix product's rate
    assert balance.arithmetic_efficiency == step_costs.CPU_ARITHMETIC_EFFICIENCY
    with_peak = dataclasses.replace(kept, peak_flops=2e11, core_peak_flops=1e11)
    rates_path().write_text(json.dumps(dataclasses.asdict(with_peak)))
    balance = machine_balance("cpu")  # the FMA peak, which the minute moves less than a matrix product
    assert (balance.flops, balance.arithmetic_efficiency) == (2e11, step_costs.CPU_PEAK_EFFICIENCY)
    assert machine_balance("cuda") == NOMINAL["cuda"]  # the CPU's rates are no GPU's
    another = dataclasses.replace(kept, machine="another machine")
    rates_path().write_text(json.dumps(dataclasses.asdict(another)))
    assert machine_balance("cpu") == NOMINAL["cpu"]


def test_an_offloaded_full_cache_costs_at_least_its_transfer(monkeypatch):
    model, full = prefilled(200)
    slow_link = MachineBalance(read_bandwidth=1e12, flops=1e15, layer_overhead_s=0.0, transfer_bandwidth=1e6)
    on_chip = forward_seconds(model, full, 1, slow_link)
    monkeypatch.setattr(full, "stream", object())  # offloaded: its keys and values stream from host memory
    cfg = model.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 200 * full.keys.element_size()
    assert forward_seconds(model, full, 1, slow_link) == kv / 1e6 > on_chip
    assert step_costs.attended_positions(full) == 200


def test_the_weights_a_forward_reads_are_counted_again_after_a_module_change():
    """weight_bytes_read keeps its count between generations and counts again once a module is replaced."""
    model = make_model(seed=3, num_layers=1, tie_word_embeddings=False).loaded.model  # its own: it is changed
    counted = model.weight_bytes_read()
    assert counted == weight_bytes(model.model.layers, model.model.norm, model.lm_head)
    assert model.weight_bytes_read() == counted
    hidden, vocab = model.lm_head.in_features, model.lm_head.out_features
    model.lm_head = torch.nn.Linear(hidden, 2 * vocab, bias=False)  # twice the rows: hidden * vocab floats more
    assert model.weight_bytes_read() == counted + 4 * hidden * vocab
