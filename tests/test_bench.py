"""`triforce bench`: rows of every mode and peer on a tiny saved checkpoint, the seconds a user waits, --ignore-eos,
the report files, the llama.cpp peer's wiring (with a stand-in module: llama-cpp-python is optional), prompts cut to
a context length (chat turns too), the ratios over several prompts, and one-line errors."""

import csv
import io
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from helpers import CHAT_TEMPLATE, fixed_drafts_at_least, random_prompt, save_checkpoint, save_tokenizer
from rich.console import Console
from triforce_cli.cache import kv_dtype
from triforce_cli.kernels import half_weights_available
from typer.testing import CliRunner

import triforce_cli.bench.llama_cpp
import triforce_cli.bench.runner
import triforce_cli.plan.rates
import triforce_cli.runtime.environment
from triforce_cli.bench.forward_costs import MIN_ROUNDS, forward_weight_bytes
from triforce_cli.bench.llama_cpp import (
    LLAMA_CPP_PEER,
    LlamaCppPeer,
    llama_cpp_rope_kwargs,
    llama_cpp_sampling_kwargs,
)
from triforce_cli.bench.peers import HF_PEERS, TimedRun
from triforce_cli.bench.runner import (
    ALL_MODES,
    DEFAULT_MODES,
    Bench,
    BenchConfig,
    BenchRow,
    default_modes,
    over_prompts,
)
from triforce_cli.cli.app import app
from triforce_cli.cli.render import bench_tables, forward_cost_table
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.pipeline import Pipeline
from triforce_cli.decoding.prefill import DRAFTER_READS
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.setup import LoadOptions
from triforce_cli.decoding.stats import as_record
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.plan.rates import MachineRates
from triforce_cli.runtime.context_window import extend_context
from triforce_cli.runtime.prompts import cut_prompt, encode_prompt

CONTEXT = 48
NEW_TOKENS = 6
FAST = {"budgets": (16,), "chunk_sizes": (4,), "repeats": 1, "warmup": 0, "max_new_tokens": NEW_TOKENS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bench") / "tiny"
    save_checkpoint(folder, seed=5, max_position_embeddings=128)
    return folder


@pytest.fixture(scope="module")
def pipe(checkpoint) -> Pipeline:
    config = EngineConfig(gamma1=2, gamma2=4, max_new_tokens=NEW_TOKENS)
    return Pipeline.load(LoadOptions(target=str(checkpoint), dtype="float32", device="cpu"), config=config)


def rendered(rows: list[BenchRow]) -> str:
    """The bench tables as an 80-column terminal shows them."""
    console = Console(width=80, record=True, file=io.StringIO())
    for table in bench_tables(rows):
        console.print(table)
    return console.export_text()


def line_of(text: str, mode: str) -> str:
    """The first table line of mode's row in text."""
    return next(line for line in text.splitlines() if line.startswith(f"│ {mode} "))


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(f"w{i}" for i in random_prompt(2 * CONTEXT, 30, seed=9)))
    return path


def test_every_mode_and_transformers_peer_matches_greedy_autoregressive(pipe):
    modes = tuple(m for m in ALL_MODES if m != LLAMA_CPP_PEER)
    rows = Bench(pipe, BenchConfig(modes=modes, contexts=(CONTEXT,), **FAST)).run_context(
        "p", random_prompt(CONTEXT, 30, seed=1)
    )
    by_mode = {row.mode: row for row in rows}
    assert set(by_mode) == set(modes)
    assert all(row.matches_autoregressive for row in rows), [(r.mode, r.matches_autoregressive) for r in rows]
    assert by_mode["autoregressive"].speedup_vs_autoregressive == 1.0
    assert by_mode["hf"].speedup_vs_hf == 1.0
    assert all(row.median_ms > 0 and row.context == CONTEXT for row in rows)
    assert by_mode["autoregressive"].acceptance == []
    tiers = [(a["proposer"], a["verifier"]) for a in by_mode["triforce"].acceptance]
    # the costed policy (bench's default) also weighs the drafter's tokens against the target directly
    assert tiers == [("retrieval", "target"), ("drafter", "retrieval"), ("drafter", "target")]
    # this pipeline has no separate drafter, so the *-ngram modes draft with the n-gram alone (test_ngram.py has
    # the n-gram before a model drafter)
    assert [(a["proposer"], a["verifier"]) for a in by_mode["streaming-ngram"].acceptance] == [("ngram", "target")]
    assert by_mode["triforce"].budget == 16 and by_mode["triforce"].chunk_size == 4
    # the costed policy's priced step costs come with each adaptive tier, as generate --json gives them
    assert by_mode["autoregressive"].tier_costs == []
    costs = {c["tier"]: c for c in by_mode["triforce"].tier_costs}
    assert "target" in costs and all(ms > 0 for ms in costs["target"]["step_ms"].values())


