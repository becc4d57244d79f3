"""What one target forward of T new tokens costs after a long prompt, against the full and the retrieval cache, and
what one step of the drafter costs on its StreamingLLM cache.

Speculation pays only when verifying T tokens costs little more than one decode step, so `triforce bench
--forward-costs 1,2,4,8` times exactly that: T tokens appended to the prefilled prompt, rolled back after each
repeat, with the logits of all T positions as a verification needs them. A drafter's step is one token on the cache the
prompt leaves it (decoding.prefill.prefill_drafter): the sinks and the last window.

Beside each cost stands its floor on this machine (ForwardFloor): what the forward must read, the weights as they
are stored and the keys and values of every position its layers attend to in the cache's dtype, over the measured
read bandwidth; and what it must compute, the linears' and attention's float32 multiply-adds, over the measured
arithmetic rate (plan.rates: the vector units' FMA peak, the most any kernel computes). The larger is the floor,
and cost over floor shows how far a forward is from it.
"""

import statistics
import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from triforce_cli.cache import FullCache, KVCache, RetrievalCache, StreamingCache, kv_dtype
from triforce_cli.decoding.cache_pool import new_streaming
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.prefill import prefill_drafter
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.rounds import forward_mode
from triforce_cli.decoding.sizing import CacheSpec
from triforce_cli.decoding.stats import summary_of
from triforce_cli.decoding.step_costs import linear_weights
from triforce_cli.plan.measure import COPY_BYTES, best_seconds, read_probe
from triforce_cli.plan.rates import MachineRates
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import Transformer, weight_bytes


@dataclass(frozen=True)
class ForwardFloor:
    """The least one forward can cost on a machine: max(bytes read / read bandwidth, FLOPs / arithmetic rate)."""

    weight_bytes: int  # the weights as stored that the forward reads (forward_weight_bytes)
    kv_bytes: int  # the keys and values of the positions its layers attend to, in the cache's dtype
    linear_flops: int  # 2 per weight of every linear and token
    attention_flops: int  # 4 per query head, head dimension and (query, key) pair a causal (windowed) mask keeps
    read_bandwidth: float  # bytes/s
    flops_rate: float  # float32 FLOP/s (MachineRates.arithmetic_rate)

    DERIVED: ClassVar[tuple[str, ...]] = ("read_ms", "arithmetic_ms", "ms", "bound")

    @property
    def read_ms(self) -> float:
        return 1e3 * (self.weight_bytes + self.kv_bytes) / self.read_bandwidth

    @property
    def arithmetic_ms(self) -> float:
        return 1e3 * (self.linear_flops + self.attention_flops) / self.flops_rate

    @property
    def ms(self) -> float:
        return max(self.read_ms, self.arithmetic_ms)

    @property
    def bound(self) -> str:
        """Which floor is the higher: "read" or "arithmetic"."""
        return "read" if self.read_ms >= self.arithmetic_ms else "arithmetic"


@dataclass
class ForwardCost:
    """The measured milliseconds of forwards of `tokens` new tokens after a prompt of `context` tokens, on one cache
    (plan.model.PredictedForward holds predicted ones)."""

    prompt: str
    context: int
    cache: str  # "full" or "retrieval" (the target's), or "drafter" (the drafter's StreamingLLM cache)
    tokens: int
    ms: list[float]  # one per round
    floor: ForwardFloor | None = None  # None where no rates were measured (a GPU)
    moment_bandwidth: float | None = None  # bytes/s read beside the rounds (measure_forward_costs), else None

    DERIVED: ClassVar[tuple[str, ...]] = ("median_ms", "min_ms", "max_ms", "over_floor", "over_moment_floor")

    median_ms = summary_of("ms", statistics.median)
    min_ms = summary_of("ms", min)
    max_ms = summary_of("ms", max)

    @property
    def over_floor(self) -> float | None:
        """The median cost as a multiple of the floor."""
        return None if self.floor is None else self.median_ms / self.floor.ms

    @property
    def moment_floor(self) -> ForwardFloor | None:
        """The floor at the read bandwidth measured beside the rounds: what the memory gave in that minute, where
        other programs (another virtual machine on the same host) read from it too."""
        if self.floor is None or self.moment_bandwidth is None:
            return None
        return replace(self.floor, read_bandwidth=self.moment_bandwidth)

    @property
    def over_moment_floor(self) -> float | None:
        """The median cost as a multiple of the moment's floor."""
        floor = self.moment_floor
        return None if floor is None else self.median_ms / floor.ms


