"""The generation engine: load once, then generate for many prompts.

Data path (docs/architecture.md): chunked prefill of target@full -> retrieval cache selected with the last prompt token's
queries -> drafter StreamingLLM cache -> loop of top-tier steps, each rolling every cache back to the accepted
length and refreshing the retrieval cache on its policy.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cache import FullCache, RetrievalCache, StreamingCache
from kernels import SUMMARIES
from offload import offload_kv
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.decoding.ngram import NGramProposer
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sampling import probabilities, sample
from triforce_cli.decoding.speculative import FallbackProposer, ModelTier
from triforce_cli.decoding.stats import GenerationResult, GenerationStats
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.runtime.environment import available_memory, torch_threads
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS, Transformer, weight_bytes
from triforce_cli.runtime.parallel import from_rank_zero, shared_seed, world_size
from triforce_cli.runtime.store import human_size

PrefillCallback = Callable[[str, int, int], None]  # (model name, tokens done, tokens total)
TokenCallback = Callable[[list[int], list[str]], None]  # (new token ids, tier that sampled each)
ChunkCallback = Callable[[float], None]  # seconds one prefill chunk took


@dataclass(frozen=True)
class MemoryPlan:
    """What a generation holds, and where: (what, bytes on the device, bytes in host memory) per item."""

    device: str
    items: tuple[tuple[str, int, int], ...]

    @property
    def device_bytes(self) -> int:
        return sum(device for _, device, _ in self.items)

    @property
    def host_bytes(self) -> int:
        return sum(host for _, _, host in self.items)

    def bytes_of(self, what: str) -> int:
        return sum(device + host for name, device, host in self.items if name == what)


@dataclass
class _Caches:
    full: FullCache
    retrieval: RetrievalCache | None
    streaming: StreamingCache | None


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
        if self.drafter is not None and (
            self.drafter.tokenizer.get_vocab() != target.tokenizer.get_vocab()
            or self.drafter.model.config.vocab_size != target.model.config.vocab_size
        ):
            raise ConfigError(f"drafter {self.drafter.name} does not share the vocabulary of {target.name}")
        self.eos_ids = set() if config.ignore_eos else target.eos_token_ids
        self._caches: _Caches | None = None
        if config.offload == "kv+weights" and getattr(target.model, "weight_stream", None) is None:
            raise ConfigError(
                "--offload kv+weights needs a target loaded with its weights streamed: load_model(...,"
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
        """Whether the target runs its decode steps as compiled fixed-shape graphs (Transformer.compile_steps)."""
        return self.target.model.fixed_step is not None

    def _capacities(self, prompt_tokens: int) -> tuple[int, int, int]:
        """Positions of the full cache, of the retrieval cache (budget + recent region; 0 without one) and of the
        drafter's StreamingLLM cache (0 without one) for a generation after prompt_tokens. Compiled steps write up
        to a step's length again in padding, past the committed tokens."""
        cfg = self.config
        headroom = cfg.speculation_depth * (2 if self.compiled else 1)
        full = prompt_tokens + cfg.max_new_tokens + headroom
        recent = cfg.chunk_size + cfg.refresh_interval * (cfg.gamma2 + 1) + headroom
        retrieval = cfg.budget_for(prompt_tokens) + recent if cfg.uses_retrieval else 0
        streaming = cfg.sink_tokens + cfg.draft_window + max(self.prefill_chunk, headroom)
        return full, retrieval, streaming if self.uses_model_drafter else 0

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill forward on the target's device (EngineConfig.prefill_chunk_on)."""
        return self.config.prefill_chunk_on(self.target.device.type)

    @property
    def offloaded(self) -> bool:
        """Whether the full KV cache lives in host memory (EngineConfig.offload kv or kv+weights)."""
        return self.config.offload in ("kv", "kv+weights")

    def memory_plan(self, prompt_tokens: int) -> MemoryPlan:
        """What a generation after prompt_tokens holds, and where, before anything is allocated: the models'
        weights, the full, retrieval and StreamingLLM caches (with the retrieval cache's chunk mean keys), and,
        offloaded, the device's on-chip layers and two-slot ring."""
        full, retrieval, streaming = self._capacities(prompt_tokens)
        target, draft = self.target.model.config, self._drafter_model.config
        itemsize = self.target.dtype.itemsize
        layer_position = 2 * target.num_kv_heads * target.head_dim * itemsize  # one layer's key and value
        full_bytes = layer_position * target.num_layers * full
        summaries = SUMMARIES[self.config.chunk_score]  # keys kept per chunk to score it
        chunk_keys = layer_position // 2 * summaries * target.num_layers * (full // self.config.chunk_size)
        chunk_keys = chunk_keys if retrieval else 0
        step_queries = target.num_layers * target.num_heads * MAX_STEP_TOKENS * target.head_dim * itemsize
        items = [*self._weight_items()]
        items += [
            ("retrieval cache", layer_position * target.num_layers * retrieval + chunk_keys, 0),
            ("drafter cache", 2 * draft.num_layers * draft.num_kv_heads * draft.head_dim * streaming * itemsize, 0),
            ("step queries", step_queries if self.compiled and not self.offloaded else 0, 0),
        ]
        if self.offloaded:
            on_chip = min(self.config.on_chip_layers, target.num_layers)
            ring = min(2, target.num_layers - on_chip)
            items += [
                ("full KV cache", 0, full_bytes),
                ("on-chip layers and ring", layer_position * full * (on_chip + ring), 0),
            ]
        else:
            items.append(("full KV cache", full_bytes, 0))
        return MemoryPlan(str(self.target.device), tuple(item for item in items if item[1] or item[2]))

    def _weight_items(self) -> list[tuple[str, int, int]]:
        """The weights' items of the memory plan: all on the device, or, streamed, the layers from on_chip_layers on
        in host memory and two of them at a time on the device."""
        stream = getattr(self.target.model, "weight_stream", None)
        if stream is None:
            return [("weights", weight_bytes(self.target.model, self._drafter_model), 0)]
        model = self.target.model
        fixed = (model.model.embed_tokens, model.model.norm, model.lm_head)  # never streamed
        resident = weight_bytes(*fixed, self._drafter_model) + stream.first * stream.layer_bytes
        streamed = (len(stream.layers) - stream.first) * stream.layer_bytes
        return [("weights", resident, 0), ("streamed weights", 0, streamed), ("weight ring", stream.device_bytes, 0)]

    def cache_bytes(self, prompt_tokens: int) -> int:
        """Bytes of the caches (everything but the weights) a generation after prompt_tokens allocates."""
        plan = self.memory_plan(prompt_tokens)
        weights = sum(plan.bytes_of(name) for name in ("weights", "streamed weights", "weight ring"))
        return plan.device_bytes + plan.host_bytes - weights

    def check_memory(self, prompt_tokens: int) -> None:
        """A ConfigError with the figures, before any allocation, where the caches cannot fit the device (or, the
        full cache offloaded, the host)."""
        plan = self.memory_plan(prompt_tokens)
        reused = 0 if self._caches is None else self._caches.full.keys.nbytes + self._caches.full.values.nbytes
        weights = plan.bytes_of("weights") + plan.bytes_of("weight ring")  # allocated already
        on_device = plan.device_bytes - weights - (0 if self.offloaded else reused)
        host = torch.device("cpu")
        for where, needed, advice in (
            (self.target.device, on_device, self._device_advice()),
            (
                host,
                plan.host_bytes - plan.bytes_of("streamed weights") - reused,
                "use a shorter prompt or fewer --max-new-tokens",
            ),
        ):
            free = available_memory(where)
            if needed > 0 and free is not None and needed > free:
                raise ConfigError(
                    f"the KV caches for {prompt_tokens} prompt tokens and {self.config.max_new_tokens} new ones need"
                    f" {human_size(needed)} on {where}, which has {human_size(free)} free: {advice}"
                )

    def _device_advice(self) -> str:
        if self.offloaded:
            return "use fewer --on-chip-layers, a smaller --budget, a shorter prompt or fewer --max-new-tokens"
        offload = "--offload kv (the full KV cache in host memory), " if self.target.device.type == "cuda" else ""
        return f"use {offload}a shorter prompt, fewer --max-new-tokens, a smaller --budget or a 16-bit --dtype"

    def _allocate(self, prompt_tokens: int) -> _Caches:
        cfg = self.config
        model = self.target.model.config
        dtype, device = self.target.dtype, self.target.device
        capacity, retrieval_capacity, _ = self._capacities(prompt_tokens)
        old = self._caches
        if old is not None and old.full.capacity >= capacity:
            full = old.full
        else:
            self.check_memory(prompt_tokens)
            shape = (model.num_layers, model.num_kv_heads, model.head_dim, capacity, dtype)
            if self.offloaded:
                full = FullCache(*shape, "cpu")  # offload_kv pins it, exactly its bytes
                offload_kv(full, device, cfg.on_chip_layers)  # its forwards run eager, on the streamed views
            else:
                full = FullCache(*shape, device)
                if self.compiled:
                    full.make_static(model.num_heads, MAX_STEP_TOKENS)
        full.reset()
        retrieval = None
        if cfg.uses_retrieval:
            budget = cfg.budget_for(prompt_tokens)
            recent = retrieval_capacity - budget
            retrieval = RetrievalCache(full, budget, cfg.chunk_size, recent, device, cfg.chunk_score)
            if self.compiled:
                retrieval.make_static()
        streaming = None
        if self.uses_model_drafter:
            draft = self._drafter_model.config
            streaming = StreamingCache(
                draft.num_layers,
                draft.num_kv_heads,
                draft.head_dim,
                cfg.sink_tokens,
                cfg.draft_window,
                max(self.prefill_chunk, cfg.speculation_depth),
                dtype,
                device,
            )
            if self._drafter_model.fixed_step is not None:
                streaming.make_static()
        self._caches = _Caches(full, retrieval, streaming)
        return self._caches

    def _build_tiers(self, caches: _Caches, generator: torch.Generator) -> ModelTier:
        cfg = self.config
        sampling = cfg.sampling
        model = self.target.model
        policy = cfg.speculation_policy
        if policy == "throughput" and world_size() > 1:
            policy = "heuristic"  # the clock differs between ranks; acceptance, which heuristic follows, does not
        drafter = None
        if caches.streaming is not None:
            drafter = ModelTier("drafter", self._drafter_model, caches.streaming, sampling, generator)
        if self.uses_ngram:
            ngram = NGramProposer(model.config.vocab_size, cfg.ngram_max, device=self.target.device)
            drafter = ngram if drafter is None else FallbackProposer(ngram, drafter)
        # drafter is None without a drafter tier: then the tier it would draft for samples every token itself
        if not cfg.uses_retrieval:
            return ModelTier(
                "target", model, caches.full, sampling, generator, drafter, cfg.gamma1, policy, own_steps=True
            )
        middle = ModelTier("retrieval", model, caches.retrieval, sampling, generator, drafter, cfg.gamma1, policy)
        # the throughput policy may skip the middle tier where verifying at it does not pay (speculation_length.py);
        # only a model drafter, which always drafts, makes a shortcut (an n-gram alone often finds nothing)
        shortcut = drafter if policy == "throughput" and self.uses_model_drafter else None
        return ModelTier(
            "target", model, caches.full, sampling, generator, middle, cfg.gamma2, policy, shortcut, own_steps=True
        )

    def _prefill(
        self, name: str, model: Transformer, cache, ids: list[int], on_prefill, on_chunk: ChunkCallback | None = None
    ) -> torch.Tensor:
        """Run the prompt through model in chunks on prefill_threads; return the logits (1, V) after its last token.
        on_chunk receives each chunk's seconds.

        A full cache in host memory is prefilled layer by layer (_prefill_layerwise); any other cache chunk by chunk.
        """
        chunk = self.prefill_chunk
        tokens = torch.tensor(ids, dtype=torch.long, device=self.target.device)
        logits = None
        with torch_threads(self.prefill_threads):
            if isinstance(cache, FullCache) and cache.stream is not None:
                return self._prefill_layerwise(name, model, cache, tokens, on_prefill, on_chunk)
            for start in range(0, len(ids), chunk):
                began = time.perf_counter()
                logits = model(tokens[start : start + chunk], start, cache, num_logits=1, decoding=False)
                if on_chunk is not None:
                    on_chunk(time.perf_counter() - began)
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
    ) -> torch.Tensor:
        """_prefill of an offloaded full cache, layer by layer (Transformer.prefill_layerwise): each layer's keys and
        values go back to the host once, where chunk by chunk every chunk would stream every layer's whole prefix to
        the device again (about 2 TB over PCIe for 128K tokens of an 8B model).

        The hidden states of the tokens in flight stay on the device: the whole prompt where they take at most half
        of the device's free memory (the rest left to one forward's activations), else segments of as many chunks as
        fit there, each fetching the segments before it once per offloaded layer. on_prefill counts a segment's
        tokens in proportion to the layers done; each chunk of a segment gets the segment's mean seconds.
        """
        chunk, total = self.prefill_chunk, len(tokens)
        free = available_memory(self.target.device)
        segment = total
        if free is not None and model.prefill_layerwise_bytes(total) > free // 2:
            segment = max(1, free // 2 // model.prefill_layerwise_bytes(chunk)) * chunk
        num_layers = model.config.num_layers
        logits = None
        for start in range(0, total, segment):
            size = min(segment, total - start)
            on_layer = None
            if on_prefill is not None:
                on_layer = lambda layers, start=start, size=size: on_prefill(
                    name, start + size * layers // num_layers, total
                )
            began = time.perf_counter()
            logits = model.prefill_layerwise(tokens[start : start + size], start, full, chunk, on_layer)
            seconds, chunks = time.perf_counter() - began, -(-size // chunk)
            if on_chunk is not None:
                for _ in range(chunks):
                    on_chunk(seconds / chunks)
        return logits

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise PromptError("the prompt is empty after tokenization")
        context = self.target.model.config.max_position_embeddings
        needed = len(prompt_ids) + self.config.max_new_tokens
        if needed > context:
            raise PromptError(
                f"prompt of {len(prompt_ids)} tokens plus {self.config.max_new_tokens} new tokens exceeds"
                f" the {context}-token context of {self.target.name}: use --context-window {-(-needed // 1024)}k"
                " or more (RoPE scaled with YaRN), a shorter prompt or fewer --max-new-tokens"
            )
        if self.config.uses_retrieval:
            self.config.budget_for(len(prompt_ids))

    def prefill(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_chunk: ChunkCallback | None = None,
    ) -> PromptState:
        """Prefill the target once, for reuse by generate(prompt_state=...) and the prompt cache; on_chunk receives
        each prefill chunk's seconds."""
        self.check_prompt(prompt_ids)
        full = self._allocate(len(prompt_ids)).full
        logits = self._prefill(self.target.name, self.target.model, full, prompt_ids, on_prefill, on_chunk)
        return PromptState.capture(full, prompt_ids, logits)

    def generate(
        self,
        prompt_ids: list[int],
        on_prefill: PrefillCallback | None = None,
        on_tokens: TokenCallback | None = None,
        prompt_state: PromptState | None = None,
        on_prompt_state: Callable[[PromptState], None] | None = None,
    ) -> GenerationResult:
        """Generate after prompt_ids, restoring prompt_state instead of prefilling when it is given.

        on_prompt_state receives the freshly prefilled prompt (to save it). A target with half weights packs the
        prompt's float16 copy once per prompt_state and keeps it there. Ctrl-C stops early and still returns
        what was generated.
        """
        self.check_prompt(prompt_ids)
        if prompt_state is not None and not prompt_state.matches(prompt_ids):
            raise PromptError("the saved prompt state belongs to another prompt")
        cfg = self.config
        generator = torch.Generator(device=self.target.device)
        seed = cfg.sampling.seed if cfg.sampling.seed is not None else torch.seed()
        generator.manual_seed(shared_seed(seed, self.target.device))
        stats = GenerationStats(cfg.mode, self.drafter_description, len(prompt_ids))
        generated: list[int] = []
        chain: list[ModelTier] = []  # the tiers, top first, once built
        try:
            caches = self._allocate(len(prompt_ids))
            started = time.perf_counter()
            if prompt_state is None:
                logits = self._prefill(
                    self.target.name,
                    self.target.model,
                    caches.full,
                    prompt_ids,
                    on_prefill,
                    stats.prefill_chunk_seconds.append,
                )
                if on_prompt_state is not None:
                    on_prompt_state(PromptState.capture(caches.full, prompt_ids, logits))
                if self.target.half_prompt_cache:
                    caches.full.pack_prefix()
            else:
                prompt_state.restore(caches.full, pack=self.target.half_prompt_cache)
                logits = prompt_state.last_logits.to(self.target.device)
                stats.prompt_cached = True
            if caches.retrieval is not None:
                caches.retrieval.select_chunks()
            if caches.streaming is not None:
                if self.drafter is None:
                    caches.streaming.fill_from(caches.full)
                else:
                    self._prefill(self.drafter.name, self.drafter.model, caches.streaming, prompt_ids, on_prefill)
            first = int(from_rank_zero(sample(probabilities(logits, cfg.sampling), generator)))
            stats.prefill_seconds = time.perf_counter() - started
            generated.append(first)
            if on_tokens is not None:
                on_tokens([first], ["target"])
            top = self._build_tiers(caches, generator)
            chain = self._tier_chain(top)
            stats.acceptance = [t.stats for t in chain if t.stats is not None]
            stats.acceptance += [t.shortcut_stats for t in chain if t.shortcut_stats is not None]
            self._decode(top, caches, prompt_ids, generated, stats, on_tokens)
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

    def _decode(self, top, caches, prompt_ids, generated, stats, on_tokens) -> None:
        cfg = self.config
        committed = list(prompt_ids) + generated
        rounds_since_selection = 0
        if generated[-1] in self.eos_ids:
            stats.stop_reason = "eos"
            return
        while len(generated) < cfg.max_new_tokens:
            started = time.perf_counter()
            step = top.step(committed, limit=cfg.max_new_tokens - len(generated))  # never more tokens than wanted
            rounds_since_selection += 1
            if caches.retrieval is not None and top.proposer_drafts_next:
                # the retrieval tier drafts the next round: bring its view up to date (left as it is while the
                # full tier drafts straight from the drafter, which keeps the retrieval tier idle)
                if rounds_since_selection >= cfg.refresh_interval:
                    caches.retrieval.select_chunks()
                    rounds_since_selection = 0
                else:
                    caches.retrieval.sync_recent()
            tokens = step.host_tokens()  # autoregressive decoding reads its token here: one read per token
            stop = next((i for i, t in enumerate(tokens) if t in self.eos_ids), None)
            if stop is not None:
                tokens = tokens[: stop + 1]
            elapsed = time.perf_counter() - started
            stats.decode_seconds += elapsed
            stats.round_seconds.append(elapsed)
            stats.round_tokens.append(len(tokens))
            committed += tokens
            generated += tokens
            if on_tokens is not None:
                on_tokens(tokens, step.origins[: len(tokens)])
            if stop is not None:
                stats.stop_reason = "eos"
                return