def test_with_a_separate_drafter_only_the_ngram_modes_put_the_ngram_first(checkpoint, tmp_path):
    drafter = tmp_path / "drafter"
    save_checkpoint(drafter, seed=6, max_position_embeddings=128, num_layers=1)
    config = EngineConfig(gamma1=2, gamma2=4, max_new_tokens=NEW_TOKENS)
    pipe = Pipeline.load(
        LoadOptions(target=str(checkpoint), draft=str(drafter), dtype="float32", device="cpu"), config=config
    )
    modes = ("streaming", "triforce", "ngram", "streaming-ngram", "triforce-ngram")
    config = BenchConfig(modes=modes, contexts=(CONTEXT,), gamma_policies=("fixed",), **FAST)
    rows = Bench(pipe, config).run_context("p", random_prompt(CONTEXT, 30, seed=1))
    proposers = {row.mode: {a["proposer"] for a in row.acceptance} for row in rows}
    assert proposers == {
        "streaming": {"drafter"},
        "triforce": {"retrieval", "drafter"},
        "ngram": {"ngram"},
        "streaming-ngram": {"ngram/drafter"},
        "triforce-ngram": {"retrieval", "ngram/drafter"},
    }


def test_a_drafter_step_stands_beside_its_floor_on_the_cache_the_prompt_leaves_it(checkpoint, tmp_path):
    drafter_folder = tmp_path / "drafter"
    save_checkpoint(drafter_folder, seed=6, max_position_embeddings=128, num_layers=1)
    config = EngineConfig(gamma1=2, gamma2=4, sink_tokens=4, draft_window=16, max_new_tokens=NEW_TOKENS)
    options = LoadOptions(target=str(checkpoint), draft=str(drafter_folder), dtype="float32", device="cpu")
    pipe = Pipeline.load(options, config=config)
    rates = MachineRates("Test CPU", "key", 1e10, 1e11, None, None, 2, "now", None, None)
    runner = Bench(pipe, BenchConfig(modes=("hf",), contexts=(CONTEXT,), forward_tokens=(1,), **FAST), rates)
    runner.run_context("p", random_prompt(CONTEXT, 30, seed=3))
    full, _, step = runner.forward_costs
    assert (step.cache, step.tokens, step.context, len(step.ms)) == ("drafter", 1, CONTEXT, MIN_ROUNDS)
    drafter = pipe.drafter.model
    assert step.floor.weight_bytes == forward_weight_bytes(drafter, 1) < full.floor.weight_bytes
    # in its one layer, its 4 sinks, the last DRAFTER_READS windows of 16 its prefill wrote and the new token; the
    # target's full cache holds every position
    cfg = drafter.config
    element = kv_dtype(torch.device("cpu"), torch.float32).itemsize  # the caches' float16
    assert step.floor.kv_bytes == (4 + DRAFTER_READS * 16 + 1) * 2 * cfg.num_kv_heads * cfg.head_dim * element
    assert full.floor.kv_bytes > step.floor.kv_bytes
    assert step.over_floor == step.median_ms / step.floor.ms and step.moment_bandwidth == full.moment_bandwidth
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(forward_cost_table(runner.forward_costs))
    assert "drafter" in console.export_text()


def test_repeats_and_sweeps_make_one_row_per_setting(pipe):
    config = BenchConfig(
        modes=("autoregressive", "retrieval"), contexts=(CONTEXT,), **{**FAST, "budgets": (8, 16), "repeats": 2}
    )
    rows = Bench(pipe, config).run_context("p", random_prompt(CONTEXT, 30, seed=2))
    assert [(r.mode, r.budget) for r in rows] == [("autoregressive", None), ("retrieval", 8), ("retrieval", 16)]
    assert all(len(r.ms_per_token) == 2 for r in rows)


def test_prompt_cache_saves_the_prefill_once_and_later_runs_restore_it(pipe, tmp_path):
    config = BenchConfig(modes=("autoregressive", "triforce-ngram", "hf"), contexts=(CONTEXT,), **FAST)
    prompt = random_prompt(CONTEXT, 30, seed=4)
    cold = Bench(pipe, replace(config, prompt_cache=tmp_path)).run_context("p", prompt)
    assert len(list(tmp_path.glob("prompt-*.safetensors"))) == 1
    warm = Bench(pipe, replace(config, prompt_cache=tmp_path)).run_context("p", prompt)
    assert [r.prompt_cached for r in cold] == [False, False, False]
    assert [r.prompt_cached for r in warm] == [True, True, False]  # the peers prefill for themselves
    # the loaded prefill counts in the times a user waits, and the table marks all three as the load
    assert all(r.time_to_first_token_seconds >= r.prefill_seconds for r in warm)
    assert as_record(warm[0])["prompt_cached"] is True
    text = rendered(warm)
    waiting = text[text.index("seconds a user waits") :]
    assert line_of(waiting, "autoregressive").count("*") == 3 and line_of(waiting, "triforce-ngram").count("*") == 3
    assert "*" not in line_of(waiting, "hf")
    assert "* prefill restored from --prompt-cache" in waiting  # the caption may wrap
    assert "*" not in rendered(cold)
    uncached = Bench(pipe, config).run_context("p", prompt)
    for rows in (cold, warm):
        assert [r.matches_autoregressive for r in rows] == [True, True, True]
        assert rows[0].speedup_vs_hf is not None
    assert not any(r.prompt_cached for r in uncached)
    other = Bench(pipe, replace(config, prompt_cache=tmp_path)).run_context("p", random_prompt(CONTEXT, 30, seed=5))
    assert not any(r.prompt_cached for r in other)  # another prompt misses and is saved beside the first
    assert len(list(tmp_path.glob("prompt-*.safetensors"))) == 2


