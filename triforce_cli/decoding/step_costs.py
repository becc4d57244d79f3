"""What each tier's forwards cost, predicted before decoding from the model, the cache and the machine's rates: the
prices the ``costed`` speculation-length policy weighs (speculation_length.py).

A forward of T tokens attending to P cached positions is priced as

    FORWARD + layers * LAYER + max(R, W + A) + (T - 1) * A - (SHARED * A where T > 1),
    R = (weight bytes + key and value bytes of P positions) / read bandwidth,
    W = (KEY_WORK * layers * kv_heads * head_dim * P + WEIGHT_WORK * linear weights) / (arithmetic rate * efficiency),
    A = (2 * linear weights + 4 * heads * head_dim * P * layers) / (arithmetic rate * efficiency)

from the floor terms of `triforce bench --forward-costs` (bench/forward_costs.py), R and A, and the work a forward's
kernels do once whatever its tokens, W: each cached key and value widened from float16 and each packed weight
unpacked into registers, which every row of a verification then reuses. On a 2-core CPU that work, not the memory,
bounds a 1-token forward (a decode step's attention over 7,168 positions took about 12 ns a cached key and KV head
on the two cores, whatever the minute's bandwidth, where its 256 bytes read in 7.4 ns at 34.7 GB/s), so that one
token costs W + A and each further one A, but for the second, whose rows go through the first token's tiles of
the attention (3 grouped query heads a token: 6 rows fill one tile, a third token's start another) and save a
share of it. The fixed costs per forward and per layer, the efficiency, the work per key and weight and the share
are fitted to what `--forward-costs` measured on a 2-core EPYC (Zen 4, a 232.5 GFLOP/s FMA peak)
with the embedded model, as ratios to the same prompt's 1-token full-cache forward (the decisions weigh nothing
else): forwards of 1, 2, 3 and 6 tokens on the full and the retrieval caches at 7,168 and 32,768 positions and the
drafter's step, with the kept read bandwidth at 34.7 GB/s and at 54.8 (one minute's reading: the prices must not
swing with it). At 7,168 positions the full cache's took 10.8-12.3, 14.1-15.6, 19.8-21.7 and 34.1-36.0 ms, the
retrieval cache's 6.0-6.8, 8.1-8.9, 9.7-11.1 and 17.2-18.0, the drafter's step 1.6-1.8; at 32,768 the full cache's
26.4-35.4, 39.7-44.5, 60.5-66.0 and 107-113, the retrieval cache's 5.0-7.0, 7.0-8.8, 9.0-11.4 and 16.2-18.5. Priced
over the 1-token forward, each lies within 0.84-1.20 of its measured ratio, verifications on the full cache within
0.87-1.20, and the same with either reading; the prices before (140 us a layer and nothing else) put the retrieval
tier at 1.19-1.47 and the drafter at 0.75-0.82 with the 34.7 GB/s reading, and with the 54.8 one priced a
verification of one draft at 32K at 1.8 plain steps (measured 1.26-1.43), so that the default stopped drafting.

A retrieval tier also chooses its chunks again (RetrievalCache.select_chunks) every refresh_interval verifications
of the tier above, and before a probe after own steps; a choice is priced as

    layers * kv_heads * SELECT + (2 * chosen key and value bytes + SUMMARY_WORK * summary bytes) / read bandwidth,

the chosen chunks' keys and values read from the full cache and written into the retrieval cache, the chunks'
float16 summaries copied to float32 and scored against the queries (SUMMARY_WORK times their bytes, fitted), and
a fixed cost per layer and KV head (the gather's copies, the choice of the best chunks). Timed alone over a random
cache on the same CPU, a later choice took 6.1, 7.0, 11.0 and 14.3 ms at 2,048, 7,168, 16,384 and 32,768 positions
(budget 1,024, chunks of 16; priced at 33 GB/s 6.0, 7.4, 9.8 and 14.0). The costed policy shares a choice out over
the verifications between two (speculation_length.StepCosts): at 7,168 positions it is what keeps the retrieval
tier's drafts from paying even were every one accepted, so the target takes its own steps without probing them.

The rates are those `triforce bench` and `triforce info` keep for this machine (plan/rates.py), read, never measured
here; without them, NOMINAL's for the device type. They are fixed before decoding and the same from run to run on
one machine, so a seeded sampled run, whose every choice of the costed policy follows these prices and the
acceptance counts alone, repeats its tokens exactly (timing the forwards after the prefill would price them more
closely, but differently in every run). Rates measured again (`triforce cache clear --measurements`) may change how
much such a run drafts, never the distribution of its tokens.
"""

