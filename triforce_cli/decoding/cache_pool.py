"""The caches an engine keeps across generations (CachePool), and what its full cache holds for the next prompt (Held).

The caches are allocated once and kept, sized as decoding/sizing.py says (EngineConfig.cache_positions for an engine
serving many prompts, else the first prompt; grown, the old buffers released first, for a longer one). They keep
their addresses, so the fixed-shape decode steps recorded on them (runtime/graphs.py, decoding/warm_up.py) stay
valid. Engines made from one another (Engine.reconfigured) share one pool and generate one at a time: a cache is
reused where the engine's layout matches the one it was built with.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from triforce_cli.cache import FullCache, RetrievalCache, StreamingCache
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.decoding.sizing import CacheKind, CacheSpec, Capacities, MemoryPlan, check_memory, memory_plan
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.offload import offload_kv
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS


@dataclass
class Held:
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
class InUse:
    """The caches one generation uses: the full cache, and the retrieval and StreamingLLM caches of its tiers;
    kept: the prompt positions the full cache kept from what it held (CachePool.allocate)."""

    full: FullCache
    retrieval: RetrievalCache | None
    streaming: StreamingCache | None
    kept: int = 0


def full_layout(spec: CacheSpec) -> tuple:
    """What a held full cache must have been built with for an engine of spec to reuse it, besides room enough:
    where it lives (the host, with its on-chip layers), whether steps on it compile and, keeping only a window, the
    retrieval chunk its first position is a multiple of."""
    offloaded = spec.offloaded
    align = spec.config.chunk_size if spec.window else None
    return offloaded, spec.config.on_chip_layers if offloaded else 0, spec.compiled, align


def layout(kind: str, spec: CacheSpec, caps: Capacities) -> tuple:
    """What a held cache of kind (CacheKind) must have been built with for an engine of spec to reuse it, besides
    room enough: the full cache's full_layout; the retrieval cache's chunks, recent region and compiled steps; the
    drafter cache's shape, sliding windows and compiled steps."""
    cfg = spec.config
    if kind == CacheKind.FULL:
        return full_layout(spec)
    if kind == CacheKind.RETRIEVAL:
        return cfg.chunk_size, cfg.chunk_score, caps.recent, spec.compiled
    draft = spec.drafter
    shape = draft.config.num_layers, draft.config.num_kv_heads, draft.config.head_dim, draft.config.sliding_windows
    return *shape, cfg.sink_tokens, cfg.draft_window, caps.draft_step, draft.fixed_step is not None


def new_full(spec: CacheSpec, caps: Capacities) -> FullCache:
    """The target's full KV cache: on the device, keeping only the shared sliding window where there is one, or in
    host memory with its on-chip layers on the device (offload_kv)."""
    model = spec.target.model.config
    shape = (model.num_layers, model.num_kv_heads, model.head_dim, caps.full, spec.kv_dtype)
    if spec.offloaded:
        full = FullCache(*shape, "cpu")  # offload_kv pins it, exactly its bytes
        offload_kv(full, spec.device, spec.config.on_chip_layers)
    else:
        full = FullCache(*shape, spec.device, window=spec.window, align=spec.config.chunk_size)
    if spec.compiled:
        full.make_static(model.num_heads, MAX_STEP_TOKENS, spec.target.dtype)
    return full


def new_retrieval(spec: CacheSpec, caps: Capacities, full: FullCache) -> RetrievalCache:
    """The target's retrieval cache over full: chunks chosen within caps.budget and a recent region."""
    cfg = spec.config
    retrieval = RetrievalCache(
        full,
        caps.budget,
        cfg.chunk_size,
        caps.recent,
        spec.device,
        cfg.chunk_score,
        spec.target.model.config.sliding_windows,
    )
    if spec.compiled:
        retrieval.make_static()
    return retrieval


def new_streaming(spec: CacheSpec, caps: Capacities) -> StreamingCache:
    """The drafter's StreamingLLM cache: its sinks, its window and one write past them."""
    cfg, draft = spec.config, spec.drafter.config
    streaming = StreamingCache(
        draft.num_layers,
        draft.num_kv_heads,
        draft.head_dim,
        cfg.sink_tokens,
        cfg.draft_window,
        caps.draft_step,
        spec.kv_dtype,
        spec.device,
        draft.sliding_windows,
    )
    if spec.drafter.fixed_step is not None:
        streaming.make_static()
    return streaming