def test_first_token_and_answer_count_the_prefill(pipe, monkeypatch):
    prefill = Bench._prompt_state

    def slow_prefill(self, prompt_ids):  # a prefill as long as a real prompt's, against runs of a tiny model
        time.sleep(0.2)
        return prefill(self, prompt_ids)

    monkeypatch.setattr(Bench, "_prompt_state", slow_prefill)
    modes = ("autoregressive", "triforce", "ngram", *HF_PEERS)
    config = BenchConfig(modes=modes, contexts=(CONTEXT,), **{**FAST, "repeats": 3})
    rows = Bench(pipe, config).run_context("p", random_prompt(CONTEXT, 30, seed=6))
    for row in rows:
        assert 0 < row.prefill_seconds <= row.time_to_first_token_seconds < row.time_to_answer_seconds, row
    for row in rows[:3]:  # ours: the shared prefill, then the run to its first token and through every step
        assert row.prefill_seconds >= 0.2 and row.time_to_first_token_seconds > row.prefill_seconds
        decoding = (NEW_TOKENS - 1) * min(row.ms_per_token) / 1000
        assert row.time_to_answer_seconds >= row.prefill_seconds + decoding
    for row in rows[3:]:  # a peer's prefill is its time to the first token
        assert row.time_to_first_token_seconds == row.prefill_seconds < 0.2
    record = as_record(rows[0])
    assert record["time_to_answer_seconds"] == rows[0].time_to_answer_seconds
    assert record["repeats_new_tokens"] == [NEW_TOKENS] * 3


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory) -> tuple[Pipeline, list[int]]:
    """A tiny model whose end-of-sequence id is the token greedy decoding picks first after the prompt, with that
    prompt: every run stops after one token unless it ignores end-of-sequence."""
    folder = tmp_path_factory.mktemp("bench") / "eos-first"
    model = save_checkpoint(folder, seed=5, max_position_embeddings=128)
    prompt = random_prompt(CONTEXT, 30, seed=1)
    with torch.no_grad():
        eos = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    model.config.eos_token_id = model.generation_config.eos_token_id = eos  # config.json and generation_config.json
    model.save_pretrained(folder)
    config = EngineConfig(gamma1=2, gamma2=4, max_new_tokens=NEW_TOKENS)
    pipe = Pipeline.load(LoadOptions(target=str(folder), dtype="float32", device="cpu"), config=config)
    assert eos in pipe.target.eos_token_ids
    return pipe, prompt


class EosLlama:
    """Stands in for llama_cpp.Llama, sampling nothing but end-of-sequence (as the model above does, first)."""

    eos: ClassVar[int] = 0

    def __init__(self, **kwargs):
        pass

    def reset(self):
        pass

    def generate(self, tokens, **kwargs):
        while True:
            yield EosLlama.eos


def test_ignore_eos_makes_every_row_generate_max_new_tokens(monkeypatch, eos_first):
    pipe, prompt = eos_first
    EosLlama.eos = max(pipe.target.eos_token_ids)
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(Llama=EosLlama))
    monkeypatch.setattr(triforce_cli.bench.llama_cpp, "llama_cpp_available", lambda: True)

    def gguf_peer(gguf, hf_config, threads):  # the llama.cpp peer on a GGUF file this safetensors model lacks
        return LlamaCppPeer(Path("model.gguf"), hf_config, threads)

    monkeypatch.setattr(triforce_cli.bench.runner, "LlamaCppPeer", gguf_peer)
    config = BenchConfig(modes=ALL_MODES, contexts=(CONTEXT,), **FAST)
    stopped = Bench(pipe, config).run_context("p", prompt)
    assert {r.mode: r.new_tokens for r in stopped} == {mode: [1] for mode in ALL_MODES}  # the EOS is forced
    rows = Bench(pipe, replace(config, ignore_eos=True)).run_context("p", prompt)
    assert {r.mode: r.new_tokens for r in rows} == {mode: [NEW_TOKENS] for mode in ALL_MODES}
    # transformers neither stops at nor forbids end-of-sequence: its greedy output stays ours
    assert all(r.matches_autoregressive for r in rows if r.mode != LLAMA_CPP_PEER), [
        (r.mode, r.matches_autoregressive) for r in rows
    ]


class FixedLlamaCpp:
    """Stands in for LlamaCppPeer: every run takes 2 s to its first token and 50 ms for each one after it."""

    def __init__(self, gguf, hf_config, threads):
        pass

    def generate(self, prompt_ids, max_new_tokens, sampling, eos_ids) -> TimedRun:
        return TimedRun(list(range(max_new_tokens)), 2.0, 0.05 * (max_new_tokens - 1))


