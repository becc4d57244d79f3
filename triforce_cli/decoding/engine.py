"""The generation engine: load once, then generate for many prompts.

Data path (docs/architecture.md): chunked prefill of target@full -> retrieval cache selected with the last prompt token's
queries -> drafter StreamingLLM cache (where the drafter first drafts) -> loop of top-tier steps, each rolling every
cache back to the accepted length and refreshing the retrieval cache on its policy.

generate: 1. allocate the caches (decoding/cache_pool.py, sized by decoding/sizing.py; kept across generations) and
record the fixed-shape steps decoding takes (decoding/warm_up.py); 2. prefill the target's caches
(decoding/prefill.py; an offloaded full cache layer by layer), build the tiers (decoding/tiers.py) and price them,
prefill the drafter's cache where the first step drafts from it, and sample the first token; 3. run rounds of the
top tier (ModelTier.step) until the answer is complete (decoding/rounds.py).
"""

import time
from collections.abc import Callable
from functools import partial

import torch

from triforce_cli.cache import StreamingCache
from triforce_cli.decoding.cache_pool import CachePool, InUse, check_restorable, exact_positions
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.prefill import ChunkCallback, PrefillCallback, prefill, prefill_drafter
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.rounds import StopCheck, TokenCallback, decode, forward_mode
from triforce_cli.decoding.sampling import probabilities, sample
from triforce_cli.decoding.sizing import CacheSpec, MemoryPlan, check_prompt
from triforce_cli.decoding.speculative import ModelTier, Tier, set_up_tier
from triforce_cli.decoding.stats import GenerationResult, GenerationStats, StopReason
from triforce_cli.decoding.step_costs import price_tiers
from triforce_cli.decoding.tiers import build_tiers, tier_chain
from triforce_cli.decoding.warm_up import warm_up
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.forms import OffloadMode
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import Transformer
from triforce_cli.runtime.parallel import from_rank_zero, shared_seed


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
        self._caches = CachePool()  # shared with the engines made from this one
        self.spec = CacheSpec(target, self._drafter_model, config, self.uses_model_drafter)
        self._checked_tokens: int | None = None  # the last prompt length check_prompt passed
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
        """Whether the target runs its decode steps as fixed-shape steps, recorded or compiled (CacheSpec.compiled)."""
        return self.spec.compiled

    @property
    def exact_positions(self) -> bool:
        """Whether every forward on the full cache computes under the numeric contract (cache_pool.exact_positions):
        a position then holds the same bits however it was computed, and reuse keeps whatever the cache holds."""
        return exact_positions(self.target, self.compiled)

    def reconfigured(self, config: EngineConfig, drafter: LoadedModel | None) -> "Engine":
        """An engine for the same target with config and drafter, sharing this engine's caches (and prefill
        threads): a cache it holds is reused where the new engine's layout matches, with the steps compiled on it,
        instead of being allocated again beside it. The two generate one at a time."""
        engine = Engine(self.target, config, drafter, self.prefill_threads)
        engine._caches = self._caches
        return engine

    @property
    def prefill_block(self) -> int:
        """Prompt tokens per prefill forward on the target's device (EngineConfig.prefill_block_on)."""
        return self.spec.prefill_block

    def memory_plan(self, prompt_tokens: int) -> MemoryPlan:
        """What a generation after prompt_tokens holds, and where, before anything is allocated (sizing.memory_plan),
        a full cache held that is large enough at its own size."""
        return self._caches.plan(self.spec, self._caches.capacities(self.spec, prompt_tokens))

    def cache_bytes(self, prompt_tokens: int) -> int:
        """Bytes of the caches (everything but the weights and a prefill's activations) a generation after
        prompt_tokens holds."""
        return self.memory_plan(prompt_tokens).cache_bytes

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """A PromptError or ConfigError where a generation after prompt_ids cannot run (sizing.check_prompt: it
        depends on their number alone), checked once for a number of tokens: a generation after the check that
        `triforce generate` makes before it checks nothing again."""
        if len(prompt_ids) != self._checked_tokens:
            context = self.target.model.config.max_position_embeddings
            check_prompt(len(prompt_ids), self.config, context, self.target.name)
            self._checked_tokens = len(prompt_ids)

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
            logits = self._prefill_target(prompt_ids, on_prefill, on_chunk)
        return PromptState.capture(full, prompt_ids, logits) if capture else None

    def restore(self, prompt_state: PromptState, next_prompt_tokens: int = 0) -> None:
        """Put a saved prefill into the full cache, as prefill() leaves its prompt there, for the next prompt that
        starts with its ids to keep (prefix reuse); the state was prefilled in this engine's chunks (PromptCache is
        keyed by them). next_prompt_tokens: the length of that next prompt, where known, so that the cache is
        allocated for it once (a cache too small for it is built anew and keeps nothing)."""
        held_ids = prompt_state.held_ids
        self.check_prompt(held_ids)
        check_restorable(prompt_state, None, self.spec.window)
        full = self._allocate(max(len(held_ids), next_prompt_tokens)).full
        with self._filling(held_ids):
            prompt_state.restore(full, answer=True)

    def answered_state(self, prompt_state: PromptState) -> PromptState | None:
        """prompt_state with the answer the full cache holds after it, for the prompt cache to save in its place
        (CachePool.answered_state; None outside the numeric contract, exact_positions)."""
        return self._caches.answered_state(prompt_state, self.exact_positions)

    def held_state(self, max_bytes: int | None = None) -> PromptState | None:
        """What the full cache holds that a later prompt may keep, copied to host memory for restore() to put back
        (CachePool.held_state)."""
        return self._caches.held_state(self.exact_positions, max_bytes)

    def _allocate(self, prompt_tokens: int, keep: int = 0) -> InUse:
        """This engine's caches for a generation after prompt_tokens (CachePool.allocate, keeping `keep` prompt
        positions where it can). The target and the drafter take the RoPE frequencies of a context of prompt_tokens
        + max_new_tokens for every forward until the next allocation (fit_rope)."""
        for loaded in (self.target, self.drafter):
            if loaded is not None:  # the RoPE frequencies of every forward of this generation (LongRoPE's set)
                loaded.model.fit_rope(prompt_tokens + self.config.max_new_tokens)
        return self._caches.allocate(self.spec, prompt_tokens, keep)

    def _filling(self, prompt_ids: list[int]):
        """Around writing prompt_ids' prefill into the full cache (CachePool.filling)."""
        rope_factors = self.target.model.rope_factors
        return self._caches.filling(prompt_ids, self.prefill_block, rope_factors, self.exact_positions)

    def _prefill_caches(
        self,
        caches: InUse,
        prompt_ids: list[int],
        stats: GenerationStats,
        on_prefill: PrefillCallback | None,
        prompt_state: PromptState | None,
        on_prompt_state: Callable[[PromptState], None] | None,
    ) -> torch.Tensor:
        """Fill every cache for prompt_ids and return the logits (1, V) after its last token: the full cache
        prefilled from the positions it kept (or restored from prompt_state), the retrieval cache's first chunk
        selection, and the StreamingLLM cache of the target drafting for itself (a drafter model's is filled where
        it first drafts: _set_up_drafter)."""
        full = caches.full
        with self._filling(prompt_ids):
            if prompt_state is None:
                logits = self._prefill_target(prompt_ids, on_prefill, stats.prefill_chunk_seconds.append, caches.kept)
                stats.reused_tokens = caches.kept
                if on_prompt_state is not None:
                    on_prompt_state(PromptState.capture(full, prompt_ids, logits))
            else:
                prompt_state.restore(full)
                logits = prompt_state.last_logits.to(self.target.device)
                stats.prompt_cached = True
        if caches.retrieval is not None:
            caches.retrieval.select_chunks()
        if caches.streaming is not None and self.drafter is None:
            caches.streaming.fill_from(full)
        return logits

    def _set_up_drafter(
        self, streaming: StreamingCache, ids: list[int], on_prefill: PrefillCallback | None = None
    ) -> None:
        """Prefill the drafter's StreamingLLM cache with ids (prefill.prefill_drafter), where it first drafts: with
        the prompt's prefill where the first step drafts from it, else when the speculation-length policy first
        probes it (speculation_length.py), or never. Its state depends on ids alone, so a seeded run repeats."""
        prefill_drafter(self.drafter, streaming, ids, self.prefill_block, self.config, self.prefill_threads, on_prefill)

    def _prefill_target(
        self, prompt_ids: list[int], on_prefill: PrefillCallback | None, on_chunk: ChunkCallback | None, first: int = 0
    ) -> torch.Tensor:
        """Prefill the target's full cache from position first on (decoding.prefill.prefill); the logits (1, V)
        after the prompt's last token."""
        retrieval = self._caches.retrieval if self.config.uses_retrieval else None  # a layer-wise prefill fills it
        args = (self.prefill_block, self.prefill_threads, on_prefill, on_chunk, first, retrieval)
        return prefill(self.target, self._caches.full, prompt_ids, *args)

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
        if prompt_state is not None:
            check_restorable(prompt_state, prompt_ids, self.spec.window)
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
                keep = held.reusable(prompt_ids, self.prefill_block, rope_factors, self.exact_positions)
            # 1. allocate
            caches = self._allocate(len(prompt_ids), keep)
            stats.compile_seconds = warm_up(self.spec, caches)
            # 2. prefill every cache, build the tiers, and sample the first token from the prompt's logits
            started = time.perf_counter()
            logits = self._prefill_caches(caches, prompt_ids, stats, on_prefill, prompt_state, on_prompt_state)
            drafting = {"ngram": self.uses_ngram, "model_drafter": self.uses_model_drafter}
            if self.drafter is not None and caches.streaming is not None:
                drafting["set_up_drafter"] = partial(self._set_up_drafter, caches.streaming)
            top = build_tiers(cfg, self.target.model, self._drafter_model, caches, generator, **drafting)
            price_tiers(top)  # the costed policy's prices, fixed before its first step
            due = set_up_tier(top)
            if due is not None:  # the first step drafts from the drafter: its prefill goes with the prompt's
                due.run_set_up(prompt_ids, on_prefill)
            first = int(from_rank_zero(sample(probabilities(logits, cfg.sampling), generator)))
            stats.prefill_seconds = time.perf_counter() - started
            generated.append(first)
            held = self._caches.holds
            held.ids.append(first)
            if on_tokens is not None:
                on_tokens([first], [Tier.TARGET])
            stats.compile_seconds += warm_up(self.spec, caches, prefilled=True)
            # 3. loop: rounds of the top tier
            chain = tier_chain(top)
            stats.acceptance = [t.stats for t in chain if t.stats is not None]
            stats.acceptance += [t.shortcut_stats for t in chain if t.shortcut_stats is not None]
            stats.acceptance += [t.lookup_stats for t in chain if t.lookup_stats is not None]
            stopping = {"max_new_tokens": cfg.max_new_tokens, "eos_ids": self.eos_ids}
            with forward_mode(self.target.model, self._drafter_model):
                decode(
                    top, prompt_ids, generated, held, stats, **stopping, on_tokens=on_tokens, should_stop=should_stop
                )
        except KeyboardInterrupt:
            stats.stop_reason = StopReason.INTERRUPTED
        stats.tier_costs = [tier.costs() for tier in chain if tier.proposer is not None]
        stats.new_tokens = len(generated)
        text = self.target.tokenizer.decode(generated, skip_special_tokens=True)
        return GenerationResult(generated, text, stats)