def exact_positions(target: LoadedModel, compiled: bool) -> bool:
    """Whether every forward of target on a full cache computes under the numeric contract (docs/architecture.md):
    a float32 target on the CPU with the cpu attention kernels and eager steps (not compiled), whose kernels compute
    a row in an order of arithmetic that depends neither on the rows beside it nor on the thread count. A position
    then holds the same bits whether a prefill chunk, a verification or a one-token step computed it, and reuse
    keeps whatever the cache holds of a prompt (Held.reusable). Its prefill is exact with any steps: it runs eager.
    A plain nn.Linear left in the model (one built without the loader's tiled weights) computes by torch's
    products, which are not row-invariant, and leaves the target off the contract."""
    on_contract = target.device.type == "cpu" and target.dtype == torch.float32
    plain_linears = any(isinstance(module, nn.Linear) for module in target.model.modules())
    return on_contract and not plain_linears and target.model.attention_backend == "cpu" and not compiled


def check_restorable(prompt_state: PromptState, prompt_ids: list[int] | None, window: int | None) -> None:
    """A PromptError where prompt_state is not the prefill of prompt_ids (None: not asked), a ConfigError where it
    holds only the prompt's last positions (its full cache kept a sliding window) and the full cache it goes into
    keeps every position (window None, CacheSpec.window: offloaded), which lacks the positions before."""
    if prompt_ids is not None and not prompt_state.matches(prompt_ids):
        raise PromptError("the saved prompt state belongs to another prompt")
    if prompt_state.first_position and window is None:
        raise ConfigError(
            f"the saved prefill holds only the positions from {prompt_state.first_position} on (its full cache"
            " kept the sliding window alone), and this run's full cache keeps every position (`offload`): run"
            " it without `prompt_cache` or without `offload`"
        )