def test_ratios_to_llama_cpp(monkeypatch, pipe):
    monkeypatch.setattr(triforce_cli.bench.runner, "LlamaCppPeer", FixedLlamaCpp)
    config = BenchConfig(modes=("autoregressive", "hf", LLAMA_CPP_PEER), contexts=(CONTEXT,), **FAST)
    prompt = random_prompt(CONTEXT, 30, seed=1)
    rows = Bench(pipe, config).run_context("p", prompt)
    llama_cpp = rows[-1]
    assert llama_cpp.median_ms == pytest.approx(50.0)
    assert llama_cpp.time_to_first_token_seconds == 2.0
    assert llama_cpp.time_to_answer_seconds == pytest.approx(2.0 + 0.05 * (NEW_TOKENS - 1))
    assert llama_cpp.speedup_vs_llama_cpp == llama_cpp.answer_time_vs_llama_cpp == 1.0
    for row in rows[:2]:
        assert row.speedup_vs_llama_cpp == pytest.approx(50.0 / row.median_ms)
        assert row.answer_time_vs_llama_cpp == pytest.approx(row.time_to_answer_seconds / 2.25)
        assert row.answer_time_vs_llama_cpp < 1  # a tiny model answers in far less than 2.25 s
    assert llama_cpp.speedup_vs_hf == pytest.approx(rows[1].median_ms / 50.0)
    text = rendered(rows)
    assert "×llama.cpp" in text and "vs llama.cpp" in text
    assert f"{rows[0].speedup_vs_llama_cpp:.2f}×" in line_of(text, "autoregressive")
    without = rendered(Bench(pipe, replace(config, modes=("autoregressive",))).run_context("p", prompt))
    assert "llama.cpp" not in without


def test_gamma_policies_sweep_the_speculative_modes_only(pipe):
    config = BenchConfig(
        modes=("autoregressive", "triforce", "ngram", "hf"),
        contexts=(CONTEXT,),
        gamma_policies=("fixed", "heuristic"),
        **FAST,
    )
    rows = Bench(pipe, config).run_context("p", random_prompt(CONTEXT, 30, seed=4))
    assert [(r.mode, r.gamma_policy) for r in rows] == [
        ("autoregressive", None),
        ("triforce", "fixed"),
        ("triforce", "heuristic"),
        ("ngram", "fixed"),
        ("ngram", "heuristic"),
        ("hf", None),
    ]
    assert all(row.matches_autoregressive for row in rows)
    fixed_top = rows[1].acceptance[0]  # gamma2 of the pipe (4) every pass, but the last ones
    assert (
        fixed_drafts_at_least(4, fixed_top["verifications"]) <= fixed_top["drafted"] <= 4 * fixed_top["verifications"]
    )
    assert as_record(rows[1])["gamma_policy"] == "fixed"


def test_auto_policy_is_resolved_for_the_bench_sampling():
    greedy = BenchConfig(modes=("triforce",), gamma_policies=("auto", "costed", "throughput"))
    assert triforce_cli.bench.runner._resolved_policies(greedy) == ("costed", "throughput")
    seeded = replace(greedy, sampling=SamplingConfig(temperature=0.6, seed=0))
    assert triforce_cli.bench.runner._resolved_policies(seeded) == ("costed", "throughput")


def test_forward_costs_time_each_token_count_on_both_caches(pipe):
    config = BenchConfig(modes=("hf",), contexts=(CONTEXT,), forward_tokens=(1, 3), **{**FAST, "repeats": 2})
    runner = Bench(pipe, config)
    runner.run_context("p", random_prompt(CONTEXT, 30, seed=3))
    assert [(c.cache, c.tokens, c.context) for c in runner.forward_costs] == [
        ("full", 1, CONTEXT),
        ("full", 3, CONTEXT),
        ("retrieval", 1, CONTEXT),
        ("retrieval", 3, CONTEXT),
        ("drafter", 1, CONTEXT),  # one step of the drafter tier: here the target on the StreamingLLM cache
    ]
    # every forward timed once a round, at least MIN_ROUNDS rounds whatever the repeats
    assert all(len(c.ms) == MIN_ROUNDS and min(c.ms) > 0 for c in runner.forward_costs)
    assert all(c.floor is None and c.moment_floor is None for c in runner.forward_costs)  # no rates: no floors


