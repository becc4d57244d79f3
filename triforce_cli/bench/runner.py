"""`triforce bench`: per-token latency of our modes and the peers, side by side, in one process.

For every context length the prompt is cut to that many tokens and prefilled once; our modes restore that
prefill, so they differ only in decoding. Repeats interleave the modes, so drift of a noisy machine touches them
alike. Each row reports median, min and max per-token decode latency over the repeats, the speed-up of the
median over our autoregressive mode, over plain transformers generate and over llama.cpp, the acceptance per
tier, and whether greedy output matched our autoregressive output; and what a user waits, as medians over the
repeats: the time to the first token and to the whole answer, each counting the prompt's prefill.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from transformers import PreTrainedModel

from triforce_cli.bench.forward_costs import ForwardCost, measure_forward_costs
from triforce_cli.bench.llama_cpp import LLAMA_CPP_PEER, LlamaCppPeer, llama_cpp_available
from triforce_cli.bench.peers import HF_PEERS, PROMPT_LOOKUP_TOKENS, TimedRun, hf_generate
from triforce_cli.decoding.config import MODE_TIERS, MODES, EngineConfig, Mode, Tiers
from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.pipeline import Pipeline, prefill_or_restore
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.stats import GenerationResult, as_record, summary_of
from triforce_cli.errors import ConfigError
from triforce_cli.plan.rates import MachineRates
from triforce_cli.runtime.forms import WeightForm
from triforce_cli.runtime.loading import LoadedModel, load_hf_model


@dataclass(frozen=True)
class BenchMode:
    """One of our modes as the bench spells it: an engine mode, its n-gram setting, and whether the engine gets the
    pipeline's model drafter."""

    engine_mode: Mode
    ngram: bool | None  # EngineConfig.ngram; None leaves the pipeline's
    model_drafter: bool

    @property
    def tiers(self) -> Tiers:
        return MODE_TIERS[self.engine_mode]

    @property
    def engine_changes(self) -> dict:
        """The changes of the pipeline's EngineConfig this mode runs with."""
        return {"mode": self.engine_mode} | ({} if self.ngram is None else {"ngram": self.ngram})


OUR_MODES = {
    # every engine mode under its own name, a drafter tier drafting with the model drafter alone
    **{
        mode.value: BenchMode(mode, ngram=False if tiers.drafter else None, model_drafter=tiers.drafter)
        for mode, tiers in MODE_TIERS.items()
    },
    # "ngram" drafts with the n-gram proposer alone; the *-ngram modes with it first, and with the drafter where it
    # finds nothing
    "ngram": BenchMode(Mode.STREAMING, ngram=True, model_drafter=False),
    "streaming-ngram": BenchMode(Mode.STREAMING, ngram=True, model_drafter=True),
    "triforce-ngram": BenchMode(Mode.TRIFORCE, ngram=True, model_drafter=True),
}
ALL_MODES = (*OUR_MODES, *HF_PEERS, LLAMA_CPP_PEER)
DEFAULT_MODES = (*MODES, "ngram", "triforce-ngram", "hf", "hf-lookup")
RETRIEVAL_MODES = tuple(name for name, mode in OUR_MODES.items() if mode.tiers.retrieval)
# swept over gamma policies: the modes whose target@full verifies drafts
SPECULATIVE_MODES = tuple(name for name, mode in OUR_MODES.items() if mode.tiers.speculative)


def drafts_with_model(modes: tuple[str, ...]) -> bool:
    """Whether any of modes (bench names) drafts with the pipeline's model drafter: one of ours with a model drafter,
    or transformers' assisted generation."""
    return any(OUR_MODES[m].model_drafter if m in OUR_MODES else m == "hf-assisted" for m in modes)


def default_modes(target: LoadedModel) -> tuple[str, ...]:
    """DEFAULT_MODES, plus llama.cpp where llama-cpp-python is installed, the target is a GGUF file and runs on the
    CPU, as the llama.cpp peer does; on a GPU the peers are transformers' on the same GPU."""
    if llama_cpp_available() and target.gguf is not None and target.device.type == "cpu":
        return (*DEFAULT_MODES, LLAMA_CPP_PEER)
    return DEFAULT_MODES