from dataclasses import dataclass

from triforce_cli.cache import FullCache, KVCache, RetrievalCache, StreamingCache
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.prefill import DRAFTER_READS
from triforce_cli.decoding.speculation_length import StepCosts
from triforce_cli.decoding.speculative import FallbackProposer, ModelTier, Proposer, set_up_tier
from triforce_cli.runtime.measurements import kept_machine_rates
from triforce_cli.runtime.model import Transformer


@dataclass(frozen=True)
class MachineBalance:
    """What the prices divide by: bytes/s read, float32 FLOP/s, seconds of fixed cost per layer and forward, and
    bytes/s from host memory to the device, over which an offloaded full cache streams its keys and values."""

    read_bandwidth: float
    flops: float
    layer_overhead_s: float
    transfer_bandwidth: float
    arithmetic_efficiency: float = 1.0  # the share of `flops` a forward's kernels reach
    forward_overhead_s: float = 0.0  # a forward's fixed cost besides its layers'
    # a forward's work once whatever its tokens, in FLOPs at the arithmetic rate: per cached key and value column of
    # a layer's KV head (widening both), and per weight of its linears (unpacking it)
    key_work: float = 0.0
    weight_work: float = 0.0
    second_token_share: float = 0.0  # the share of a second token's arithmetic its rows save in the first's tiles
    # a retrieval tier's choice of chunks: seconds per layer and KV head, and the passes over the chunks' summaries
    # its scoring costs, in bytes read
    select_overhead_s: float = 0.0
    summary_work: float = 0.0


# A CPU forward's costs beyond its bytes and arithmetic (fixed, and its kernels' once-a-forward work) and the share of
# the measured FLOP rate its kernels reach, as `triforce bench --forward-costs` shows them on a 2-core EPYC (Zen 4)
# at 7,168 and 32,768 positions (module docstring); on CUDA the planner's CUDA-graph figure (plan/presets.py) alone
LAYER_OVERHEAD_S = {"cpu": 40e-6, "cuda": 15e-6}
CPU_FORWARD_OVERHEAD_S = 0.4e-3  # the embedding, the output layer's spread, the host work around the step
CPU_KEY_WORK = 6.0
CPU_WEIGHT_WORK = 2.0
CPU_SECOND_TOKEN_SHARE = 0.3
CPU_SELECT_OVERHEAD_S = 45e-6
CPU_SUMMARY_WORK = 12.0
CPU_ARITHMETIC_EFFICIENCY = 0.9  # of a matrix product's rate, where no FMA peak was measured
# of the FMA peak: the same prices, 0.9 of the 182 GFLOP/s of a matrix product measured beside 235 GFLOP/s of peak in
# a quiet minute; the peak, bound by the cores alone, measures 221-235 GFLOP/s from minute to minute where the matrix
# product measured 138-182, and a price that moved with it drafted at 32K in one set-up and not in the next; the fit
# above puts each further token's arithmetic at 0.7 of the peak too
CPU_PEAK_EFFICIENCY = 0.7
PCIE_BANDWIDTH = 25e9  # the planner's PCIe 4.0 x16 with pinned memory (plan/presets.py)