def test_forward_costs_stand_beside_their_floors(pipe):
    rates = MachineRates("Test CPU", "key", 1e10, 1e11, None, None, 2, "now", None, None)
    config = BenchConfig(modes=("hf",), contexts=(CONTEXT,), forward_tokens=(1, 3), **FAST)
    runner = Bench(pipe, config, rates)
    runner.run_context("p", random_prompt(CONTEXT, 30, seed=3))
    full, _, retrieval, _, drafter = runner.forward_costs
    assert full.floor.weight_bytes == retrieval.floor.weight_bytes > 0  # the same weights on either cache
    assert full.floor.kv_bytes > retrieval.floor.kv_bytes > 0  # the whole context against the chosen chunks
    # without a drafter of its own the target drafts, on a StreamingLLM cache that holds this short prompt whole
    assert (drafter.floor.weight_bytes, drafter.floor.kv_bytes) == (full.floor.weight_bytes, full.floor.kv_bytes)
    assert all(c.over_floor == c.median_ms / c.floor.ms for c in runner.forward_costs)
    # the read bandwidth of the rounds' minutes, one figure for the prompt's forwards, and the floors at it
    assert len({c.moment_bandwidth for c in runner.forward_costs}) == 1 and full.moment_bandwidth > 0
    assert full.moment_floor.read_ms == pytest.approx(full.floor.read_ms * 1e10 / full.moment_bandwidth)
    assert full.moment_floor.arithmetic_ms == full.floor.arithmetic_ms
    assert all(c.over_moment_floor == c.median_ms / c.moment_floor.ms for c in runner.forward_costs)
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(forward_cost_table(runner.forward_costs))
    table = " ".join(console.export_text().split())
    assert all(column in table for column in ("MB read", "floor ms", "×floor", "GB/s now", "×floor now"))
    assert f"{full.over_floor:.2f}×" in table and f"{retrieval.floor.ms:.2g} read" in table
    assert f"{full.moment_bandwidth / 1e9:.1f}" in table and f"{full.over_moment_floor:.2f}×" in table


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"modes": ("autoregressive", "vllm")}, "unknown bench mode 'vllm'"),
        ({"repeats": 0}, "repeats"),
        ({"contexts": ()}, "positive"),
        ({"budgets": (8,), "chunk_sizes": (16,)}, "budget"),
        ({"forward_tokens": (0, 2)}, "forward-cost"),
        ({"gamma_policies": ("fixed", "eager")}, "unknown gamma policy 'eager'"),
        ({"gamma_policies": ()}, "gamma policy"),
    ],
)
def test_inconsistent_settings_are_refused(changes, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig(**changes)


def test_llama_cpp_joins_the_default_modes_only_where_it_can_run(monkeypatch, pipe):
    gguf_target = SimpleNamespace(gguf=Path("model.gguf"), device=torch.device("cpu"))
    monkeypatch.setattr(triforce_cli.bench.runner, "llama_cpp_available", lambda: True)
    assert default_modes(gguf_target) == (*DEFAULT_MODES, LLAMA_CPP_PEER)
    assert default_modes(pipe.target) == DEFAULT_MODES  # a safetensors target
    on_a_gpu = SimpleNamespace(gguf=Path("model.gguf"), device=torch.device("cuda"))
    assert default_modes(on_a_gpu) == DEFAULT_MODES  # the llama.cpp peer runs on the CPU: not a peer there
    monkeypatch.setattr(triforce_cli.bench.runner, "llama_cpp_available", lambda: False)
    assert default_modes(gguf_target) == DEFAULT_MODES


def test_llama_cpp_peer_needs_the_package_and_a_gguf_file(monkeypatch, pipe):
    monkeypatch.setattr(triforce_cli.bench.llama_cpp, "llama_cpp_available", lambda: False)
    with pytest.raises(ConfigError, match="pip install llama-cpp-python"):
        LlamaCppPeer(Path("model.gguf"), pipe.target.hf_config, 2)
    monkeypatch.setattr(triforce_cli.bench.llama_cpp, "llama_cpp_available", lambda: True)
    with pytest.raises(ConfigError, match="GGUF target"):
        LlamaCppPeer(None, pipe.target.hf_config, 2)


def test_llama_cpp_sampling_is_ours_without_its_extra_filters():
    greedy = llama_cpp_sampling_kwargs(SamplingConfig(temperature=0))
    assert greedy["temp"] == 0.0 and greedy["min_p"] == 0.0 and greedy["repeat_penalty"] == 1.0
    sampled = llama_cpp_sampling_kwargs(SamplingConfig(temperature=0.6, top_p=0.9, top_k=0))
    assert sampled == {"temp": 0.6, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}


def test_llama_cpp_gets_the_same_yarn_setting(pipe):
    module = SimpleNamespace(LLAMA_ROPE_SCALING_TYPE_YARN=2)
    config = pipe.target.hf_config.__class__.from_dict(pipe.target.hf_config.to_dict())
    assert llama_cpp_rope_kwargs(config, module) == {}
    extend_context(config, 4 * config.max_position_embeddings)
    assert llama_cpp_rope_kwargs(config, module) == {
        "rope_scaling_type": 2,
        "rope_freq_scale": 0.25,
        "yarn_orig_ctx": 128,
    }


class FakeLlama:
    """Stands in for llama_cpp.Llama: counts prompt evaluations and yields a scripted token stream."""

    instances: ClassVar[list["FakeLlama"]] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.resets = 0
        self.seeds: list[int] = []
        self.calls: list[dict] = []
        FakeLlama.instances.append(self)

    def reset(self):
        self.resets += 1

    def set_seed(self, seed):
        self.seeds.append(seed)

    def generate(self, tokens, **kwargs):
        self.calls.append(kwargs)
        yield from [7, 8, 9, 3, 4, 5, 6]


def test_llama_cpp_peer_stops_at_eos_and_reuses_the_prompt(monkeypatch, pipe):
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(Llama=FakeLlama, LLAMA_ROPE_SCALING_TYPE_YARN=2))
    monkeypatch.setattr(triforce_cli.bench.llama_cpp, "llama_cpp_available", lambda: True)
    peer = LlamaCppPeer(Path("model.gguf"), pipe.target.hf_config, threads=2)
    llm = FakeLlama.instances[-1]
    assert llm.kwargs["n_threads"] == 2 and llm.kwargs["n_ctx"] == 128
    sampling = SamplingConfig(temperature=0.6, seed=11)
    first = peer.generate([1, 2, 3], 10, sampling, eos_ids={3})
    again = peer.generate([1, 2, 3], 2, sampling, eos_ids={3})
    assert first.token_ids == [7, 8, 9, 3] and again.token_ids == [7, 8]
    assert again.prefill_seconds == first.prefill_seconds  # the cold prefill, reported for every repeat
    assert llm.resets == 1 and llm.seeds == [11, 11]
    peer.generate([1, 2], 2, sampling, eos_ids=set())
    assert llm.resets == 2
    assert llm.calls[0]["temp"] == 0.6


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    tokenizer = save_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"), 32)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