@dataclass(frozen=True)
class BenchConfig:
    modes: tuple[str, ...] = DEFAULT_MODES
    contexts: tuple[int, ...] = (1024,)
    max_new_tokens: int = 32
    repeats: int = 3
    warmup: int = 1  # untimed runs of every mode before the first repeat
    budgets: tuple[int | None, ...] = (None,)
    chunk_sizes: tuple[int, ...] = (16,)
    gamma_policies: tuple[str, ...] = ("costed",)  # what generate runs by default, seeded or not
    forward_tokens: tuple[int, ...] = ()  # also time single forwards of these many tokens (forward_costs.py)
    prompt_cache: Path | None = None  # folder of saved prefills (prompt_state.py): reused, or written on a miss
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0))
    ignore_eos: bool = False  # every mode and peer generates max_new_tokens, end-of-sequence or not

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in ALL_MODES]
        if unknown:
            raise ConfigError(f"unknown bench mode '{unknown[0]}' (choose from {', '.join(ALL_MODES)})")
        if self.repeats < 1 or self.warmup < 0:
            raise ConfigError("repeats must be at least 1 and warm-up not negative")
        if not self.contexts or min(self.contexts) < 1:
            raise ConfigError("context lengths must be positive")
        if not self.gamma_policies:
            raise ConfigError("name at least one gamma policy")
        for policy in self.gamma_policies:
            EngineConfig(gamma_policy=policy)  # raises on an unknown policy
        if self.forward_tokens and min(self.forward_tokens) < 1:
            raise ConfigError("forward-cost token counts must be positive")
        for chunk_size in self.chunk_sizes:
            for budget in self.budgets:
                EngineConfig(budget=budget, chunk_size=chunk_size)  # raises on an inconsistent pair


@dataclass
class BenchRow:
    prompt: str
    mode: str
    context: int
    budget: int | None
    chunk_size: int | None
    # ours: the shared prefill, where prompt_cached the time to load it; a peer's: until its first token
    prefill_seconds: float
    ms_per_token: list[float]  # one per repeat
    gamma_policy: str | None = None
    new_tokens: list[int] = field(default_factory=list)  # one per repeat
    # what a user waits, median over repeats: prefill_seconds (so the load time where prompt_cached) and the run to
    # its first token, or to its last
    time_to_first_token_seconds: float | None = None
    time_to_answer_seconds: float | None = None
    acceptance: list[dict] = field(default_factory=list)
    tier_costs: list[dict] = field(default_factory=list)  # each adaptive tier's step costs and decisions, last repeat
    matches_autoregressive: bool | None = None
    speedup_vs_autoregressive: float | None = None
    speedup_vs_hf: float | None = None
    speedup_vs_llama_cpp: float | None = None  # llama.cpp's median ms per token over this row's
    answer_time_vs_llama_cpp: float | None = None  # this row's time to answer over llama.cpp's: below 1 is sooner
    prompt_cached: bool = False

    DERIVED: ClassVar[tuple[str, ...]] = ("median_ms", "min_ms", "max_ms", "tokens_per_second")
    RECORD_KEYS: ClassVar[dict[str, str]] = {  # in JSON and CSV, every latency says it is per token
        "ms_per_token": "repeats_ms_per_token",
        "new_tokens": "repeats_new_tokens",
        "median_ms": "median_ms_per_token",
        "min_ms": "min_ms_per_token",
        "max_ms": "max_ms_per_token",
    }

    median_ms = summary_of("ms_per_token", statistics.median)
    min_ms = summary_of("ms_per_token", min)
    max_ms = summary_of("ms_per_token", max)

    @property
    def tokens_per_second(self) -> float:
        return 1000 / self.median_ms if self.median_ms else 0.0


@dataclass
class OverPrompts:
    """One mode, with its settings, at one context over every prompt of a run: its ratios to our autoregressive mode,
    one per prompt, summed up by their median and range. Drafting gains more where the answer repeats the prompt,
    so one prompt's ratio says little; the median over prompts of several kinds is the figure to report."""

    context: int
    mode: str
    budget: int | None
    chunk_size: int | None
    gamma_policy: str | None
    prompts: list[str] = field(default_factory=list)
    speedups_vs_autoregressive: list[float] = field(default_factory=list)  # one per prompt, in the order of prompts

    DERIVED: ClassVar[tuple[str, ...]] = (
        "median_speedup_vs_autoregressive",
        "min_speedup_vs_autoregressive",
        "max_speedup_vs_autoregressive",
    )

    median_speedup_vs_autoregressive = summary_of("speedups_vs_autoregressive", statistics.median)
    min_speedup_vs_autoregressive = summary_of("speedups_vs_autoregressive", min)
    max_speedup_vs_autoregressive = summary_of("speedups_vs_autoregressive", max)


def over_prompts(rows: list[BenchRow]) -> list[OverPrompts]:
    """Per context, mode and setting, in the rows' order, the ratios to autoregressive over the prompts; none where
    the rows cover one prompt, and none for rows without that ratio (no autoregressive run beside them)."""
    if len({r.prompt for r in rows}) < 2:
        return []
    groups: dict[tuple, OverPrompts] = {}
    for row in rows:
        if row.speedup_vs_autoregressive is not None:
            key = (row.context, row.mode, row.budget, row.chunk_size, row.gamma_policy)
            group = groups.setdefault(key, OverPrompts(*key))
            group.prompts.append(row.prompt)
            group.speedups_vs_autoregressive.append(row.speedup_vs_autoregressive)
    return list(groups.values())


