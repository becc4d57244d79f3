"""One sizing model of the caches: the positions each holds and the bytes of every item a generation keeps.

The engine feeds it its loaded models' configs (runtime.model.ModelConfig) and the planner its shapes
(plan.model.ModelShape); both have the fields of KVShape, so the memory `generate` prints and the memory `triforce
plan` predicts are the same functions' results. Weights are each caller's own: the engine counts the tensors it
holds, the planner the parameters of a shape. The caches' elements take kv_dtype_bytes each: half the model's on the
CPU in float32 (cache.kv_dtype).

The memory plan of one engine's generation (memory_plan, from its CacheSpec), the check that a prompt and its answer
fit the target's context (check_prompt) and the check that what an allocation builds fits the machine
(check_memory), are here too.

Sizing policy (Engine, decoding/cache_pool.py, docs/architecture.md): the caches are allocated once and kept across generations. The full
cache holds max(prompt + new tokens, EngineConfig.cache_positions) positions plus one step's headroom (for a
target whose every layer has the same sliding window, at most that window and a slack: full_slots), and never
shrinks: a cache already held that is large enough is kept, a longer prompt grows it (the old one released first).
The retrieval cache holds the largest budget any prompt that fits the full cache can use (EngineConfig.budget_for
of the longest such prompt), so a shorter prompt's smaller budget reuses its buffers.
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, Protocol

import torch

from triforce_cli.cache import kv_dtype
from triforce_cli.decoding.config import EngineConfig
from triforce_cli.errors import ConfigError, PromptError
from triforce_cli.kernels import SUMMARIES
from triforce_cli.kernels.attention import SPLIT_SLOTS
from triforce_cli.offload.kv import TAIL_POSITIONS
from triforce_cli.runtime.environment import available_memory
from triforce_cli.runtime.forms import OffloadMode
from triforce_cli.runtime.loading import LoadedModel
from triforce_cli.runtime.model import MAX_STEP_TOKENS, Transformer, weight_bytes
from triforce_cli.runtime.parallel import least
from triforce_cli.runtime.store import human_size

RING_LAYERS = 2  # layers of keys and values an offloaded forward stages on the device (offload/kv.py's ring)


class KVShape(Protocol):
    """The sizes of a decoder that decide its caches' bytes (ModelConfig and ModelShape both have them)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class LayerShape(KVShape, Protocol):
    """The sizes of a decoder layer that decide one forward's activations (ModelConfig and ModelShape have them)."""

    hidden_size: int
    intermediate_size: int


class MemoryItem(NamedTuple):
    """One thing a generation holds: its name, its bytes on the device and in host memory."""

    what: str
    device_bytes: int
    host_bytes: int


class CacheKind(StrEnum):
    """The caches a generation may hold, at most one of each."""

    FULL = "full"  # the target's every position
    RETRIEVAL = "retrieval"  # the target's chosen chunks and recent positions
    STREAMING = "streaming"  # the drafter's sinks and window


KIND_OF_ITEM = {  # the memory plan's items of each cache kind
    "full KV cache": CacheKind.FULL,
    "step queries": CacheKind.FULL,
    "on-chip layers and ring": CacheKind.FULL,
    "retrieval cache": CacheKind.RETRIEVAL,
    "retrieval staging": CacheKind.RETRIEVAL,
    "drafter cache": CacheKind.STREAMING,
}
WEIGHT_ITEMS = ("weights", "streamed weights", "weight ring")
ACTIVATIONS_ITEM = "prefill activations"  # one prefill forward's (prefill_activation_bytes), no cache's


@dataclass(frozen=True)
class MemoryPlan:
    """What a generation holds, and where: (what, bytes on the device, bytes in host memory) per item."""

    device: str
    items: tuple[MemoryItem, ...]

    @property
    def device_bytes(self) -> int:
        return sum(item.device_bytes for item in self.items)

    @property
    def host_bytes(self) -> int:
        return sum(item.host_bytes for item in self.items)

    @property
    def cache_bytes(self) -> int:
        """Bytes of the caches: everything but the weights and a prefill's activations."""
        other = sum(self.bytes_of(name) for name in (*WEIGHT_ITEMS, ACTIVATIONS_ITEM))
        return self.device_bytes + self.host_bytes - other

    def bytes_of(self, what: str) -> int:
        return sum(item.device_bytes + item.host_bytes for item in self.items if item.what == what)

    def bytes_by_kind(self) -> dict[CacheKind, tuple[int, int]]:
        """(device, host) bytes of each cache kind (CacheKind) in the plan."""
        kinds = dict.fromkeys(CacheKind, (0, 0))
        for what, device, host in self.items:
            if what in KIND_OF_ITEM:
                held = kinds[KIND_OF_ITEM[what]]
                kinds[KIND_OF_ITEM[what]] = (held[0] + device, held[1] + host)
        return kinds