DOCUMENT = " ".join(f"w{i % 10}" for i in range(40))  # tokens 0-9, 40 of them
REQUEST = "w11 w12"


def test_a_chat_prompt_is_cut_to_the_context_in_its_document(chat_tokenizer):
    opening, closing = [20], [11, 12, 21, 22]  # the template's opening; the request, the end of the turn, w22
    for length in (6, 12, 30):
        ids = cut_prompt(chat_tokenizer, DOCUMENT, REQUEST, length)
        assert len(ids) == length and ids[:1] == opening and ids[-4:] == closing
        assert ids[1:-4] == [i % 10 for i in range(length - 5)]  # the document's first tokens, fewer as length falls
    # the whole document: the prompt `generate --chat` makes of the document and the request
    whole = encode_prompt(chat_tokenizer, f"{DOCUMENT}\n\n{REQUEST}", chat=True)
    assert cut_prompt(chat_tokenizer, DOCUMENT, REQUEST, 45) == whole
    # a continuation: the document's first tokens, without the template
    assert cut_prompt(chat_tokenizer, DOCUMENT, None, 12) == [i % 10 for i in range(12)]


@pytest.mark.parametrize(
    ("request_", "length", "template", "message"),
    [
        (REQUEST, 5, CHAT_TEMPLATE, "leaves no room for the document: the chat template and the request take 5"),
        (REQUEST, 46, CHAT_TEMPLATE, "the document has 40 tokens, fewer than the 41 the context 46 leaves it"),
        (None, 41, CHAT_TEMPLATE, "the text has 40 tokens, fewer than the context 41"),
        (REQUEST, 12, None, "a chat turn needs a chat template, and this model's tokenizer has none"),
        (REQUEST, 12, "w20 {% if add_generation_prompt %}w22{% endif %}", "changes the message"),
    ],
)
def test_a_prompt_that_cannot_be_cut_says_why(chat_tokenizer, monkeypatch, request_, length, template, message):
    monkeypatch.setattr(chat_tokenizer, "chat_template", template)
    with pytest.raises(PromptError, match=message):
        cut_prompt(chat_tokenizer, DOCUMENT, request_, length)


def test_over_several_prompts_a_table_gives_the_median_ratio_to_autoregressive_and_its_range():
    rows = []
    for prompt, speedup in (("stdlib-a", 4.0), ("qa-stdlib-b", 1.0), ("summary-stdlib-a", 2.0)):
        ours = [
            BenchRow(prompt, "autoregressive", 1024, None, None, 1.0, [40.0]),
            BenchRow(prompt, "triforce-ngram", 1024, None, 16, 1.0, [40.0 / speedup], "throughput"),
        ]
        ours[0].speedup_vs_autoregressive, ours[1].speedup_vs_autoregressive = 1.0, speedup
        rows += [*ours, BenchRow(prompt, "hf", 32768, None, None, 1.0, [80.0])]  # at 32768 no autoregressive ran
    summaries = over_prompts(rows)
    assert [(s.context, s.mode) for s in summaries] == [(1024, "autoregressive"), (1024, "triforce-ngram")]
    triforce = summaries[1]
    assert triforce.prompts == ["stdlib-a", "qa-stdlib-b", "summary-stdlib-a"]
    assert (triforce.median_speedup_vs_autoregressive, triforce.min_speedup_vs_autoregressive) == (2.0, 1.0)
    assert as_record(triforce)["max_speedup_vs_autoregressive"] == 4.0
    text = rendered(rows)
    table = text[text.index("×AR, median [min-max] over 3 prompts") :]
    assert "2.00×" in next(line for line in table.splitlines() if "triforce-ngram" in line)
    assert "1.00-4.00" in table and "32768" not in table and "hf" not in table
    assert all(len(line) <= 80 and "…" not in line for line in text.splitlines())
    one_prompt = rows[:3]
    assert over_prompts(one_prompt) == [] and "×AR, median" not in rendered(one_prompt)


def invoke_bench(*args):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