def cpu_balance(read_bandwidth: float, flops: float, efficiency: float) -> MachineBalance:
    """A CPU's balance from its read bandwidth (bytes/s, also what an offloaded cache crosses at), FLOP/s and the
    share of them its kernels reach, with the CPU's fitted costs beyond bytes and arithmetic."""
    return MachineBalance(
        read_bandwidth,
        flops,
        LAYER_OVERHEAD_S["cpu"],
        read_bandwidth,
        efficiency,
        CPU_FORWARD_OVERHEAD_S,
        CPU_KEY_WORK,
        CPU_WEIGHT_WORK,
        CPU_SECOND_TOKEN_SHARE,
        CPU_SELECT_OVERHEAD_S,
        CPU_SUMMARY_WORK,
    )


NOMINAL = {
    "cpu": cpu_balance(30e9, 186e9, CPU_ARITHMETIC_EFFICIENCY),  # a 2-core EPYC's
    # a data-centre GPU: a forward costs its bytes, its arithmetic hardly
    "cuda": MachineBalance(2e12, 300e12, LAYER_OVERHEAD_S["cuda"], PCIE_BANDWIDTH),
}


def kept_rates() -> tuple[float, float, float] | None:
    """(read bandwidth, float32 FLOP/s, the share of it a forward's kernels reach) of this machine as plan/rates.py
    keeps them beside the measured set-ups: the FMA peak where it was measured, else a matrix product's rate; None
    where none are kept for this machine (or the record cannot be read)."""
    kept = kept_machine_rates()
    try:
        if kept is None:
            return None
        if kept.get("peak_flops"):
            return float(kept["read_bandwidth"]), float(kept["peak_flops"]), CPU_PEAK_EFFICIENCY
        return float(kept["read_bandwidth"]), float(kept["flops"]), CPU_ARITHMETIC_EFFICIENCY
    except (KeyError, TypeError, ValueError):
        return None


def machine_balance(device_type: str) -> MachineBalance:
    """The kept rates of this machine for a CPU, else NOMINAL's for the device type."""
    rates = kept_rates() if device_type == "cpu" else None
    if rates is None:
        return NOMINAL.get(device_type, NOMINAL["cuda"])
    return cpu_balance(*rates)


def linear_weights(model: Transformer) -> int:
    """Weights of every linear a forward multiplies each token by: the layers' projections and the output layer
    (its rows for the tokens it computes logits for)."""
    cfg = model.config
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    attention = cfg.hidden_size * qkv_rows + cfg.num_heads * cfg.head_dim * cfg.hidden_size
    layer = attention + 3 * cfg.hidden_size * cfg.intermediate_size
    output_rows = cfg.vocab_size if model.output_ids is None else len(model.output_ids)
    return cfg.num_layers * layer + output_rows * cfg.hidden_size


def attended_positions(cache: KVCache) -> int:
    """Cached positions a forward on cache reads, as it is after the prefill: the whole prompt, the retrieval
    budget, the StreamingLLM sinks and window."""
    if isinstance(cache, RetrievalCache):
        return cache.budget
    if isinstance(cache, StreamingCache):
        return cache.sink_tokens + cache.window
    if isinstance(cache, FullCache):
        return cache.length
    raise TypeError(f"no attended positions for a {type(cache).__name__}")


def forward_seconds(model: Transformer, cache: KVCache, tokens: int, balance: MachineBalance) -> float:
    """The price of a forward of `tokens` tokens on cache (the module docstring's formula); an offloaded full
    cache's keys and values cross to the device meanwhile, and the longer of the two is the price."""
    cfg = model.config
    positions = attended_positions(cache)
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * positions * cache.keys.element_size()
    read_bytes = model.weight_bytes_read() + kv_bytes
    weights = linear_weights(model)
    rate = balance.flops * balance.arithmetic_efficiency
    per_token = (2 * weights + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * positions) / rate
    key_columns = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * positions
    once = (balance.key_work * key_columns + balance.weight_work * weights) / rate
    compute = max(read_bytes / balance.read_bandwidth, once + per_token) + (tokens - 1) * per_token
    if tokens > 1:
        compute -= balance.second_token_share * per_token
    if isinstance(cache, FullCache) and cache.stream is not None:
        compute = max(compute, kv_bytes / balance.transfer_bandwidth)
    return balance.forward_overhead_s + cfg.num_layers * balance.layer_overhead_s + compute