def memory_advice(*, device_type: str, offloaded: bool) -> str:
    """What frees device memory for the caches, by the settings that size them."""
    if offloaded:
        return "use fewer `on_chip_layers`, a smaller `budget`, a shorter prompt or fewer `max_new_tokens`"
    offload = "`offload` kv (the full KV cache in host memory), " if device_type == "cuda" else ""
    return f"use {offload}a shorter prompt, fewer `max_new_tokens`, a smaller `budget` or a 16-bit `dtype`"


HOST_ADVICE = "use a shorter prompt or fewer `max_new_tokens`"  # what frees host memory for the caches


@dataclass(frozen=True)
class Capacities:
    """Positions each cache is allocated for; 0 for a cache the generation does not build.

    full: slots of the full KV cache: the positions it takes, or where it keeps only a sliding window (full_slots)
    the most it holds at once. budget: the largest retrieval budget the retrieval cache holds; recent:
    the positions of its recent region after the budget. draft_step: slots of the drafter's StreamingLLM cache for
    one write past its sinks and window (StreamingCache.max_step); streaming: all its slots.
    """

    full: int
    budget: int
    recent: int
    draft_step: int
    streaming: int

    @property
    def retrieval(self) -> int:
        """Slots of the retrieval cache: its budget and its recent region."""
        return self.budget + self.recent


def headroom(config: EngineConfig, compiled: bool) -> int:
    """Positions a cache may need past the committed tokens within one step: the speculation depth, twice that
    with compiled steps, which also write their padding."""
    return config.speculation_depth * (2 if compiled else 1)


def full_slots(config: EngineConfig, positions: int, window: int | None, spare: int, device_type: str) -> int:
    """Slots of a full cache for `positions`: as many, or for a target whose every layer has the sliding window W
    (ModelConfig.shared_window) at most W + the longest write (a prefill chunk, or a step with its padding) + one
    retrieval chunk, the slack that keeps its first position a multiple of the chunk size (cache.FullCache's window).
    Such a cache moves about W positions per slack positions written, and holds any number of positions."""
    if window is None:
        return positions
    longest = max(config.prefill_block_on(device_type), spare)
    return min(positions, window + longest + config.chunk_size)