def forward_weight_bytes(model: Transformer, tokens: int) -> int:
    """Bytes of weights, as stored, that a forward of `tokens` tokens reads: every layer's, the final norm's and the
    output layer's, and the tokens' rows of the embedding table (none where the output layer is the table)."""
    backbone = model.model
    read = model.weight_bytes_read()
    if weight_bytes(backbone.layers, backbone.norm, model.lm_head, backbone.embed_tokens) == read:
        return read  # the output layer reads the whole table
    return read + tokens * weight_bytes(backbone.embed_tokens) // model.config.vocab_size


def view_lengths(cache: KVCache, start: int, tokens: int) -> list[int]:
    """Per layer, the slots of the view [context | the new tokens] a forward of `tokens` tokens from position `start`
    attends to: the full cache's positions held, the retrieval cache's chosen chunks and recent positions, the
    StreamingLLM cache's sinks and window."""
    if isinstance(cache, RetrievalCache):
        held = cache.budget + start - cache.selected_until + tokens
        return [held - first for first in cache.first_slots]
    if isinstance(cache, StreamingCache):
        return [cache.slot(start) + tokens - first for first in cache.first_slots]
    if isinstance(cache, FullCache):
        return [start + tokens - cache.offset] * cache.keys.shape[0]
    raise TypeError(f"no view lengths for a {type(cache).__name__}")


def attended(view: int, tokens: int, window: int | None) -> tuple[int, int]:
    """The positions a layer must read for `tokens` queries at the end of a view of `view` consecutive positions,
    and the (query, key) pairs its causal mask keeps, within a sliding window where it has one."""
    keys = [view - tokens + row + 1 for row in range(tokens)]  # row i sees the context and the new rows up to i
    if window is None:
        return view, sum(keys)
    return min(view, window + tokens - 1), sum(min(k, window) for k in keys)


def forward_floor(model: Transformer, cache: KVCache, start: int, tokens: int, rates: MachineRates) -> ForwardFloor:
    """The floor of a forward of `tokens` tokens from position `start` on cache as it is now (module docstring).

    A sliding window limits what a layer reads where the view's slots are positions (the full cache); a retrieval
    cache's view of a windowed layer starts within its window already. Keys and values count at the cache's
    element size.
    """
    cfg = model.config
    windows = [cfg.sliding_window(layer) if cache.slots_are_positions else None for layer in range(cfg.num_layers)]
    reads = [attended(view, tokens, w) for view, w in zip(view_lengths(cache, start, tokens), windows, strict=True)]
    positions, pairs = sum(p for p, _ in reads), sum(k for _, k in reads)
    return ForwardFloor(
        weight_bytes=forward_weight_bytes(model, tokens),
        kv_bytes=2 * cfg.num_kv_heads * cfg.head_dim * positions * cache.keys.element_size(),
        linear_flops=2 * tokens * linear_weights(model),
        attention_flops=4 * cfg.num_heads * cfg.head_dim * pairs,
        read_bandwidth=rates.read_bandwidth,
        flops_rate=rates.arithmetic_rate,
    )


MIN_ROUNDS = 9  # rounds of every forward at least: a median of 3 moved with the machine's minute