def draft_seconds(proposer: Proposer | None, balance: MachineBalance) -> float:
    """The price of one token drafted by proposer: a model tier's 1-token forward (its own step, though it may
    draft for less), nothing for the n-gram lookup, the fallback's where the n-gram drafts first."""
    if isinstance(proposer, ModelTier):
        return forward_seconds(proposer.model, proposer.cache, 1, balance)
    if isinstance(proposer, FallbackProposer):
        return max(draft_seconds(proposer.first, balance), draft_seconds(proposer.fallback, balance))
    if isinstance(proposer, NGramProposer) or proposer is None:
        return 0.0
    raise TypeError(f"no price for drafts of a {type(proposer).__name__}")


def selection_seconds(proposer: Proposer | None, balance: MachineBalance) -> float:
    """The price of one choice of chunks for drafts from proposer (the module docstring's formula): a retrieval
    tier's, which it makes every refresh_interval verifications; 0 for any other proposer."""
    if not isinstance(proposer, ModelTier) or proposer.refresh_interval is None:
        return 0.0
    cache = proposer.cache
    if not isinstance(cache, RetrievalCache):
        raise TypeError(f"no selection price for a {type(cache).__name__}")
    layers, kv_heads, _, head_dim = cache.keys.shape
    chosen = 2 * layers * kv_heads * cache.budget * head_dim * cache.keys.element_size()  # keys and values
    kinds = cache.chunk_keys.shape[0]  # summaries a chunk: a mean key, or a minimum and a maximum
    chunks = cache.full.length // cache.chunk_size
    summaries = kinds * layers * kv_heads * chunks * head_dim * cache.chunk_keys.element_size()
    moved = 2 * chosen + balance.summary_work * summaries
    return layers * kv_heads * balance.select_overhead_s + moved / balance.read_bandwidth


def refresh_interval(proposer: Proposer | None) -> int:
    """Verifications between two choices of chunks by proposer (a retrieval tier's), 1 for any other."""
    if isinstance(proposer, ModelTier) and proposer.refresh_interval is not None:
        return proposer.refresh_interval
    return 1


def set_up_seconds(proposer: Proposer | None, balance: MachineBalance) -> float:
    """The price of the set-up drafts from proposer would run first (set_up_tier: a drafter's StreamingLLM
    prefill, of its sinks and DRAFTER_READS windows), 0 for none: priced as one forward of those tokens, each with
    its logits, which is above what a prefill computing the last one's alone costs."""
    tier = set_up_tier(proposer, next_step=False)
    if tier is None:
        return 0.0
    cache = tier.cache
    if not isinstance(cache, StreamingCache):
        raise TypeError(f"no set-up price for a {type(cache).__name__}")
    return forward_seconds(tier.model, cache, cache.sink_tokens + DRAFTER_READS * cache.window, balance)


def price_tiers(top: ModelTier) -> None:
    """Price every tier under the costed policy from top down, before its first step (ModelTier.price)."""
    balance = machine_balance(top.model.device.type)
    tier: Proposer | None = top
    while isinstance(tier, ModelTier):
        if tier.proposer is not None and tier.length.policy == "costed":
            forward = tuple(forward_seconds(tier.model, tier.cache, n, balance) for n in range(1, tier.gamma + 2))
            costs = StepCosts(
                forward,
                proposer=draft_seconds(tier.proposer, balance),
                shortcut=draft_seconds(tier.shortcut, balance),
                proposer_set_up=set_up_seconds(tier.proposer, balance),
                shortcut_set_up=set_up_seconds(tier.shortcut, balance),
                proposer_selection=selection_seconds(tier.proposer, balance),
                shortcut_selection=selection_seconds(tier.shortcut, balance),
                proposer_refresh=refresh_interval(tier.proposer),
                shortcut_refresh=refresh_interval(tier.shortcut),
            )
            tier.price(costs)
        tier = tier.proposer