def capacities(
    config: EngineConfig,
    prompt_tokens: int,
    *,
    compiled: bool,
    device_type: str,
    model_drafter: bool,
    held: int = 0,
    window: int | None = None,
) -> Capacities:
    """The positions of every cache a generation after prompt_tokens holds (see the module docstring).

    Args:
        config: the engine's settings (mode, budget, gammas, windows, new tokens, cache_positions).
        prompt_tokens: the prompt's length.
        compiled: whether decode steps run compiled (headroom).
        device_type: 'cpu' or 'cuda', which decides the prefill chunk a StreamingLLM cache takes at once.
        model_drafter: whether a model drafts on a StreamingLLM cache (not for an n-gram drafter alone).
        held: slots of a full cache already held, kept where they suffice (0: none).
        window: the sliding window every layer of the target shares where its full cache keeps only that
            (full_slots; None: every position).

    Returns:
        The capacities; a ConfigError (EngineConfig.budget_for) where the budget fits no prompt the full cache
        takes.
    """
    spare = headroom(config, compiled)
    positions = max(max(prompt_tokens + config.max_new_tokens, config.cache_positions or 0) + spare, held)
    if compiled:  # a multiple of SPLIT_SLOTS, for attention_in_cache to split the value product (slot_splits)
        positions = -(-positions // SPLIT_SLOTS) * SPLIT_SLOTS
    full = max(full_slots(config, positions, window, spare, device_type), held)
    budget = recent = 0
    if config.uses_retrieval:
        budget = config.budget_for(positions - spare - config.max_new_tokens)  # the longest prompt the cache takes
        recent = config.chunk_size + config.refresh_interval * (config.gamma2 + 1) + spare
    draft_step = max(config.prefill_block_on(device_type), spare) if model_drafter else 0
    streaming = config.sink_tokens + config.draft_window + draft_step if model_drafter else 0
    return Capacities(full, budget, recent, draft_step, streaming)


def kv_dtype_bytes(device_type: str, dtype_bytes: int) -> int:
    """Bytes of one key or value element of the caches of a model on device_type ('cpu' or 'cuda') whose elements
    take dtype_bytes (4: float32, 2: a 16-bit dtype): cache.kv_dtype's."""
    return kv_dtype(device_type, torch.float32 if dtype_bytes == 4 else torch.float16).itemsize


def kv_bytes(shape: KVShape, positions: int, dtype_bytes: int) -> int:
    """Bytes of the keys and values of every layer of shape for this many positions."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * positions * dtype_bytes


def cache_items(
    config: EngineConfig,
    caps: Capacities,
    target: KVShape,
    drafter: KVShape,
    dtype_bytes: int,
    kv_dtype_bytes: int,
    *,
    compiled: bool,
    offloaded: bool,
    drafter_copies: int = 1,
) -> list[MemoryItem]:
    """The caches' items: the retrieval cache with its chunk summaries (one key per chunk of the full cache, two for
    the bound score), the drafter's StreamingLLM cache, the compiled steps' query buffer (FullCache.make_static,
    on the device, offloaded too) and the full KV cache, on the device or, offloaded, in host
    memory, where the retrieval cache also stages the chosen chunks of every layer before their upload
    (RetrievalCache.staging). Items of caches the capacities leave out are 0.

    Args:
        dtype_bytes: bytes of an element of the model's dtype (the step queries').
        kv_dtype_bytes: bytes of a cache element (kv_dtype_bytes()).
        drafter_copies: devices holding the drafter's cache whole (tensor parallel); the target's caches are
            counted once, split over the devices.
    """
    kv_size = kv_dtype_bytes
    full_bytes = kv_bytes(target, caps.full, kv_size)
    summaries = 0
    if caps.retrieval:
        summaries = SUMMARIES[config.chunk_score] * kv_bytes(target, caps.full // config.chunk_size, kv_size) // 2
    step_queries = target.num_layers * target.num_heads * MAX_STEP_TOKENS * target.head_dim * dtype_bytes
    return [
        MemoryItem("retrieval cache", kv_bytes(target, caps.retrieval, kv_size) + summaries, 0),
        MemoryItem("drafter cache", kv_bytes(drafter, caps.streaming, kv_size) * drafter_copies, 0),
        MemoryItem("step queries", step_queries if compiled else 0, 0),
        MemoryItem("full KV cache", *((0, full_bytes) if offloaded else (full_bytes, 0))),
        MemoryItem("retrieval staging", 0, kv_bytes(target, caps.budget, kv_size) if offloaded else 0),
    ]


def prefill_activation_bytes(shape: LayerShape, tokens: int, dtype_bytes: int) -> int:
    """Bytes one eager forward of a prefill chunk of tokens holds at its peak besides weights and caches: that of a
    decoder layer (the previous layer's are freed by then; the output layer computes the last row's logits only).

    T tokens, C = hidden_size, I = intermediate_size, Hq, Hkv and D the heads and head dim, b = dtype_bytes; the
    positions (T int64) and their rotary cos and sin (2 T*D) throughout, and
    - in the MLP, the layer's input, the residual stream after attention and its norm (3 T*C), the gate and up
      projection (2 T*I), its activation and their product (2 T*I): T * b * (3C + 4I);
    - in attention, the layer's input and its norm (2 T*C), the q/k/v projection (T * (Hq + 2Hkv) * D), the
      rotated queries and keys with a temporary each (2 T * (Hq + Hkv) * D), the stacked queries, the two parts'
      outputs and the output's transposed copy (4 T*Hq*D), and the float32 merge of the parts
      (kernels.attention.merge_by_log_sum_exp: 2 T*Hq*D float32 values).
    The larger of the two is the peak. The fused attention kernels keep their tiles on chip; left out are what
    blocked_attention adds where they refuse the inputs (a block of scores, kernels.attention.KEY_BLOCK) and, for a
    sliding-window layer on the 'sdpa' backend, SDPA's math kernel on one block of queries
    (kernels.attention.WINDOW_QUERY_BLOCK).
    """
    mlp = dtype_bytes * (3 * shape.hidden_size + 4 * shape.intermediate_size)
    heads = shape.num_heads * shape.head_dim
    projections = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    rotated = 2 * (shape.num_heads + shape.num_kv_heads) * shape.head_dim
    attention = dtype_bytes * (2 * shape.hidden_size + projections + rotated + 4 * heads) + 2 * 4 * heads
    return tokens * (8 + 2 * shape.head_dim * dtype_bytes + max(mlp, attention))


def activation_item(shape: LayerShape, chunk: int, dtype_bytes: int) -> MemoryItem:
    """The memory plan's item for one prefill forward of chunk tokens on the device (prefill_activation_bytes)."""
    return MemoryItem(ACTIVATIONS_ITEM, prefill_activation_bytes(shape, chunk, dtype_bytes), 0)