@dataclass
class CachePool:
    """The caches an engine keeps across generations, shared with the engines made from it (Engine.reconfigured),
    which generate one at a time: at most one cache of each kind (CacheKind). layouts: per kind, the settings
    its cache was built with, which an engine must share to reuse it; held: per kind, its (device, host) bytes."""

    full: FullCache | None = None
    retrieval: RetrievalCache | None = None
    streaming: StreamingCache | None = None
    layouts: dict[str, tuple] = field(default_factory=dict)
    held: dict[str, tuple[int, int]] = field(default_factory=dict)
    holds: Held | None = None  # what the full cache's first positions hold, for the next prompt to reuse
    planned: tuple[CacheSpec, Capacities, MemoryPlan] | None = None  # the last plan(), with what it was made for

    def release(self, kind: str) -> None:
        """Drop the cache of kind, so that its buffers are freed before a new one is allocated."""
        if kind == CacheKind.FULL:
            self.holds = None
        setattr(self, kind, None)
        self.layouts.pop(kind, None)
        self.held.pop(kind, None)

    def capacities(self, spec: CacheSpec, prompt_tokens: int) -> Capacities:
        """The positions of each cache for a generation after prompt_tokens (sizing.capacities), a full cache held
        with spec's layout kept where it is large enough."""
        kept = self.full is not None and self.layouts[CacheKind.FULL] == full_layout(spec)
        return spec.capacities(prompt_tokens, held=self.full.capacity if kept else 0)

    def plan(self, spec: CacheSpec, caps: Capacities) -> MemoryPlan:
        """The memory plan of spec's caches with caps (sizing.memory_plan), made once: asked again for the same spec
        and caps (the plan `generate` prints, then the allocation's), the one made before."""
        if self.planned is None or self.planned[0] is not spec or self.planned[1] != caps:
            self.planned = (spec, caps, memory_plan(spec, caps))
        return self.planned[2]

    def renewal(self, spec: CacheSpec, caps: Capacities) -> tuple[list[str], list[str]]:
        """The cache kinds to build for a generation with caps, and the held caches to release before: those
        rebuilt, and the retrieval cache of a full cache rebuilt. A held retrieval cache serves any budget up to
        the one it was built for."""
        build = []
        if self.full is None or self.layouts[CacheKind.FULL] != full_layout(spec) or self.full.capacity < caps.full:
            build.append(CacheKind.FULL)
        retrieval = self.retrieval
        if spec.config.uses_retrieval and (
            CacheKind.FULL in build
            or retrieval is None
            or self.layouts[CacheKind.RETRIEVAL] != layout(CacheKind.RETRIEVAL, spec, caps)
            or retrieval.keys.shape[2] - retrieval.recent_capacity < caps.budget
        ):
            build.append(CacheKind.RETRIEVAL)
        if spec.model_drafter and self.layouts.get(CacheKind.STREAMING) != layout(CacheKind.STREAMING, spec, caps):
            build.append(CacheKind.STREAMING)
        replaced = [*build, *([CacheKind.RETRIEVAL] if CacheKind.FULL in build else [])]
        return build, [kind for kind in CacheKind if kind in replaced and getattr(self, kind) is not None]

    def allocate(self, spec: CacheSpec, prompt_tokens: int, keep: int = 0) -> InUse:
        """The caches for a generation after prompt_tokens, emptied, the retrieval cache set to the prompt's budget:
        those held where they fit (sizing's policy), the others built after a memory check (sizing.check_memory of
        what they add, less what the caches they replace held) and after those caches are released.

        keep: prompt positions to keep in a full cache that is held, with the retrieval cache's summaries of the
        chunks they fill (a prefix shared with what the cache holds, Held.reusable); InUse.kept says how many
        were kept: none where the full cache is built anew, or keeps only a window and dropped a position a
        forward from keep reads (FullCache.can_write_from).
        """
        cfg = spec.config
        caps = self.capacities(spec, prompt_tokens)
        build, release = self.renewal(spec, caps)
        kept = 0 if CacheKind.FULL in build or not self.full.can_write_from(keep) else keep
        if build:
            sizes = self.plan(spec, caps).bytes_by_kind()
            needed = tuple(sum(sizes[k][i] for k in build) - sum(self.held[k][i] for k in release) for i in (0, 1))
            check_memory(spec, prompt_tokens, needed)
            for kind in release:
                self.release(kind)
            for kind in build:
                if kind == CacheKind.FULL:
                    self.full = new_full(spec, caps)
                elif kind == CacheKind.RETRIEVAL:
                    self.retrieval = new_retrieval(spec, caps, self.full)
                else:
                    self.streaming = new_streaming(spec, caps)
                self.layouts[kind] = layout(kind, spec, caps)
                self.held[kind] = sizes[kind]
        self.full.rollback(kept)  # 0: empty
        if self.holds is not None:
            self.holds.length = min(self.holds.length, kept)
        retrieval = self.retrieval if cfg.uses_retrieval else None
        if retrieval is not None:
            retrieval.reset(0 if CacheKind.RETRIEVAL in build else kept)
            # at most the budget it was built for: the recent region then starts sooner, within the same buffers
            retrieval.budget = cfg.budget_for(prompt_tokens)
        streaming = self.streaming if spec.model_drafter else None
        if streaming is not None:
            streaming.reset()
        return InUse(self.full, retrieval, streaming, kept)

    @contextmanager
    def filling(self, prompt_ids: list[int], chunk: int, rope_factors: str | None, exact: bool) -> Iterator[None]:
        """Around writing prompt_ids' prefill, in chunks of `chunk`, into the full cache: nothing there to reuse
        while it runs, and prompt_ids (Held) once it has finished (an interrupted one leaves nothing)."""
        self.holds = None
        yield
        length = len(prompt_ids)
        self.holds = Held(list(prompt_ids), length, length, chunk, rope_factors, exact)

    def answered_state(self, prompt_state: PromptState, exact: bool) -> PromptState | None:
        """prompt_state (the prefill of the prompt just generated after, its keys and values left out or not) with
        the answer the full cache holds after it (Held: every committed token but the last), for the prompt cache to
        save in its place, so that a later prompt going on from the answer keeps it too. None where the cache holds
        no answer after that prompt, holds only a window, or where the answer's positions are not a prefill's bits
        (exact False: outside the numeric contract, Engine.exact_positions). The full cache forgets the positions
        past what it holds."""
        held, full = self.holds, self.full
        prompt_ids = prompt_state.prompt_ids.tolist()
        exact = held is not None and held.exact and exact
        if not exact or held.length <= len(prompt_ids) or held.ids[: len(prompt_ids)] != prompt_ids or full.offset:
            return None
        full.rollback(held.length)
        full.settle()
        _, keys, values = full.held()
        answer_ids = torch.tensor(held.ids[len(prompt_ids) : held.length], dtype=torch.long)
        return replace(prompt_state, answer_ids=answer_ids, keys=keys.clone(), values=values.clone())

    def held_state(self, exact: bool, max_bytes: int | None = None) -> PromptState | None:
        """What the full cache holds that a later prompt may keep (prefix reuse), copied to host memory for
        Engine.restore to put back: every held position under the numeric contract (exact, Engine.exact_positions),
        else only those a prefill computed (Held.reusable's rules). The state is a prefix's, for restore alone: its
        last queries and logits are left empty, so it never serves its ids whole (Engine.generate's prompt_state).
        None where the cache holds nothing, only a window, or (max_bytes given) keys and values of more than
        max_bytes, which are not copied."""
        held, full = self.holds, self.full
        if held is None or full is None or full.offset:
            return None
        full.settle()
        _, keys, values = full.held()
        length = min(held.length if held.exact and exact else held.prefilled, keys.shape[2])
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
