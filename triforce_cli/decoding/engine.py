"""The generation engine: load once, then generate for many prompts.

Data path (docs/architecture.md): chunked prefill of target@full -> retrieval cache selected with the last prompt token's
queries -> drafter StreamingLLM cache -> loop of top-tier steps, each rolling every cache back to the accepted
length and refreshing the retrieval cache on its policy.

The caches are allocated once and kept across generations, sized as decoding/sizing.py says (EngineConfig.
cache_positions for an engine serving many prompts, else the first prompt; grown, the old buffers released first,
for a longer one). They keep their addresses, so fixed-shape decode steps, whose recordings hold them
(runtime/graphs.py), are recorded once per padded length and cache: those decoding takes (_recorded_steps) on the
first generation, before its prefill (an offloaded full cache's, per length bucket, after it), timed apart as
compile_seconds; any other length on first use.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from triforce_cli.cache import FullCache, KVCache, RetrievalCache, StreamingCache, kv_dtype
from triforce_cli.decoding.clock import DeviceClock
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sampling import probabilities, sample
from triforce_cli.decoding.sizing import (
    ACTIVATIONS_ITEM,
    HOST_ADVICE,
    WEIGHT_ITEMS,
    CacheKind,
    Capacities,
    MemoryItem,
    MemoryPlan,
    activation_item,
    cache_items,
    capacities,
    memory_advice,
    staged_item,
)
from triforce_cli.decoding.speculation_length import SOURCE_POLICIES
from triforce_cli.decoding.speculative import FallbackProposer, ModelTier, Tier, TokenSequence
from triforce_cli.decoding.stats import GenerationResult, GenerationStats
from triforce_cli.decoding.step_costs import price_tiers
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.offload import offload_kv
from triforce_cli.runtime.environment import available_memory, torch_threads
from triforce_cli.runtime.forms import OffloadMode
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS, Transformer, padded_length, weight_bytes
from triforce_cli.runtime.parallel import from_rank_zero, least, shared_seed, world_size
from triforce_cli.runtime.store import human_size

PrefillCallback = Callable[[str, int, int], None]  # (model name, tokens done, tokens total)
TokenCallback = Callable[[list[int], list[str]], None]  # (new token ids, tier that sampled each)
StopCheck = Callable[[], bool]  # asked once before each verification round: True stops the generation there
ChunkCallback = Callable[[float], None]  # seconds one prefill chunk took on the device


# windows of the prompt's last positions the drafter's prefill computes (Engine._prefill_drafter): its cache keeps
# one; the one before gives every kept position the window it would have seen after a prefill of the whole prompt
DRAFTER_READS = 2


@dataclass
class _Caches:
    """The caches an engine keeps across generations, shared with the engines made from it (Engine.reconfigured),
    which generate one at a time: at most one cache of each kind (CacheKind). layouts: per kind, the settings
    its cache was built with, which an engine must share to reuse it; held: per kind, its (device, host) bytes."""

    full: FullCache | None = None
    retrieval: RetrievalCache | None = None
    streaming: StreamingCache | None = None
    layouts: dict[str, tuple] = field(default_factory=dict)
    held: dict[str, tuple[int, int]] = field(default_factory=dict)
    holds: "_Held | None" = None  # what the full cache's first positions hold, for the next prompt to reuse

    def release(self, kind: str) -> None:
        """Drop the cache of kind, so that its buffers are freed before a new one is allocated."""
        if kind == CacheKind.FULL:
            self.holds = None
        setattr(self, kind, None)
        self.layouts.pop(kind, None)
        self.held.pop(kind, None)


@dataclass
class _Held:
    """What the full cache's first positions hold, for the next prompt to keep: positions [0, length) hold the keys
    and values of ids[:length], rotated with the LongRoPE set rope_factors (Transformer.fit_rope; None for other
    RoPE variants). The first `prefilled` of them a prefill computed in chunks of `chunk` from a multiple of it (or
    from any position where exact), the rest decoding's forwards (committed tokens: verified drafts and the tokens
    the target sampled, never a draft rolled back). exact: every position was computed under the numeric contract
    (Engine.exact_positions), so it holds the same bits however its forward grouped it."""

    ids: list[int]
    length: int
    prefilled: int
    chunk: int
    rope_factors: str | None
    exact: bool

    def reusable(self, prompt_ids: list[int], chunk: int, rope_factors: str | None, exact: bool) -> int:
        """Positions a prefill of prompt_ids in chunks of `chunk`, rotated with rope_factors, may keep instead of
        computing, so that every kept position holds what a fresh prefill of prompt_ids would write there, bit for
        bit, short of prompt_ids' last token (its logits are computed).

        exact (this engine computes under the numeric contract) and every held position so computed: the whole
        prefix the ids share, prompt, decoded answer and partial chunks alike, at any length. Otherwise a
        position's bits depend on the forward that computed it: only the whole chunks a prefill with the same
        chunking computed (the same forward of the same tokens on the same cache), none where rope_factors differ.
        """
        if rope_factors != self.rope_factors:
            return 0
        limit = min(self.length, len(prompt_ids) - 1)  # length <= len(ids)
        shared = next((i for i in range(limit) if self.ids[i] != prompt_ids[i]), limit)
        if exact and self.exact:
            return shared
        if exact:  # the prefill's positions are exact whatever the steps after it
            return min(shared, self.prefilled)
        if chunk != self.chunk:
            return 0
        return min(shared, self.prefilled) // chunk * chunk


@dataclass(frozen=True)
class _InUse:
    """The caches one generation uses: the full cache, and the retrieval and StreamingLLM caches of its tiers;
    kept: the prompt positions the full cache kept from what it held (Engine._allocate)."""

    full: FullCache
    retrieval: RetrievalCache | None
    streaming: StreamingCache | None
    kept: int = 0


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        config: EngineConfig,
        drafter: LoadedModel | None = None,
        prefill_threads: int | None = None,
    ):
        """prefill_threads: torch threads for prefill, which is compute-bound and gains from every core even where
        decoding, bound by memory, runs best on fewer; None: the threads torch has."""
        self.target = target
        self.config = config
        self.prefill_threads = prefill_threads
        self.drafter = drafter if config.uses_drafter else None
        if self.drafter is not None:
            self.drafter.check_drafts_for(target)
        self.eos_ids = set() if config.ignore_eos else target.eos_token_ids
        self._caches = _Caches()
        if config.offload == OffloadMode.KV_WEIGHTS and target.model.weight_stream is None:
            raise ConfigError(
                "`offload` kv+weights needs a target loaded with its weights streamed: load_model(...,"
                " offload_weights=True), as Pipeline.load does for this offload"
            )

    @property
    def uses_ngram(self) -> bool:
        """The n-gram drafts: as asked, or by default wherever a model drafter is there to fall back on."""
        if self.config.ngram is None:
            return self.drafter is not None  # kept only by modes with a drafter tier (__init__)
        return self.config.ngram

    @property
    def uses_model_drafter(self) -> bool:
        """A model tier drafts: the given drafter, or the target itself when neither drafter nor n-gram is set."""
        return self.config.uses_drafter and (self.drafter is not None or not self.uses_ngram)

    @property
    def drafter_description(self) -> str | None:
        if not self.config.uses_drafter:
            return None
        ngram = "n-gram prompt lookup (training-free)"
        if not self.uses_model_drafter:
            return ngram
        if self.drafter is None:
            return f"{self.target.name} itself on a StreamingLLM cache (self-speculation: no distilled drafter)"
        return f"{ngram}, else {self.drafter.name}" if self.uses_ngram else self.drafter.name

    @property
    def _drafter_model(self) -> Transformer:
        return self.drafter.model if self.drafter is not None else self.target.model

    @property
    def compiled(self) -> bool:
        """Whether the target runs its decode steps as fixed-shape steps, recorded or compiled (Transformer.use_steps),
        on caches made static."""
        return self.target.model.fixed_step is not None

    @property
    def exact_positions(self) -> bool:
        """Whether every forward on the full cache computes under the numeric contract (docs/architecture.md): a
        float32 target on the CPU with the cpu attention kernels and eager steps, whose kernels compute a row in an
        order of arithmetic that depends neither on the rows beside it nor on the thread count. A position then
        holds the same bits whether a prefill chunk, a verification or a one-token step computed it, and reuse keeps
        whatever the cache holds of a prompt (_Held.reusable). Its prefill is exact with any steps: it runs eager.
        A plain nn.Linear left in the model (one built without the loader's tiled weights) computes by torch's
        products, which are not row-invariant, and leaves the target off the contract."""
        target = self.target
        on_contract = target.device.type == "cpu" and target.dtype == torch.float32
        plain_linears = any(isinstance(module, nn.Linear) for module in target.model.modules())
        return on_contract and not plain_linears and target.model.attention_backend == "cpu" and not self.compiled

    def reconfigured(self, config: EngineConfig, drafter: LoadedModel | None) -> "Engine":
        """An engine for the same target with config and drafter, sharing this engine's caches (and prefill
        threads): a cache it holds is reused where the new engine's layout matches, with the steps compiled on it,
        instead of being allocated again beside it. The two generate one at a time."""
        engine = Engine(self.target, config, drafter, self.prefill_threads)
        engine._caches = self._caches
        return engine

    def _capacities(self, prompt_tokens: int) -> Capacities:
        """The positions of each cache for a generation after prompt_tokens (sizing.capacities), a full cache held
        with this engine's layout kept where it is large enough."""
        held = self._caches.full
        kept = held is not None and self._caches.layouts[CacheKind.FULL] == self._full_layout()
        return capacities(
            self.config,
            prompt_tokens,
            compiled=self.compiled,
            device_type=self.target.device.type,
            model_drafter=self.uses_model_drafter,
            held=held.capacity if kept else 0,
            window=self._full_window(),
        )

    def _full_window(self) -> int | None:
        """The sliding window every layer of the target shares, the only positions its full cache keeps (FullCache's
        window); None where the cache keeps every position: a target with layers of other windows or none, or a
        cache offloaded to host memory, whose streaming and layer-wise prefill take every position."""
        return None if self.offloaded else self.target.model.config.shared_window

    def _full_layout(self) -> tuple:
        """What a held full cache must have been built with for this engine to reuse it, besides room enough: where
        it lives (the host, with its on-chip layers), whether steps on it compile and, keeping only a window, the
        retrieval chunk its first position is a multiple of."""
        offloaded = self.offloaded
        align = self.config.chunk_size if self._full_window() else None
        return offloaded, self.config.on_chip_layers if offloaded else 0, self.compiled, align

    def _layout(self, kind: str, caps: Capacities) -> tuple:
        """What a held cache of kind (CacheKind) must have been built with for this engine to reuse it, besides
        room enough: the full cache's _full_layout; the retrieval cache's chunks, recent region and compiled steps;
        the drafter cache's shape, sliding windows and compiled steps."""
        cfg = self.config
        if kind == CacheKind.FULL:
            return self._full_layout()
        if kind == CacheKind.RETRIEVAL:
            return cfg.chunk_size, cfg.chunk_score, caps.recent, self.compiled
        draft = self._drafter_model
        shape = draft.config.num_layers, draft.config.num_kv_heads, draft.config.head_dim, draft.config.sliding_windows
        return *shape, cfg.sink_tokens, cfg.draft_window, caps.draft_step, draft.fixed_step is not None

    def _renewal(self, caps: Capacities) -> tuple[list[str], list[str]]:
        """The cache kinds to build for a generation with caps, and the held caches to release before: those
        rebuilt, and the retrieval cache of a full cache rebuilt. A held retrieval cache serves any budget up to
        the one it was built for."""
        held = self._caches
        build = []
        if held.full is None or held.layouts[CacheKind.FULL] != self._full_layout() or held.full.capacity < caps.full:
            build.append(CacheKind.FULL)
        retrieval = held.retrieval
        if self.config.uses_retrieval and (
            CacheKind.FULL in build
            or retrieval is None
            or held.layouts[CacheKind.RETRIEVAL] != self._layout(CacheKind.RETRIEVAL, caps)
            or retrieval.keys.shape[2] - retrieval.recent_capacity < caps.budget
        ):
            build.append(CacheKind.RETRIEVAL)
        if self.uses_model_drafter and held.layouts.get(CacheKind.STREAMING) != self._layout(CacheKind.STREAMING, caps):
            build.append(CacheKind.STREAMING)
        replaced = [*build, *([CacheKind.RETRIEVAL] if CacheKind.FULL in build else [])]
        return build, [kind for kind in CacheKind if kind in replaced and getattr(held, kind) is not None]

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward on the target's device (EngineConfig.prefill_block_on)."""
        return self.config.prefill_block_on(self.target.device.type)

    @property
    def offloaded(self) -> bool:
        """Whether the full KV cache lives in host memory (EngineConfig.offload kv or kv+weights). `offload` kv with
        every layer on chip offloads nothing: the cache is then the device's alone, as without offload (no host
        storage to write back to, fixed-shape steps)."""
        cfg = self.config
        if cfg.offload == OffloadMode.KV and cfg.on_chip_layers >= self.target.model.config.num_layers:
            return False
        return cfg.offload != OffloadMode.NONE

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of every cache of this engine's models (cache.kv_dtype): float16 for a float32 target on the
        CPU, else the target's dtype."""
        return kv_dtype(self.target.device, self.target.dtype)

    def memory_plan(self, prompt_tokens: int) -> MemoryPlan:
        """What a generation after prompt_tokens holds, and where, before anything is allocated: the models'
        weights, and the caches as sizing.cache_items sizes them (the full, retrieval and StreamingLLM caches, the
        compiled steps' queries and, offloaded, the device's on-chip layers and ring), a full cache held that is
        large enough at its own size, and one prefill forward's activations (sizing.prefill_activation_bytes)."""
        caps = self._capacities(prompt_tokens)
        target, itemsize, kv_itemsize = self.target.model.config, self.target.dtype.itemsize, self.kv_dtype.itemsize
        items = [*self._weight_items()]
        items += cache_items(
            self.config,
            caps,
            target,
            self._drafter_model.config,
            itemsize,
            kv_itemsize,
            compiled=self.compiled,
            offloaded=self.offloaded,
        )
        if self.offloaded:
            items.append(staged_item(target, caps, kv_itemsize, self.config.on_chip_layers))
        items.append(activation_item(target, self.prefill_chunk, itemsize))
        held = tuple(item for item in items if item.device_bytes or item.host_bytes)
        return MemoryPlan(str(self.target.device), held)

    def _weight_items(self) -> list[MemoryItem]:
        """The weights' items of the memory plan: all on the device, or, streamed, the layers from on_chip_layers on
        in host memory and two of them at a time on the device."""
        stream = self.target.model.weight_stream
        if stream is None:
            return [MemoryItem("weights", weight_bytes(self.target.model, self._drafter_model), 0)]
        model = self.target.model
        fixed = (model.model.embed_tokens, model.model.norm, model.lm_head)  # never streamed
        resident = weight_bytes(*fixed, self._drafter_model) + stream.first * stream.layer_bytes
        streamed = (len(stream.layers) - stream.first) * stream.layer_bytes
        return [
            MemoryItem("weights", resident, 0),
            MemoryItem("streamed weights", 0, streamed),
            MemoryItem("weight ring", stream.device_bytes, 0),
        ]

    def cache_bytes(self, prompt_tokens: int) -> int:
        """Bytes of the caches (everything but the weights and a prefill's activations) a generation after
        prompt_tokens holds."""
        plan = self.memory_plan(prompt_tokens)
        other = sum(plan.bytes_of(name) for name in (*WEIGHT_ITEMS, ACTIVATIONS_ITEM))
        return plan.device_bytes + plan.host_bytes - other

    def check_memory(self, prompt_tokens: int) -> None:
        """A ConfigError with the figures, before any allocation, where what a generation after prompt_tokens
        allocates cannot fit the device (or, the full cache offloaded, the host): the caches it builds, less those
        it releases first (_allocate). The weights and the caches it keeps are there already.

        Under tensor parallelism every rank checks against the least free memory of any rank (parallel.least): a
        rank that refused alone would leave the others waiting in the prefill's all-reduces."""
        build, release = self._renewal(self._capacities(prompt_tokens))
        built = self.memory_plan(prompt_tokens).bytes_by_kind()
        held = self._caches.held
        needed = [sum(built[k][i] for k in build) - sum(held[k][i] for k in release) for i in (0, 1)]
        for where, bytes_needed, advice in (
            (
                self.target.device,
                needed[0],
                memory_advice(device_type=self.target.device.type, offloaded=self.offloaded),
            ),
            (torch.device("cpu"), needed[1], HOST_ADVICE),
        ):
            free = least(available_memory(where), self.target.device)
            if bytes_needed > 0 and free is not None and bytes_needed > free:
                raise ConfigError(
                    f"the KV caches for {prompt_tokens} prompt tokens and {self.config.max_new_tokens} new ones need"
                    f" {human_size(bytes_needed)} on {where}, which has {human_size(free)} free: {advice}"
                )

    def _allocate(self, prompt_tokens: int, keep: int = 0) -> _InUse:
        """This engine's caches for a generation after prompt_tokens, emptied, the retrieval cache set to the
        prompt's budget: those held where they fit (sizing's policy), the others built after a memory check and
        after the caches they replace are released. The target and the drafter take the RoPE frequencies of a
        context of prompt_tokens + max_new_tokens for every forward until the next allocation (fit_rope).

        keep: prompt positions to keep in a full cache that is held, with the retrieval cache's summaries of the
        chunks they fill (a prefix shared with what the cache holds, _Held.reusable); _InUse.kept says how many
        were kept: none where the full cache is built anew, or keeps only a window and dropped a position a
        forward from keep reads (FullCache.can_write_from).
        """
        cfg = self.config
        for loaded in (self.target, self.drafter):
            if loaded is not None:  # the RoPE frequencies of every forward of this generation (LongRoPE's set)
                loaded.model.fit_rope(prompt_tokens + cfg.max_new_tokens)
        caps = self._capacities(prompt_tokens)
        build, release = self._renewal(caps)
        caches = self._caches
        kept = 0 if CacheKind.FULL in build or not caches.full.can_write_from(keep) else keep
        if build:
            self.check_memory(prompt_tokens)
            sizes = self.memory_plan(prompt_tokens).bytes_by_kind()
            for kind in release:
                caches.release(kind)
            builders = {
                CacheKind.FULL: self._new_full,
                CacheKind.RETRIEVAL: self._new_retrieval,
                CacheKind.STREAMING: self._new_streaming,
            }
            for kind in build:
                setattr(caches, kind, builders[kind](caps))
                caches.layouts[kind] = self._layout(kind, caps)
                caches.held[kind] = sizes[kind]
        caches.full.rollback(kept)  # 0: empty
        if caches.holds is not None:
            caches.holds.length = min(caches.holds.length, kept)
        retrieval = caches.retrieval if cfg.uses_retrieval else None
        if retrieval is not None:
            retrieval.reset(0 if CacheKind.RETRIEVAL in build else kept)
            # at most the budget it was built for: the recent region then starts sooner, within the same buffers
            retrieval.budget = cfg.budget_for(prompt_tokens)
        streaming = caches.streaming if self.uses_model_drafter else None
        if streaming is not None:
            streaming.reset()
        return _InUse(caches.full, retrieval, streaming, kept)

    def _new_full(self, caps: Capacities) -> FullCache:
        model = self.target.model.config
        device = self.target.device
        shape = (model.num_layers, model.num_kv_heads, model.head_dim, caps.full, self.kv_dtype)
        if self.offloaded:
            full = FullCache(*shape, "cpu")  # offload_kv pins it, exactly its bytes
            offload_kv(full, device, self.config.on_chip_layers)
        else:
            full = FullCache(*shape, device, window=self._full_window(), align=self.config.chunk_size)
        if self.compiled:
            full.make_static(model.num_heads, MAX_STEP_TOKENS, self.target.dtype)
        return full

    def _new_retrieval(self, caps: Capacities) -> RetrievalCache:
        cfg = self.config
        retrieval = RetrievalCache(
            self._caches.full,
            caps.budget,
            cfg.chunk_size,
            caps.recent,
            self.target.device,
            cfg.chunk_score,
            self.target.model.config.sliding_windows,
        )
        if self.compiled:
            retrieval.make_static()
        return retrieval

    def _new_streaming(self, caps: Capacities) -> StreamingCache:
        cfg, draft = self.config, self._drafter_model.config
        streaming = StreamingCache(
            draft.num_layers,
            draft.num_kv_heads,
            draft.head_dim,
            cfg.sink_tokens,
            cfg.draft_window,
            caps.draft_step,
            self.kv_dtype,
            self.target.device,
            draft.sliding_windows,
        )
        if self._drafter_model.fixed_step is not None:
            streaming.make_static()
        return streaming

    def _recorded_steps(self, caches: _InUse) -> Iterator[tuple[Transformer, KVCache, int]]:
        """The fixed-shape decode steps a generation takes: (model, cache, most tokens of one step). The full tier
        verifies its proposer's drafts and one token more; the retrieval tier gamma1 drafts and one more (one
        without a drafter); the drafter writes its last token and the bonus token of each tier above it, which it
        has not seen (ModelTier._forward). Its longer writes, of committed tokens it catches up on, run eager."""
        cfg = self.config
        top = cfg.gamma2 if cfg.uses_retrieval else cfg.gamma1 if cfg.uses_drafter else 0
        steps = [(self.target.model, caches.full, top + 1)]
        if caches.retrieval is not None:
            steps.append((self.target.model, caches.retrieval, cfg.gamma1 + 1 if cfg.uses_drafter else 1))
        if caches.streaming is not None:
            above = 2 if caches.retrieval is not None else 1
            steps.append((self._drafter_model, caches.streaming, min(1 + above, caches.streaming.max_write)))
        for model, cache, longest in steps:
            if model.fixed_step is not None and cache.write_start is not None:
                yield model, cache, longest

    def _warm_up(self, caches: _InUse, prefilled: bool = False) -> float:
        """Record every padded length of every fixed-shape step (_recorded_steps) not yet recorded on these caches,
        and return the seconds it took. Each step runs at the cache's current length, written past what the cache
        holds and rolled back after, so a prefix kept from the last prefill (and the retrieval cache's summaries of
        its chunks) stays. The drafter's cache records no step longer than its longest (StepGraphs.limit).

        An offloaded full cache's steps are recorded per length bucket (KVCache.step_slots), which the prompt
        decides: they are recorded after the prefill (prefilled), at the prompt's length; the others before it."""
        pending = []
        for model, cache, longest in self._recorded_steps(caches):
            if (cache is caches.full and self.offloaded) != prefilled:
                continue
            if cache is caches.streaming:
                model.step_graphs.limit(cache, padded_length(longest))
            lengths = [1 << power for power in range(padded_length(longest).bit_length())]
            held = cache.length
            pending += [
                (model, cache, n) for n in lengths if not model.step_graphs.holds(cache, n, cache.step_slots(held + n))
            ]
        if not pending:
            return 0.0
        started = time.perf_counter()
        for model, cache, length in pending:
            held = cache.length
            model(torch.zeros(length, dtype=torch.long, device=self.target.device), held, cache, num_logits=1)
            cache.rollback(held)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)  # the warm-up's work stays out of the prefill's time
        return time.perf_counter() - started

    def _build_tiers(self, caches: _InUse, generator: torch.Generator) -> ModelTier:
        """The tiers of this engine's mode, built on caches, each the proposer of the one above; the top one."""
        cfg = self.config
        policy = cfg.speculation_policy
        if policy == "throughput" and world_size() > 1:
            policy = "heuristic"  # the clock differs between ranks; acceptance, which heuristic follows, does not
        shared = {"sampling": cfg.sampling, "generator": generator, "gamma_policy": policy}
        target = self.target.model
        drafter = None
        if caches.streaming is not None:
            drafter = ModelTier(name=Tier.DRAFTER, model=self._drafter_model, cache=caches.streaming, **shared)
        if self.uses_ngram:
            ngram = NGramProposer(target.config.vocab_size, cfg.ngram_max, device=self.target.device)
            drafter = ngram if drafter is None else FallbackProposer(ngram, drafter)
        # drafter is None without a drafter tier: then the tier it would draft for samples every token itself
        if not cfg.uses_retrieval:
            proposer, gamma, shortcut = drafter, cfg.gamma1, None
        else:
            proposer = ModelTier(
                name=Tier.RETRIEVAL,
                model=target,
                cache=caches.retrieval,
                proposer=drafter,
                gamma=cfg.gamma1,
                refresh_interval=cfg.refresh_interval,
                **shared,
            )
            # the throughput policy may skip the middle tier where verifying at it does not pay
            # (speculation_length.py); only a model drafter, which always drafts, makes a shortcut (an n-gram alone
            # often finds nothing)
            gamma, shortcut = cfg.gamma2, drafter if policy in SOURCE_POLICIES and self.uses_model_drafter else None
        return ModelTier(
            name=Tier.TARGET,
            model=target,
            cache=caches.full,
            proposer=proposer,
            gamma=gamma,
            shortcut=shortcut,
            own_steps=True,
            **shared,
        )

    def _prefill(
        self,
        name: str,
        model: Transformer,
        cache,
        ids: list[int],
        on_prefill,
        on_chunk: ChunkCallback | None = None,
        first: int = 0,
    ) -> torch.Tensor:
        """Run the prompt through model in chunks on prefill_threads; return the logits (1, V) after its last token.
        on_chunk receives each chunk's seconds. first: the positions before it are in the cache already (kept from
        what it held, _Held.reusable: a multiple of the chunk but under the numeric contract), the chunks start there.

        A full cache in host memory is prefilled layer by layer (_prefill_layerwise); any other cache chunk by chunk.
        A chunk is timed by the device's clock (DeviceClock): on a GPU to the end of its work, which the host then
        waits for, not to the end of its launch; without on_chunk nothing is timed and nothing waits.
        """
        chunk = self.prefill_chunk
        tokens = torch.tensor(ids, dtype=torch.long, device=self.target.device)
        clock = DeviceClock(tokens.device)
        logits = None
        with torch_threads(self.prefill_threads):
            if isinstance(cache, FullCache) and cache.stream is not None:
                return self._prefill_layerwise(name, model, cache, tokens, on_prefill, on_chunk, first)
            for start in range(first, len(ids), chunk):
                began = clock.mark() if on_chunk is not None else None
                logits = model(tokens[start : start + chunk], start, cache, num_logits=1, decoding=False)
                if on_chunk is not None:
                    on_chunk(clock.seconds(began, clock.mark()))
                if on_prefill is not None:
                    on_prefill(name, min(start + chunk, len(ids)), len(ids))
        return logits

    def _prefill_layerwise(
        self,
        name: str,
        model: Transformer,
        full: FullCache,
        tokens: torch.Tensor,
        on_prefill,
        on_chunk: ChunkCallback | None,
        first: int = 0,
    ) -> torch.Tensor:
        """_prefill of an offloaded full cache, layer by layer (Transformer.prefill_layerwise): each layer's keys and
        values go back to the host once, where chunk by chunk every chunk would stream every layer's whole prefix to
        the device again (about 2 TB over PCIe for 128K tokens of an 8B model).

        The hidden states of the tokens in flight stay on the device: the whole prompt where they take at most half
        of the device's free memory (the rest left to one forward's activations), else segments of as many chunks as
        fit there, each fetching the segments before it once per offloaded layer. on_prefill counts a segment's
        tokens in proportion to the layers done; each chunk of a segment gets the segment's mean seconds on the
        device's clock (as _prefill's chunks do). The retrieval cache in use summarises each layer's chunks from its
        keys on the device as the layer ends (RetrievalCache.summarise_layer), where its first selection would
        average them in host memory. Under tensor parallelism the segments fit the least free memory of any rank
        (parallel.least), so that every rank all-reduces the same segments.
        """
        chunk, total = self.prefill_chunk, len(tokens)
        clock = DeviceClock(tokens.device)
        free = least(available_memory(self.target.device), self.target.device)
        segment = total - first
        if free is not None and model.prefill_layerwise_bytes(segment) > free // 2:
            segment = max(1, free // 2 // model.prefill_layerwise_bytes(chunk)) * chunk
        num_layers = model.config.num_layers
        retrieval = self._caches.retrieval if self.config.uses_retrieval else None
        summarise = retrieval is not None and retrieval.full is full
        logits = None
        for start in range(first, total, segment):
            size = min(segment, total - start)

            def on_layer(layers: int, start: int = start, size: int = size) -> None:
                if summarise:
                    retrieval.summarise_layer(layers - 1, full.stream.layer_keys(layers - 1), start + size)
                if on_prefill is not None:
                    on_prefill(name, start + size * layers // num_layers, total)

            began = clock.mark() if on_chunk is not None else None
            logits = model.prefill_layerwise(tokens[start : start + size], start, full, chunk, on_layer)
            if on_chunk is not None:
                seconds, chunks = clock.seconds(began, clock.mark()), -(-size // chunk)
                for _ in range(chunks):
                    on_chunk(seconds / chunks)
        return logits

    def _prefill_drafter(self, streaming: StreamingCache, prompt_ids: list[int], on_prefill) -> None:
        """Prefill the drafter's StreamingLLM cache with the prompt's sinks and its last DRAFTER_READS windows only.

        Its cache keeps the sinks and the last window, so the positions before those windows would be computed only
        to be evicted; each kept position still sees a window of the ones before it. The time is the same for any
        prompt length, and the same prompt always leaves the same drafter state, prefix reuse or not.
        """
        sinks = min(self.config.sink_tokens, len(prompt_ids))
        resume = max(sinks, len(prompt_ids) - DRAFTER_READS * self.config.draft_window)
        name, model = self.drafter.name, self.drafter.model
        if sinks:
            self._prefill(name, model, streaming, prompt_ids[:sinks], None)
        streaming.start_window_at(resume)
        self._prefill(name, model, streaming, prompt_ids, on_prefill, first=resume)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty after tokenization")
        context = self.target.model.config.max_position_embeddings
        needed = len(prompt_ids) + self.config.max_new_tokens
        if needed > context:
            raise PromptError(
                f"prompt of {len(prompt_ids)} tokens plus {self.config.max_new_tokens} new tokens exceeds"
                f" the {context}-token context of {self.target.name}: use `context_window` {-(-needed // 1024)}k"
                " or more (RoPE scaled with YaRN), a shorter prompt or fewer `max_new_tokens`"
            )
        positions = self.config.cache_positions
        if positions is not None and positions > context:
            raise ConfigError(f"cache positions {positions} exceed the {context}-token context of {self.target.name}")
        if self.config.uses_retrieval:
            self.config.budget_for(len(prompt_ids))

    def prefill(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_chunk: ChunkCallback | None = None,
        capture: bool = True,
    ) -> PromptState | None:
        """Prefill the target once, for reuse by generate(prompt_state=...) and the prompt cache, and by the next
        prompt that starts with these ids (prefix reuse); on_chunk receives each prefill chunk's seconds.

        capture: return a copy of the prefilled state; False: leave it in the full cache alone and return None (a
        document read ahead of the questions about it, triforce chat).
        """
        self.check_prompt(prompt_ids)
        full = self._allocate(len(prompt_ids)).full
        with self._filling(prompt_ids):
            logits = self._prefill(self.target.name, self.target.model, full, prompt_ids, on_prefill, on_chunk)
        return PromptState.capture(full, prompt_ids, logits) if capture else None

    def restore(self, prompt_state: PromptState, next_prompt_tokens: int = 0) -> None:
        """Put a saved prefill into the full cache, as prefill() leaves its prompt there, for the next prompt that
        starts with its ids to keep (prefix reuse); the state was prefilled in this engine's chunks (PromptCache is
        keyed by them). next_prompt_tokens: the length of that next prompt, where known, so that the cache is
        allocated for it once (a cache too small for it is built anew and keeps nothing)."""
        held_ids = prompt_state.held_ids
        self.check_prompt(held_ids)
        self._check_restorable(prompt_state)
        full = self._allocate(max(len(held_ids), next_prompt_tokens)).full
        with self._filling(held_ids):
            prompt_state.restore(full, answer=True)

    def answered_state(self, prompt_state: PromptState) -> PromptState | None:
        """prompt_state (the prefill of the prompt just generated after, its keys and values left out or not) with
        the answer the full cache holds after it (_Held: every committed token but the last), for the prompt cache to
        save in its place, so that a later prompt going on from the answer keeps it too. None where the cache holds
        no answer after that prompt, holds only a window, or where the answer's positions are not a prefill's bits
        (outside the numeric contract, exact_positions). The full cache forgets the positions past what it holds."""
        held, full = self._caches.holds, self._caches.full
        prompt_ids = prompt_state.prompt_ids.tolist()
        exact = held is not None and held.exact and self.exact_positions
        if not exact or held.length <= len(prompt_ids) or held.ids[: len(prompt_ids)] != prompt_ids or full.offset:
            return None
        full.rollback(held.length)
        full.settle()
        _, keys, values = full.held()
        answer_ids = torch.tensor(held.ids[len(prompt_ids) : held.length], dtype=torch.long)
        return replace(prompt_state, answer_ids=answer_ids, keys=keys.clone(), values=values.clone())

    def held_state(self, max_bytes: int | None = None) -> PromptState | None:
        """What the full cache holds that a later prompt may keep (prefix reuse), copied to host memory for
        restore() to put back: every held position under the numeric contract (exact_positions), else only those a
        prefill computed (_Held.reusable's rules). The state is a prefix's, for restore() alone: its last queries and
        logits are left empty, so it never serves its ids whole (generate's prompt_state). None where the cache holds
        nothing, only a window, or (max_bytes given) keys and values of more than max_bytes, which are not copied."""
        held, full = self._caches.holds, self._caches.full
        if held is None or full is None or full.offset:
            return None
        full.settle()
        _, keys, values = full.held()
        length = min(held.length if held.exact and self.exact_positions else held.prefilled, keys.shape[2])
        held_bytes = 2 * keys[:, :, :length].numel() * keys.element_size()  # keys and values
        if length == 0 or (max_bytes is not None and held_bytes > max_bytes):
            return None
        cpu = torch.device("cpu")
        return PromptState(
            torch.tensor(held.ids[:length], dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            keys[:, :, :length].to(cpu, copy=True),  # (layers, Hkv, length, D)
            values[:, :, :length].to(cpu, copy=True),
            torch.zeros(0),
            torch.zeros(0),
        )

    def _check_restorable(self, prompt_state: PromptState) -> None:
        """A ConfigError where prompt_state holds only the prompt's last positions (its full cache kept a sliding
        window) and this engine's full cache keeps every position (offloaded): it lacks the positions before."""
        if prompt_state.first_position and self._full_window() is None:
            raise ConfigError(
                f"the saved prefill holds only the positions from {prompt_state.first_position} on (its full cache"
                " kept the sliding window alone), and this run's full cache keeps every position (`offload`): run"
                " it without `prompt_cache` or without `offload`"
            )

    @contextmanager
    def _filling(self, prompt_ids: list[int]) -> Iterator[None]:
        """Around writing prompt_ids' prefill into the full cache: nothing there to reuse while it runs, and
        prompt_ids once it has finished (an interrupted one leaves nothing)."""
        self._caches.holds = None
        yield
        length = len(prompt_ids)
        rope_factors, exact = self.target.model.rope_factors, self.exact_positions
        self._caches.holds = _Held(list(prompt_ids), length, length, self.prefill_chunk, rope_factors, exact)

    def _prefill_caches(
        self,
        caches: _InUse,
        prompt_ids: list[int],
        stats: GenerationStats,
        on_prefill: PrefillCallback | None,
        prompt_state: PromptState | None,
        on_prompt_state: Callable[[PromptState], None] | None,
    ) -> torch.Tensor:
        """Fill every cache for prompt_ids and return the logits (1, V) after its last token: the full cache
        prefilled from the positions it kept (or restored from prompt_state), the retrieval
        cache's first chunk selection, and the drafter's StreamingLLM cache."""
        full = caches.full
        with self._filling(prompt_ids):
            if prompt_state is None:
                model, chunk_seconds = self.target.model, stats.prefill_chunk_seconds.append
                logits = self._prefill(
                    self.target.name, model, full, prompt_ids, on_prefill, chunk_seconds, first=caches.kept
                )
                stats.reused_tokens = caches.kept
                if on_prompt_state is not None:
                    on_prompt_state(PromptState.capture(full, prompt_ids, logits))
            else:
                prompt_state.restore(full)
                logits = prompt_state.last_logits.to(self.target.device)
                stats.prompt_cached = True
        if caches.retrieval is not None:
            caches.retrieval.select_chunks()
        if caches.streaming is not None:
            if self.drafter is None:
                caches.streaming.fill_from(full)
            else:
                self._prefill_drafter(caches.streaming, prompt_ids, on_prefill)
        return logits

    def generate(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_tokens: TokenCallback | None = None,
        prompt_state: PromptState | None = None,
        on_prompt_state: Callable[[PromptState], None] | None = None,
        should_stop: StopCheck | None = None,
    ) -> GenerationResult:
        """Generate after prompt_ids, restoring prompt_state instead of prefilling when it is given.

        on_prompt_state receives the freshly prefilled prompt (to save it). Ctrl-C stops early and still returns
        what was generated. should_stop is asked before each round of the top tier (once per verification): True
        ends the generation there, with stop_reason "cancelled" (a server's client gone, a stop string written).
        """
        self.check_prompt(prompt_ids)
        if prompt_state is not None and not prompt_state.matches(prompt_ids):
            raise PromptError("the saved prompt state belongs to another prompt")
        if prompt_state is not None:
            self._check_restorable(prompt_state)
        cfg = self.config
        generator = torch.Generator(device=self.target.device)
        seed = cfg.sampling.seed if cfg.sampling.seed is not None else torch.seed()
        generator.manual_seed(shared_seed(seed, self.target.device))
        stats = GenerationStats(cfg.mode, self.drafter_description, len(prompt_ids))
        generated: list[int] = []
        chain: list[ModelTier] = []  # the tiers, top first, once built
        try:
            held = self._caches.holds
            keep = 0
            if prompt_state is None and held is not None:
                rope_factors = self.target.model.rope_factors_for(len(prompt_ids) + cfg.max_new_tokens)
                keep = held.reusable(prompt_ids, self.prefill_chunk, rope_factors, self.exact_positions)
            # 1. allocate
            caches = self._allocate(len(prompt_ids), keep)
            stats.compile_seconds = self._warm_up(caches)
            # 2. prefill every cache, and sample the first token from the prompt's logits
            started = time.perf_counter()
            logits = self._prefill_caches(caches, prompt_ids, stats, on_prefill, prompt_state, on_prompt_state)
            first = int(from_rank_zero(sample(probabilities(logits, cfg.sampling), generator)))
            stats.prefill_seconds = time.perf_counter() - started
            generated.append(first)
            held = self._caches.holds
            held.ids.append(first)
            if on_tokens is not None:
                on_tokens([first], [Tier.TARGET])
            stats.compile_seconds += self._warm_up(caches, prefilled=True)
            # 3. loop: rounds of the top tier
            top = self._build_tiers(caches, generator)
            price_tiers(top)  # the costed policy's prices, fixed before its first step
            chain = self._tier_chain(top)
            stats.acceptance = [t.stats for t in chain if t.stats is not None]
            stats.acceptance += [t.shortcut_stats for t in chain if t.shortcut_stats is not None]
            self._decode(top, prompt_ids, generated, held, stats, on_tokens, should_stop)
        except KeyboardInterrupt:
            stats.stop_reason = "interrupted"
        stats.tier_costs = [tier.costs() for tier in chain if tier.proposer is not None]
        stats.new_tokens = len(generated)
        text = self.target.tokenizer.decode(generated, skip_special_tokens=True)
        return GenerationResult(generated, text, stats)

    @staticmethod
    def _tier_chain(top: ModelTier) -> list[ModelTier]:
        chain = [top]
        while isinstance(chain[-1].proposer, ModelTier):
            chain.append(chain[-1].proposer)
        return chain

    def _decode(
        self,
        top: ModelTier,
        prompt_ids: list[int],
        generated: list[int],
        held: _Held,
        stats,
        on_tokens,
        should_stop=None,
    ) -> None:
        """Rounds of the top tier (ModelTier.step) until max_new_tokens, an end-of-sequence token or should_stop.

        held: what the full cache holds (_Held of the prompt and the first token), kept up to date round by round
        for the next prompt to reuse: its ids are the prompt and every committed token, its length the full cache's
        after the last round that ended (each round leaves it at the committed tokens' length, less the last one,
        whose keys the next round writes), so that a round interrupted in the middle of a forward leaves only
        positions that hold what their ids say.

        The committed ids live on the device (TokenSequence), copied there once: each round appends its tokens from
        the device, and the host learns them from the round's one read (a verification's, or where the top tier
        sampled its own token, the read that hands it out)."""
        cfg = self.config
        if generated[-1] in self.eos_ids:
            stats.stop_reason = "eos"
            return
        capacity = len(prompt_ids) + cfg.max_new_tokens
        committed = TokenSequence.of([*prompt_ids, *generated], self.target.device, capacity)
        while len(generated) < cfg.max_new_tokens:
            if should_stop is not None and should_stop():
                stats.stop_reason = "cancelled"
                return
            started = time.perf_counter()
            verified = top.step(committed, limit=cfg.max_new_tokens - len(generated))  # never more than wanted
            tokens = verified.tokens  # an own step's token is read here (autoregressive decoding: one read per token)
            stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
            elapsed = time.perf_counter() - started
            stats.decode_seconds += elapsed
            stats.round_seconds.append(elapsed)
            stats.round_tokens.append(len(tokens))
            committed.append(verified.ids[: len(tokens)], tokens)
            generated += tokens
            held.ids += tokens
            held.length = min(top.cache.length, len(held.ids))  # an end-of-sequence token may cut accepted drafts
            if on_tokens is not None:
                on_tokens(tokens, verified.origins[: len(tokens)])
            if stop is not None:
                stats.stop_reason = "eos"
                return