def kv_layer_bytes(shape: KVShape, positions: int, dtype_bytes: int) -> int:
    """Bytes of one layer's keys and values for this many positions: the unit an offloaded cache stages."""
    return kv_bytes(shape, positions, dtype_bytes) // shape.num_layers


def staged_layers(num_layers: int, on_chip: int) -> int:
    """Layers of an offloaded full cache held on the device: the on-chip ones and the ring the others pass through."""
    on_chip = min(on_chip, num_layers)
    return on_chip + min(RING_LAYERS, num_layers - on_chip)


def staged_item(target: KVShape, caps: Capacities, dtype_bytes: int, on_chip: int) -> MemoryItem:
    """The device's share of an offloaded full cache: on_chip whole layers, the ring, and the tail of positions not
    yet written back (offload.LayerStream), whose pinned twin in host memory a flush copies it to."""
    layers = staged_layers(target.num_layers, on_chip)
    tail = kv_bytes(target, min(TAIL_POSITIONS, caps.full), dtype_bytes)
    return MemoryItem("on-chip layers and ring", layers * kv_layer_bytes(target, caps.full, dtype_bytes) + tail, tail)


@dataclass(frozen=True, eq=False)
class CacheSpec:
    """What an engine's caches are built and sized from: its target, the model drafting on a StreamingLLM cache
    and its settings. The derived properties read the models when asked (a model's step mode may change).

    Attributes:
        target: the loaded target.
        drafter: the model of the drafter tier (the target itself for self-speculation).
        config: the engine's settings.
        model_drafter: whether a model drafts on a StreamingLLM cache (Engine.uses_model_drafter).
    """

    target: LoadedModel
    drafter: Transformer
    config: EngineConfig
    model_drafter: bool

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def compiled(self) -> bool:
        """Whether the target runs its decode steps as fixed-shape steps, recorded or compiled (Transformer.use_steps),
        on caches made static."""
        return self.target.model.fixed_step is not None

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
    def window(self) -> int | None:
        """The sliding window every layer of the target shares, the only positions its full cache keeps (FullCache's
        window); None where the cache keeps every position: a target with layers of other windows or none, or a
        cache offloaded to host memory, whose streaming and layer-wise prefill take every position."""
        return None if self.offloaded else self.target.model.config.shared_window

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of every cache of the engine's models (cache.kv_dtype): float16 for a float32 target on the
        CPU, else the target's dtype."""
        return kv_dtype(self.target.device, self.target.dtype)

    @property
    def prefill_block(self) -> int:
        """Prompt tokens per prefill forward on the target's device (EngineConfig.prefill_block_on)."""
        return self.config.prefill_block_on(self.target.device.type)

    def capacities(self, prompt_tokens: int, held: int = 0) -> Capacities:
        """The positions of each cache for a generation after prompt_tokens (capacities), a full cache of `held`
        slots kept where it is large enough."""
        return capacities(
            self.config,
            prompt_tokens,
            compiled=self.compiled,
            device_type=self.target.device.type,
            model_drafter=self.model_drafter,
            held=held,
            window=self.window,
        )