def _time_forward(model: LoadedModel, cache: KVCache, new_ids: torch.Tensor, start: int) -> float:
    """Milliseconds of one forward called as decoding calls it (in the mode decoding runs it: rounds.forward_mode);
    on a GPU it ends when the device has finished it, not when it was queued."""
    with forward_mode(model.model):
        began = time.perf_counter()
        model.model(new_ids, start, cache, num_logits=len(new_ids))
        if new_ids.is_cuda:
            torch.cuda.synchronize(new_ids.device)
        elapsed = 1000 * (time.perf_counter() - began)
    cache.rollback(start)
    return elapsed


def drafter_cache(
    target: LoadedModel, drafter: LoadedModel, prompt_ids: list[int], config: EngineConfig
) -> StreamingCache:
    """The drafter's StreamingLLM cache as an engine of config builds it (cache_pool.new_streaming) and decoding
    leaves it after the prompt: its sinks and the positions after them that prefill.prefill_drafter leaves, which a
    drafter step reads."""
    spec = CacheSpec(target, drafter.model, config, model_drafter=True)
    streaming = new_streaming(spec, spec.capacities(len(prompt_ids)))
    prefill_drafter(drafter, streaming, prompt_ids, spec.prefill_block, config)
    return streaming


def measure_forward_costs(
    prompt: str,
    target: LoadedModel,
    state: PromptState,
    token_counts: tuple[int, ...],
    repeats: int,
    budget: int,
    chunk_size: int,
    rates: MachineRates | None = None,
    drafter: LoadedModel | None = None,
    config: EngineConfig | None = None,
) -> list[ForwardCost]:
    """Median-ready timings of forwards of each token count, full cache first, then the retrieval cache; each with
    its floor where rates are given. With a drafter, last one drafter step (one token) on its cache as config's
    sinks and window leave it after the prompt (drafter_cache).

    Every forward is timed once a round, in turn with the others, for max(repeats, MIN_ROUNDS) rounds after one
    untimed round, so that what the machine does meanwhile falls on all of them alike. Where rates are given, each
    round ends by reading COPY_BYTES as the rates' read bandwidth was measured (eight times a 32 MiB L3 cache: a
    smaller read was served from it in part): the rate of that minute, beside the set-up's
    (ForwardCost.moment_bandwidth).
    """
    cfg = target.model.config
    context, held = state.prompt_ids.shape[0], state.keys.shape[2]
    most = max(token_counts)
    window = cfg.shared_window if held < context else None  # a state that kept only the window: as it was held
    cache_dtype = kv_dtype(target.device, target.dtype)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, held + most, cache_dtype, target.device)
    full = FullCache(*shape, window=window)
    state.restore(full)
    retrieval = RetrievalCache(full, budget, chunk_size, chunk_size + most, windows=cfg.sliding_windows)
    retrieval.select_chunks()
    new_ids = state.prompt_ids[-most:].to(target.device)  # any tokens: only the cost is measured
    forwards = [
        (name, target, cache, count)
        for name, cache in (("full", full), ("retrieval", retrieval))
        for count in token_counts
    ]
    if drafter is not None:
        streaming = drafter_cache(target, drafter, state.prompt_ids.tolist(), config or EngineConfig())
        forwards.append(("drafter", drafter, streaming, 1))
    times: list[list[float]] = [[] for _ in forwards]
    probe = None if rates is None else read_probe(COPY_BYTES)
    bandwidths = []
    for round_ in range(max(repeats, MIN_ROUNDS) + 1):  # the first round warms up
        for timed, (_, model, cache, count) in zip(times, forwards, strict=True):
            ms = _time_forward(model, cache, new_ids[:count], context)
            if round_:
                timed.append(ms)
        if probe is not None and round_:
            bandwidths.append(COPY_BYTES / best_seconds(probe, repeats=2))
    moment = statistics.median(bandwidths) if bandwidths else None
    return [
        ForwardCost(
            prompt,
            context,
            name,
            count,
            ms,
            None if rates is None else forward_floor(model.model, cache, context, count, rates),
            moment,
        )
        for (name, model, cache, count), ms in zip(forwards, times, strict=True)
    ]