@dataclass
class _OurRun:
    """One generation of our engine on the shared prefill, and its wall time."""

    result: GenerationResult
    # from calling generate to its return: restoring the prefill, the first token, decoding; not compiling the
    # decode steps, which the first run that needs them does once (GenerationStats.compile_seconds)
    seconds: float

    @property
    def token_ids(self) -> list[int]:
        return self.result.token_ids


@dataclass
class _Variant:
    """One row to measure: a mode with its retrieval settings and speculation-length policy."""

    mode: str
    budget: int | None
    chunk_size: int | None
    gamma_policy: str | None
    runs: list = field(default_factory=list)


def _resolved_policies(config: BenchConfig) -> tuple[str, ...]:
    """The policies to run, 'auto' resolved for the bench's sampling, each once."""
    resolved = (
        EngineConfig(gamma_policy=p, sampling=config.sampling).speculation_policy for p in config.gamma_policies
    )
    return tuple(dict.fromkeys(resolved))


def _variants(config: BenchConfig) -> list[_Variant]:
    variants = []
    retrieval = [(b, c) for b in config.budgets for c in config.chunk_sizes]
    policies_to_sweep = _resolved_policies(config)
    for mode in config.modes:
        policies = policies_to_sweep if mode in SPECULATIVE_MODES else (None,)
        for budget, chunk_size in retrieval if mode in RETRIEVAL_MODES else [(None, None)]:
            variants += [_Variant(mode, budget, chunk_size, policy) for policy in policies]
    return variants