def weight_items(spec: CacheSpec) -> list[MemoryItem]:
    """The weights' items of the memory plan: all on the device, or, streamed, the layers from on_chip_layers on
    in host memory and two of them at a time on the device."""
    model = spec.target.model
    stream = model.weight_stream
    if stream is None:
        return [MemoryItem("weights", weight_bytes(model, spec.drafter), 0)]
    fixed = (model.model.embed_tokens, model.model.norm, model.lm_head)  # never streamed
    resident = weight_bytes(*fixed, spec.drafter) + stream.first * stream.layer_bytes
    streamed = (len(stream.layers) - stream.first) * stream.layer_bytes
    return [
        MemoryItem("weights", resident, 0),
        MemoryItem("streamed weights", 0, streamed),
        MemoryItem("weight ring", stream.device_bytes, 0),
    ]


def memory_plan(spec: CacheSpec, caps: Capacities) -> MemoryPlan:
    """What a generation with caps holds, and where, before anything is allocated: the models' weights, and the
    caches as cache_items sizes them (the full, retrieval and StreamingLLM caches, the compiled steps' queries
    and, offloaded, the device's on-chip layers and ring), and one prefill forward's activations
    (prefill_activation_bytes)."""
    target, itemsize, kv_itemsize = spec.target.model.config, spec.target.dtype.itemsize, spec.kv_dtype.itemsize
    items = weight_items(spec)
    items += cache_items(
        spec.config,
        caps,
        target,
        spec.drafter.config,
        itemsize,
        kv_itemsize,
        compiled=spec.compiled,
        offloaded=spec.offloaded,
    )
    if spec.offloaded:
        items.append(staged_item(target, caps, kv_itemsize, spec.config.on_chip_layers))
    items.append(activation_item(target, spec.prefill_block, itemsize))
    held = tuple(item for item in items if item.device_bytes or item.host_bytes)
    return MemoryPlan(str(spec.device), held)


def check_prompt(prompt_tokens: int, config: EngineConfig, context: int, name: str) -> None:
    """A PromptError where a generation of config.max_new_tokens after prompt_tokens cannot fit the target's
    context (context positions; name: the target's, for the message), a ConfigError where config's cache positions
    exceed that context or its retrieval budget cannot serve the prompt (EngineConfig.budget_for)."""
    if not prompt_tokens:
        raise PromptError("the prompt is empty after tokenization")
    needed = prompt_tokens + config.max_new_tokens
    if needed > context:
        raise PromptError(
            f"prompt of {prompt_tokens} tokens plus {config.max_new_tokens} new tokens exceeds"
            f" the {context}-token context of {name}: use `context_window` {-(-needed // 1024)}k"
            " or more (RoPE scaled with YaRN), a shorter prompt or fewer `max_new_tokens`"
        )
    positions = config.cache_positions
    if positions is not None and positions > context:
        raise ConfigError(f"cache positions {positions} exceed the {context}-token context of {name}")
    if config.uses_retrieval:
        config.budget_for(prompt_tokens)


def check_memory(spec: CacheSpec, prompt_tokens: int, needed: tuple[int, int]) -> None:
    """A ConfigError with the figures, before any allocation, where the (device, host) bytes an allocation for a
    generation after prompt_tokens adds (the caches it builds, less those it releases first) cannot fit the device
    (or, the full cache offloaded, the host). The weights and the caches it keeps are there already.

    Under tensor parallelism every rank checks against the least free memory of any rank (parallel.least): a
    rank that refused alone would leave the others waiting in the prefill's all-reduces."""
    device = spec.device
    for where, bytes_needed, advice in (
        (device, needed[0], memory_advice(device_type=device.type, offloaded=spec.offloaded)),
        (torch.device("cpu"), needed[1], HOST_ADVICE),
    ):
        free = least(available_memory(where), device)
        if bytes_needed > 0 and free is not None and bytes_needed > free:
            raise ConfigError(
                f"the KV caches for {prompt_tokens} prompt tokens and {spec.config.max_new_tokens} new ones need"
                f" {human_size(bytes_needed)} on {where}, which has {human_size(free)} free: {advice}"
            )