def test_bench_command_writes_json_csv_and_plot(checkpoint, prompt_file, tmp_path, monkeypatch):
    common = ["--target", checkpoint, "-p", prompt_file, "--context", CONTEXT, "--max-new-tokens", 4]
    common += ["--repeats", 1, "--warmup", 0, "--budget", 16, "--chunk-size", 4, "--modes", "autoregressive,triforce"]
    monkeypatch.setattr(sys, "argv", ["triforce", "bench", "--target", str(checkpoint)])  # what the JSON records
    cpu = ("Test CPU 9000", ["avx2", "avx512f"])
    monkeypatch.setattr(triforce_cli.runtime.environment, "cpu_description", lambda: cpu)
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(triforce_cli.plan.rates, "read_bandwidth", lambda: 12e9)  # measured once: no timing here
    monkeypatch.setattr(triforce_cli.plan.rates, "matmul_flops", lambda: 90e9)
    monkeypatch.setenv("COLUMNS", "200")  # the tables unsqueezed, however wide the timings' digits make them
    result = invoke_bench(
        *common, "--forward-costs", "1,2", "--out", tmp_path / "rows.json", "--plot", tmp_path / "latency.png"
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("CPU: Test CPU 9000, vector extensions avx2, avx512f;")
    assert "triforce" in result.stdout and "autoregressive" in result.stdout
    assert "one forward of T new tokens" in result.stdout and "×floor" in result.stdout
    assert "measuring this CPU's read bandwidth" in result.stderr
    assert "seconds a user waits" in result.stdout
    payload = json.loads((tmp_path / "rows.json").read_text())
    assert [(c["cache"], c["tokens"]) for c in payload["forward_costs"]] == [
        ("full", 1),
        ("full", 2),
        ("retrieval", 1),
        ("retrieval", 2),
        ("drafter", 1),
    ]
    assert all(c["floor"]["read_bandwidth"] == 12e9 and c["over_floor"] > 0 for c in payload["forward_costs"])
    assert payload["command"] == f"triforce bench --target {checkpoint}"
    assert payload["machine"]["torch_threads"] >= 1
    assert (payload["machine"]["processor"], payload["machine"]["cpu_features"]) == cpu
    expected_weights = "half" if half_weights_available() else "dense"  # what auto resolves to for this checkpoint
    assert payload["setup"] == {"target": "tiny", "weights": expected_weights, "threads": torch.get_num_threads()}
    assert [row["mode"] for row in payload["rows"]] == ["autoregressive", "triforce"]
    assert payload["speedup_vs_autoregressive_over_prompts"] == [] and "×AR, median" not in result.stdout  # one prompt
    assert all(row["matches_autoregressive"] for row in payload["rows"])
    for row in payload["rows"]:
        assert 0 < row["time_to_first_token_seconds"] < row["time_to_answer_seconds"]
        assert row["speedup_vs_llama_cpp"] is None and row["answer_time_vs_llama_cpp"] is None  # it did not run
    assert (tmp_path / "latency.png").read_bytes().startswith(b"\x89PNG")
    result = invoke_bench(*common, "--out", tmp_path / "rows.csv")
    assert result.exit_code == 0, result.output
    lines = (tmp_path / "rows.csv").read_text().splitlines()
    assert lines[0].startswith("prompt,mode,context")
    for row in csv.DictReader(lines):
        assert (row["processor"], row["cpu_features"]) == ("Test CPU 9000", "avx2 avx512f")
        assert row["repeats_new_tokens"] == "4" and float(row["time_to_answer_seconds"]) > 0


def test_bench_tables_written_to_a_file_keep_every_figure(checkpoint, prompt_file, tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout a pipe, as `triforce bench ... > file` makes it
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(triforce_cli.plan.rates, "read_bandwidth", lambda: 12e9)
    monkeypatch.setattr(triforce_cli.plan.rates, "matmul_flops", lambda: 90e9)
    args = ["--target", checkpoint, "-p", prompt_file, "--context", CONTEXT, "--max-new-tokens", 4, "--repeats", 1]
    result = invoke_bench(*args, "--warmup", 0, "--modes", "autoregressive", "--forward-costs", 1)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "…" not in result.stdout and max(map(len, lines)) > 80  # wider than Rich's default rather than cut
    header = next(i for i, line in enumerate(lines) if "one forward of T new tokens" in line)
    assert all(column in " ".join(lines[header : header + 6]) for column in ("floor ms", "×floor", "GB/s now"))


def test_bench_command_gives_the_ratios_over_several_prompts(chat_checkpoint, tmp_path):
    prompts = ["summary-stdlib-a", "code-stdlib-b"]  # a chat turn and a continuation
    result = invoke_bench(
        *("--target", chat_checkpoint, "--builtin", ",".join(prompts), "--context", CONTEXT, "--max-new-tokens", 4),
        *("--repeats", 1, "--warmup", 0, "--modes", "autoregressive,ngram", "--out", tmp_path / "rows.json"),
    )
    assert result.exit_code == 0, result.output
    assert "×AR, median [min-max] over 2 prompts" in result.stdout
    payload = json.loads((tmp_path / "rows.json").read_text())
    modes = ["autoregressive", "ngram"]
    assert [(r["prompt"], r["mode"], r["context"]) for r in payload["rows"]] == [
        (prompt, mode, CONTEXT) for prompt in prompts for mode in modes
    ]
    over = payload["speedup_vs_autoregressive_over_prompts"]
    assert [(o["context"], o["mode"], o["prompts"]) for o in over] == [(CONTEXT, mode, prompts) for mode in modes]
    ngram = [r["speedup_vs_autoregressive"] for r in payload["rows"] if r["mode"] == "ngram"]
    assert over[1]["median_speedup_vs_autoregressive"] == pytest.approx(statistics.median(ngram))
    assert (over[1]["min_speedup_vs_autoregressive"], over[1]["max_speedup_vs_autoregressive"]) == (
        min(ngram),
        max(ngram),
    )
    assert over[0]["median_speedup_vs_autoregressive"] == 1.0


def test_bench_default_prompts_without_a_chat_template_leave_the_chat_turns_out(checkpoint, tmp_path):
    args = ["--target", checkpoint, "--context", CONTEXT, "--repeats", 1, "--warmup", 0, "--max-new-tokens", 2]
    result = invoke_bench(*args, "--modes", "autoregressive", "--out", tmp_path / "run.json")
    assert result.exit_code == 0, result.output
    assert "no chat template: the default prompts qa-stdlib-b, summary-stdlib-a left out" in " ".join(
        result.stderr.split()
    )
    rows = json.loads((tmp_path / "run.json").read_text())["rows"]
    assert {row["prompt"] for row in rows} == {"stdlib-a", "code-stdlib-b"}


def test_bench_chat_prompts_asked_for_without_a_chat_template_fail_before_any_run(checkpoint):
    args = ("--builtin", "stdlib-a,qa-stdlib-b", "--context", CONTEXT, "--repeats", 1, "--warmup", 0)
    result = invoke_bench("--target", checkpoint, *args)
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    message = "error: prompt qa-stdlib-b: a chat turn needs a chat template, and this model's tokenizer has none"
    assert errors == [message], result.output
    assert "prefill, then" not in result.stderr  # stdlib-a, first, was cut but not run


@pytest.mark.parametrize(
    "args", [("--modes", "autoregressive,hf-assisted"), ("--modes", "autoregressive", "--forward-costs", 1), ()]
)
def test_bench_takes_a_drafter_a_mode_drafts_with(monkeypatch, args):
    """--draft passes where a mode drafts with it: assisted generation, the drafter's forward costs, the defaults."""
    loaded = []
    monkeypatch.setattr(triforce_cli.cli.bench, "load_pipeline", lambda *a, **k: loaded.append(1) or sys.exit(3))
    result = invoke_bench("--draft", "some-drafter", *args)
    assert loaded and result.exit_code == 3, result.output


def test_bench_plot_without_matplotlib_fails_before_loading_anything(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = invoke_bench("--target", tmp_path / "never-loaded", "--plot", tmp_path / "latency.png")
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: plotting needs matplotlib: pip install matplotlib"], result.output


def test_bench_command_reuses_the_prompt_cache(checkpoint, prompt_file, tmp_path):
    args = ["--target", checkpoint, "-p", prompt_file, "--context", CONTEXT, "--max-new-tokens", 4, "--repeats", 1]
    args += ["--warmup", 0, "--modes", "autoregressive", "--prompt-cache", tmp_path / "prompts"]
    cached = []
    for run in ("first", "second"):
        result = invoke_bench(*args, "--out", tmp_path / f"{run}.json")
        assert result.exit_code == 0, result.output
        cached.append(json.loads((tmp_path / f"{run}.json").read_text())["rows"][0]["prompt_cached"])
    assert cached == [False, True]
    assert "* prefill restored from --prompt-cache" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--context", 4 * CONTEXT], ["fewer than the context"]),
        (["--context", CONTEXT, "--max-new-tokens", 100], ["context of", "--context-window"]),
        (["--context", CONTEXT, "--modes", "autoregressive,llama.cpp"], ["llama.cpp"]),
        (["--context", CONTEXT, "--out", "rows.txt"], [".json or .csv"]),
        (["--context", CONTEXT, "--gamma-policy", "fixed,eager"], ["'fixed,eager': choose from"]),
        (
            ["--context", CONTEXT, "--modes", "autoregressive,retrieval,hf", "--draft", "some-drafter"],
            ["--draft names the model of a drafter tier, which --modes autoregressive,retrieval,hf does not run"],
        ),
        (["--context", CONTEXT, "--questions", "questions.txt"], ["--questions", "give --scenario qa"]),
    ],
)
def test_bench_errors_are_one_line(checkpoint, prompt_file, monkeypatch, tmp_path, args, fragments):
    monkeypatch.chdir(tmp_path)
    result = invoke_bench("--target", checkpoint, "-p", prompt_file, "--repeats", 1, "--warmup", 0, *args)
    assert result.exit_code in (1, 2), result.output  # 2: a value the option cannot read
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert all(fragment in errors[0] for fragment in fragments), errors[0]


@pytest.mark.parametrize("option", ["--out", "--plot"])
@pytest.mark.parametrize("where", ["a folder", "a missing folder"])
def test_an_output_that_cannot_be_written_is_refused_before_the_bench_runs(
    checkpoint, prompt_file, tmp_path, monkeypatch, option, where
):
    """The results of a long bench are not lost to an --out or --plot path found unwritable only at the end."""
    ran = []
    monkeypatch.setattr(triforce_cli.cli.bench, "load_pipeline", lambda *a, **k: ran.append(1))
    path = tmp_path / ("results.json" if option == "--out" else "plot.png")
    if where == "a folder":
        path.mkdir()
    else:
        path = tmp_path / "nowhere" / path.name
    result = invoke_bench("--target", checkpoint, "-p", prompt_file, "--context", CONTEXT, option, path)
    assert result.exit_code == 1 and not ran, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and option.removeprefix("--") in lines[0]