class Bench:
    def __init__(self, pipe: Pipeline, config: BenchConfig, rates: MachineRates | None = None):
        """rates: this machine's, for the floors of the forward costs (none without them)."""
        self.pipe = pipe
        self.config = config
        self.rates = rates
        self.base_config = replace(
            pipe.config, max_new_tokens=config.max_new_tokens, sampling=config.sampling, ignore_eos=config.ignore_eos
        )
        self._hf: dict[str, PreTrainedModel] = {}
        self.llama_cpp = None
        self.forward_costs: list[ForwardCost] = []
        if LLAMA_CPP_PEER in config.modes:
            self.llama_cpp = LlamaCppPeer(pipe.target.gguf, pipe.target.hf_config, torch.get_num_threads())

    def hf_model(self, role: str):
        """The transformers copy of the target ('target') or of the drafter ('assistant'), loaded on first use."""
        if role not in self._hf:
            target = self.pipe.target
            loaded = target if role == "target" else self.pipe.drafter or target
            self._hf[role] = load_hf_model(
                loaded.source,
                target.dtype,
                None if role == "target" else self.hf_model("target"),
                loaded.hf_config,
                half_weights=loaded.weights == WeightForm.HALF,
                device=target.device,
            )
        return self._hf[role]

    def _run_peer(self, mode: str, prompt_ids: list[int]) -> TimedRun:
        if mode == LLAMA_CPP_PEER:
            eos_ids = set() if self.config.ignore_eos else self.pipe.target.eos_token_ids
            return self.llama_cpp.generate(prompt_ids, self.config.max_new_tokens, self.config.sampling, eos_ids)
        extra = {"ignore_eos": self.config.ignore_eos}
        if mode == "hf-assisted":
            extra["assistant"] = self.hf_model("assistant")
        elif mode == "hf-lookup":
            extra["prompt_lookup"] = PROMPT_LOOKUP_TOKENS
        return hf_generate(
            self.hf_model("target"), prompt_ids, self.config.max_new_tokens, self.config.sampling, **extra
        )

    def engine_for(self, mode: str = "autoregressive", **changes) -> Engine:
        """An engine for mode with changes to the bench's settings, sharing the pipeline engine's caches: every run
        reuses the buffers (and compiled steps) that fit it instead of allocating its own."""
        bench_mode = OUR_MODES[mode]
        drafter = self.pipe.drafter if bench_mode.model_drafter else None
        config = replace(self.base_config, **bench_mode.engine_changes, **changes)
        return self.pipe.engine.reconfigured(config, drafter)

    def _run_ours(self, variant: _Variant, prompt_ids: list[int], state) -> _OurRun:
        changes = {}
        if variant.mode in RETRIEVAL_MODES:
            changes.update(budget=variant.budget, chunk_size=variant.chunk_size)
        if variant.gamma_policy is not None:
            changes.update(gamma_policy=variant.gamma_policy)
        engine = self.engine_for(variant.mode, **changes)
        started = time.perf_counter()
        result = engine.generate(prompt_ids, prompt_state=state)
        return _OurRun(result, time.perf_counter() - started - result.stats.compile_seconds)

    def run_context(
        self, prompt: str, prompt_ids: list[int], on_run: Callable[[str, int], None] | None = None
    ) -> list[BenchRow]:
        """All rows for one prompt already cut to its context length."""
        variants = _variants(self.config)
        state = None
        prefill_seconds = 0.0
        cached = False
        if any(v.mode in OUR_MODES for v in variants) or self.config.forward_tokens:
            started = time.perf_counter()
            state, cached = self._prompt_state(prompt_ids)
            prefill_seconds = time.perf_counter() - started
        if self.config.forward_tokens:
            retrieval = EngineConfig(budget=self.config.budgets[0], chunk_size=self.config.chunk_sizes[0])
            self.forward_costs += measure_forward_costs(
                prompt,
                self.pipe.target,
                state,
                self.config.forward_tokens,
                self.config.repeats,
                retrieval.budget_for(len(prompt_ids)),
                retrieval.chunk_size,
                self.rates,
                self.pipe.drafter or self.pipe.target,  # without one of its own the target drafts on the cache
                self.base_config,
            )
        for repeat in range(-self.config.warmup, self.config.repeats):
            for variant in variants:
                if on_run is not None:
                    on_run(variant.mode, repeat)
                if variant.mode in OUR_MODES:
                    run = self._run_ours(variant, prompt_ids, state)
                else:
                    run = self._run_peer(variant.mode, prompt_ids)
                if repeat >= 0:
                    variant.runs.append(run)
        return self._rows(prompt, len(prompt_ids), variants, prefill_seconds, cached)

    def _prompt_state(self, prompt_ids: list[int]) -> tuple[PromptState, bool]:
        """The prefilled prompt, and whether it came from the prompt cache (a miss prefills and saves it there)."""
        folder = self.config.prompt_cache
        cache = None if folder is None else self.pipe.prompt_cache(folder, self.base_config.max_new_tokens)
        return prefill_or_restore(self.engine_for(), prompt_ids, cache, restore=False)

    def _rows(
        self, prompt: str, context: int, variants: list[_Variant], prefill_seconds: float, cached: bool
    ) -> list[BenchRow]:
        rows = []
        reference = next((v.runs[0].token_ids for v in variants if v.mode == "autoregressive"), None)
        for v in variants:
            if v.mode in OUR_MODES:
                stats = [r.result.stats for r in v.runs]
                ms = [s.ms_per_token for s in stats]
                row = BenchRow(prompt, v.mode, context, v.budget, v.chunk_size, prefill_seconds, ms, v.gamma_policy)
                row.acceptance = [as_record(a) for a in stats[-1].acceptance]
                row.tier_costs = [as_record(c) for c in stats[-1].tier_costs]
                row.prompt_cached = cached
                # the engine's own prefill_seconds: restoring the shared prefill, the drafter's and the first token
                first_token = [prefill_seconds + s.prefill_seconds for s in stats]
                answer = [prefill_seconds + r.seconds for r in v.runs]
            else:
                peer_prefill = statistics.median(r.prefill_seconds for r in v.runs)
                row = BenchRow(prompt, v.mode, context, None, None, peer_prefill, [r.ms_per_token for r in v.runs])
                first_token = [r.prefill_seconds for r in v.runs]
                answer = [r.answer_seconds for r in v.runs]
            row.new_tokens = [len(r.token_ids) for r in v.runs]
            row.time_to_first_token_seconds = statistics.median(first_token)
            row.time_to_answer_seconds = statistics.median(answer)
            if self.config.sampling.greedy and reference is not None:
                row.matches_autoregressive = v.runs[0].token_ids == reference
            rows.append(row)
        _compare(rows)
        return rows


def _compare(rows: list[BenchRow]) -> None:
    """Each row's ratios to the rows of our autoregressive mode, of HF generate and of llama.cpp, where they ran."""
    baseline = {r.mode: r for r in rows if r.mode in ("autoregressive", "hf", LLAMA_CPP_PEER)}
    llama_cpp = baseline.get(LLAMA_CPP_PEER)
    for row in rows:
        if row.median_ms:
            if "autoregressive" in baseline:
                row.speedup_vs_autoregressive = baseline["autoregressive"].median_ms / row.median_ms
            if "hf" in baseline:
                row.speedup_vs_hf = baseline["hf"].median_ms / row.median_ms
            if llama_cpp is not None:
                row.speedup_vs_llama_cpp = llama_cpp.median_ms / row.median_ms
        if llama_cpp is not None and llama_cpp.time_to_answer_seconds:
            row.answer_time_vs_llama_cpp = row.time_to_answer_seconds / llama_cpp.time_to_answer_seconds
