"""The cost model of `triforce plan`: bytes moved and FLOPs per forward, per tier and per mode, and memory per device.

Every figure is a prediction from a model's shape and a machine's figures, never a measurement (docs/planner.md).

A forward of T tokens over a cache of L positions reads the weights once and the keys and values it attends to once,
and computes about 2 * parameters * T FLOPs plus 4 * heads * head_dim * L * T for attention (a product of queries
and keys, one of weights and values, two FLOPs per multiply-add). Per decoder layer it takes
max(bytes / bandwidth, FLOPs / FLOP/s), plus a fixed cost per layer (kernel launches, Python), plus, over N devices
in tensor parallel, two all-reduces of the hidden states. With the full KV cache offloaded, each layer not kept on
the device also streams its keys and values over PCIe while the previous layer computes:
max(compute, transfer) per layer, summed.

TriForce's tiers: a drafter on a StreamingLLM cache drafts gamma1 tokens, the target on the retrieval cache
(budget plus recent positions) verifies them until it has gamma2 tokens, and the target on the full cache verifies
those. A verification of g drafts, each accepted with probability a, yields (1 - a^(g+1)) / (1 - a) tokens; a mode's
latency per token is the cost of one pass of its top tier (the drafting beneath it included) over the tokens that
pass yields.
"""

import dataclasses
import math
from dataclasses import dataclass, replace
from typing import ClassVar

from transformers import LlamaConfig

from triforce_cli.decoding.config import MODE_TIERS, MODES, EngineConfig
from triforce_cli.decoding.sizing import (
    Capacities,
    MemoryItem,
    activation_item,
    cache_items,
    capacities,
    kv_dtype_bytes,
    kv_layer_bytes,
    staged_item,
    staged_layers,
)
from triforce_cli.decoding.speculation_length import expected_tokens
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.environment import CUDA_CONTEXT_BYTES
from triforce_cli.runtime.forms import OffloadMode
from triforce_cli.runtime.model import HF_SHAPE_NAMES, MAX_STEP_TOKENS, ModelConfig

# the offload settings planned: streamed weights (kv+weights, for models larger than the card) are not modelled
PLANNED_OFFLOADS = (OffloadMode.NONE, OffloadMode.KV)

# budgets the recommendation tries: from the engine's default, at which this tool measured its acceptance, up past
# the TriForce paper's 4K, 8K and 12K
BUDGET_CANDIDATES = (1024, 2048, 4096, 8192, 12288, 16384)
BUDGET_TOLERANCE = 0.05  # a larger budget is recommended while it predicts at most this much more latency
GAMMA1_SEARCH = 8  # drafter tokens per retrieval verification tried by the recommendation: 1..this
GAMMA2_SEARCH = 64  # tokens per full verification tried: 1..this (EngineConfig's ceiling)
SWEEP_START = 1024  # shortest context of the latency curve (--plot)
# the share of a GPU a plan leaves to what it does not itemise: the caching allocator's rounding and fragmentation
# and a prefill chunk's float32 logits (an assumption; the engine's own check keeps
# runtime.environment.CUDA_SLACK_SHARE, which also covers what the plan itemises)
PLANNED_SLACK_SHARE = 0.03


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that decide its bytes and FLOPs.

    output_vocab: tokens the output layer computes logits for, where a drafter's is restricted to the most frequent
    ones (Transformer.restrict_output); None for the whole vocabulary. shared_window: the sliding window every layer
    has (ModelConfig.shared_window), whose full cache on the device keeps only that many positions and a slack
    (decoding.sizing.full_slots); None where a layer reads every key or another window.
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    output_vocab: int | None = None
    shared_window: int | None = None

    @classmethod
    def from_config(cls, *, name: str, config: ModelConfig) -> "ModelShape":
        """The shape of a model the runtime reads (runtime.model.ModelConfig, from a config.json)."""
        shared = [field.name for field in dataclasses.fields(cls) if field.name not in ("name", "output_vocab")]
        return cls(name=name, **{field: getattr(config, field) for field in shared})

    def llama_config(self, **settings) -> LlamaConfig:
        """A transformers config of a Llama of this shape, to build one (random-weight checks, tests); settings:
        other fields of the config (context length, RoPE)."""
        return LlamaConfig(
            **{theirs: getattr(self, ours) for ours, theirs in HF_SHAPE_NAMES.items()},
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            **settings,
        )

    @property
    def logits_vocab(self) -> int:
        return self.output_vocab or self.vocab_size

    @property
    def qkv_rows(self) -> int:
        """Output rows of the query, key and value projections together."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def step_activation_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Bytes a forward of `tokens` tokens creates besides its caches: per token the hidden state, its norm,
        attention's input and output, the queries, keys and values, the MLP's gate, up and product, in dtype_bytes,
        and the float32 logits with their copy (Transformer.forward clones a graph's output)."""
        widths = 4 * self.hidden_size + self.qkv_rows + 3 * self.intermediate_size
        return tokens * (widths * dtype_bytes + 2 * self.logits_vocab * 4)

    def prefill_hidden_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Bytes the layer-wise prefill of an offloaded cache keeps on the device for `tokens` tokens: their hidden
        states (T, hidden_size), each layer's output written over its input chunk by chunk, and rotary cos and sin
        (T, head_dim) each, as Transformer.prefill_layerwise_bytes counts them."""
        return tokens * (self.hidden_size + 2 * self.head_dim) * dtype_bytes

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: q, k, v and output projections, the gated MLP, two norms."""
        attention = self.hidden_size * self.qkv_rows + self.num_heads * self.head_dim * self.hidden_size
        bias = self.qkv_rows if self.attention_bias else 0
        return attention + bias + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size

    @property
    def output_parameters(self) -> int:
        """Parameters a forward reads after the layers: the final norm and the output layer's rows."""
        return self.hidden_size + self.logits_vocab * self.hidden_size

    @property
    def parameters(self) -> int:
        """Parameters held: the layers, the embedding table and an output layer of its own unless it is the table."""
        shares_table = self.tie_word_embeddings and self.output_vocab is None
        output = self.hidden_size if shares_table else self.output_parameters
        return self.num_layers * self.layer_parameters + self.vocab_size * self.hidden_size + output

    def weight_bytes(self, weights: "WeightBytes") -> float:
        """Bytes of the parameters held (see parameters), at weights' bytes per weight."""
        shares_table = self.tie_word_embeddings and self.output_vocab is None
        output = self.hidden_size if shares_table else self.output_parameters
        table = self.vocab_size * self.hidden_size + output
        return self.num_layers * self.layer_parameters * weights.layers + table * weights.output

    def kv_elements(self, positions: int) -> int:
        """Key and value elements of every layer for this many positions."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * positions


@dataclass(frozen=True)
class Hardware:
    """A machine's figures: per device (one GPU, or the CPU), bytes per second and FLOP/s.

    memory_bytes: memory of one device. bandwidth: its memory's bytes/s. pcie: host-to-device bytes/s, the link an
    offloaded KV cache crosses (the memory's own bandwidth on a CPU, where host and device are one). flops: dense
    FLOP/s in the compute dtype. layer_overhead_s: fixed seconds per decoder layer per forward (kernel launches,
    Python). gpus: devices in tensor parallel, each holding 1/gpus of the weights and KV heads. link and
    all_reduce_s: bytes/s between them and the fixed seconds of one all-reduce. cuda_graphs: whether decode steps
    replay as CUDA graphs (the tool's default on CUDA), which doubles the caches' headroom (decoding.sizing).
    gpu: whether a device is a GPU, which holds a CUDA context and an allocator's slack (gpu_items) and prefills in the
    GPU's chunks (EngineConfig.prefill_block_on), which the drafter's cache holds.
    """

    name: str
    memory_bytes: int
    bandwidth: float
    pcie: float
    flops: float
    layer_overhead_s: float
    gpus: int = 1
    link: float = 0.0
    all_reduce_s: float = 0.0
    cuda_graphs: bool = False
    measured: bool = False  # figures measured on this machine rather than taken from a preset
    gpu: bool = True

    # the record `triforce plan --json` writes: rates in GB/s and TFLOP/s, fixed costs in microseconds
    RECORD: ClassVar[tuple[str, ...]] = (
        "name",
        "gpus",
        "memory_bytes",
        "bandwidth_gbs",
        "pcie_gbs",
        "tflops",
        "layer_overhead_us",
        "link_gbs",
        "all_reduce_us",
        "cuda_graphs",
        "measured",
        "gpu",
    )
    RECORD_KEYS: ClassVar[dict[str, str]] = {"memory_bytes": "memory_bytes_per_device"}

    def __post_init__(self) -> None:
        figures = (self.memory_bytes, self.bandwidth, self.pcie, self.flops)
        if min(figures) <= 0 or not all(math.isfinite(f) for f in figures) or self.layer_overhead_s < 0:
            raise ConfigError(f"{self.name}: memory, bandwidths and FLOP/s must be finite and above 0")
        if self.gpus < 1 or self.gpus > 1 and self.link <= 0:
            raise ConfigError(f"{self.name}: {self.gpus} GPUs need a positive link bandwidth between them")

    @property
    def bandwidth_gbs(self) -> float:
        return self.bandwidth / 1e9

    @property
    def pcie_gbs(self) -> float:
        return self.pcie / 1e9

    @property
    def tflops(self) -> float:
        return self.flops / 1e12

    @property
    def layer_overhead_us(self) -> float:
        return self.layer_overhead_s * 1e6

    @property
    def link_gbs(self) -> float:
        return self.link / 1e9

    @property
    def all_reduce_us(self) -> float:
        return self.all_reduce_s * 1e6


@dataclass(frozen=True)
class Acceptance:
    """Per-draft acceptance rates (alpha): the drafter's tokens (by the retrieval tier or, in streaming mode, by
    the full cache) and the retrieval tier's tokens by the full cache."""

    draft: float
    retrieval: float

    def __post_init__(self) -> None:
        if not (0 <= self.draft <= 1 and 0 <= self.retrieval <= 1):
            raise ConfigError(f"acceptance rates must lie in [0, 1], not {self.draft} and {self.retrieval}")


@dataclass(frozen=True)
class WeightBytes:
    """Bytes one weight of the target takes where it is held and read: in its decoder layers, and in its output layer
    and embedding (a GGUF quantization gives them other types; plan.weights). name: the form as the user named it."""

    name: str
    layers: float
    output: float


@dataclass(frozen=True)
class Workload:
    """What is generated: a prompt of `context` tokens, the engine's settings (budget, chunk size, gammas, windows,
    new tokens), the acceptance rates, and the bytes of one element of the model's dtype (weights, activations, and
    caches but on a CPU in float32, whose caches are float16: kv_dtype_bytes); weights: the target's bytes per weight
    where they are not dtype_bytes (GGUF blocks)."""

    context: int
    engine: EngineConfig
    acceptance: Acceptance
    dtype_bytes: int
    weights: WeightBytes | None = None

    def kv_dtype_bytes(self, hardware: "Hardware") -> int:
        """Bytes of a cache element on hardware (sizing.kv_dtype_bytes: 2 on a CPU in float32, else dtype_bytes)."""
        return kv_dtype_bytes("cuda" if hardware.gpu else "cpu", self.dtype_bytes)

    @property
    def target_weights(self) -> WeightBytes:
        return self.weights or WeightBytes("dtype", self.dtype_bytes, self.dtype_bytes)

    @property
    def budget(self) -> int:
        """The retrieval budget the engine would use (a ConfigError where it does not fit the context)."""
        return self.engine.budget_for(self.context)


@dataclass(frozen=True)
class Row:
    """One mode with one offload setting: the predicted latency, its parts and the memory it holds.

    draft_ms: one drafter forward of one token; retrieval_ms: one target forward of one token on the retrieval
    cache; full_ms: the full-cache verification of a pass (gamma + 1 tokens, or 1 without drafts), its PCIe
    transfer overlapped; tokens_per_pass: tokens one full-cache verification yields on average.
    """

    mode: str
    offload: str
    ms_per_token: float
    tokens_per_pass: float
    pass_ms: float
    draft_ms: float | None
    retrieval_ms: float | None
    full_ms: float
    transfer_ms: float
    on_chip_layers: int
    memory: tuple[MemoryItem, ...]
    memory_limit_bytes: int

    # the record `triforce plan --json` writes: the memory by item, and whether it fits rather than the limit
    RECORD: ClassVar[tuple[str, ...]] = (
        "mode",
        "offload",
        "ms_per_token",
        "device_bytes",
        "host_bytes",
        "fits",
        "on_chip_layers",
        "tokens_per_pass",
        "pass_ms",
        "draft_ms",
        "retrieval_ms",
        "full_ms",
        "transfer_ms",
        "memory_by_item",
    )
    RECORD_KEYS: ClassVar[dict[str, str]] = {"memory_by_item": "memory"}

    @property
    def device_bytes(self) -> int:
        return sum(item.device_bytes for item in self.memory)

    @property
    def host_bytes(self) -> int:
        return sum(item.host_bytes for item in self.memory)

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.memory_limit_bytes

    @property
    def memory_by_item(self) -> dict[str, dict[str, int]]:
        """Each item's bytes on the device and in host memory, by its name."""
        return {item.what: {"device": item.device_bytes, "host": item.host_bytes} for item in self.memory}


@dataclass(frozen=True)
class Recommendation:
    """The settings predicted to decode fastest among those that fit: an offload setting (none wherever it fits),
    the largest budget within BUDGET_TOLERANCE of the fastest one, the gammas for it, and the layers of the full
    KV cache kept on the device; mode is the fastest of the four with these settings."""

    mode: str
    offload: str
    budget: int
    gamma1: int
    gamma2: int
    on_chip_layers: int
    triforce_ms_per_token: float
    autoregressive_ms_per_token: float
    mode_ms_per_token: float
    fits: bool

    RECORD: ClassVar[tuple[str, ...]] = (  # the record `triforce plan --json` writes
        "mode",
        "offload",
        "budget",
        "gamma1",
        "gamma2",
        "on_chip_layers",
        "triforce_ms_per_token",
        "autoregressive_ms_per_token",
        "mode_ms_per_token",
        "speedup",
        "fits",
    )
    RECORD_KEYS: ClassVar[dict[str, str]] = {"speedup": "speedup_vs_autoregressive"}

    @property
    def speedup(self) -> float:
        """TriForce's predicted speedup over autoregressive decoding with the same offload setting."""
        return self.autoregressive_ms_per_token / self.triforce_ms_per_token


@dataclass(frozen=True)
class Plan:
    rows: tuple[Row, ...]
    recommendation: Recommendation

    def row(self, mode: str, offload: str) -> Row:
        return next(r for r in self.rows if (r.mode, r.offload) == (mode, offload))


@dataclass(frozen=True)
class PredictedForward:
    """The predicted seconds of one forward (bench.forward_costs.ForwardCost holds measured ones)."""

    seconds: float
    transfer_seconds: float  # of PCIe transfer, overlapped with the compute inside seconds


def predicted_forward(
    *,
    shape: ModelShape,
    hardware: Hardware,
    tokens: int,
    positions: int,
    dtype_bytes: int,
    kv_dtype_bytes: int | None = None,
    weights: WeightBytes | None = None,
    streamed_layers: int = 0,
    split: bool = True,
) -> PredictedForward:
    """Predicted seconds of one forward of `tokens` tokens attending to `positions` cached positions, and the
    seconds of PCIe transfer it overlaps.

    Args:
        dtype_bytes: bytes of an activation element (and of a weight, unless weights says otherwise).
        kv_dtype_bytes: bytes of a cache element (Workload.kv_dtype_bytes); None: dtype_bytes.
        streamed_layers: layers whose keys and values come over PCIe during the forward (offloaded, not on chip).
        split: whether the model is split over hardware.gpus in tensor parallel (the drafter is not: each device
            holds it whole).

    Returns:
        Per layer max(bytes / bandwidth, FLOPs / FLOP/s), for a streamed layer the larger of that and its
        transfer, plus the fixed costs; then the output layer.
    """
    devices = hardware.gpus if split else 1
    weights = weights or WeightBytes("dtype", dtype_bytes, dtype_bytes)
    layer_bytes = shape.layer_parameters * weights.layers / devices
    kv_bytes = 2 * shape.num_kv_heads * shape.head_dim * positions * (kv_dtype_bytes or dtype_bytes) / devices
    attention_flops = 4 * shape.num_heads * shape.head_dim * positions * tokens
    layer_flops = (2 * shape.layer_parameters * tokens + attention_flops) / devices
    compute = max((layer_bytes + kv_bytes) / hardware.bandwidth, layer_flops / hardware.flops)
    transfer = kv_bytes / hardware.pcie
    all_reduce = 0.0
    if devices > 1:  # after attention and after the MLP: a ring all-reduce moves 2 (N - 1) / N of the activations
        moved = 2 * (devices - 1) / devices * tokens * shape.hidden_size * dtype_bytes
        all_reduce = 2 * (hardware.all_reduce_s + moved / hardware.link)
    layers = (shape.num_layers - streamed_layers) * compute + streamed_layers * max(compute, transfer)
    fixed = shape.num_layers * (hardware.layer_overhead_s + all_reduce)
    output_bytes = shape.output_parameters * weights.output / devices
    output_flops = 2 * shape.output_parameters * tokens / devices
    output = max(output_bytes / hardware.bandwidth, output_flops / hardware.flops)
    return PredictedForward(layers + fixed + output, streamed_layers * transfer)


def memory_items(
    *, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload, mode: str, offload: str
) -> tuple[list[MemoryItem], Capacities]:
    """What a mode holds, and where, before the on-chip layers: the weights, the caches as the engine sizes them
    (decoding.sizing: the full KV cache on the device or, offloaded, in host memory, the retrieval and drafter
    caches, the compiled steps' query buffers), one prefill forward's activations in the device's prefill chunk
    (decoding.sizing.prefill_activation_bytes), and on a GPU what is not a tensor of the plan (gpu_items). Also the
    caches' capacities. The drafter and its cache are held whole on every device; the activations are counted whole
    on each."""
    size = workload.dtype_bytes
    engine = replace(workload.engine, mode=mode)
    tiers = MODE_TIERS[mode]
    device_type = "cuda" if hardware.gpu else "cpu"
    caps = capacities(
        engine,
        workload.context,
        compiled=hardware.cuda_graphs,
        device_type=device_type,
        model_drafter=tiers.drafter,
        window=target.shared_window if offload == OffloadMode.NONE else None,
    )
    copies = hardware.gpus
    caches = cache_items(
        engine,
        caps,
        target,
        drafter,
        size,
        workload.kv_dtype_bytes(hardware),
        compiled=hardware.cuda_graphs,
        offloaded=offload != OffloadMode.NONE,
        drafter_copies=copies,
    )
    items = [
        MemoryItem("target weights", round(target.weight_bytes(workload.target_weights)), 0),
        MemoryItem("drafter weights", drafter.parameters * size * copies if tiers.drafter else 0, 0),
        *caches,
        activation_item(target, engine.prefill_block_on(device_type), size),
    ]
    if hardware.gpu:
        setup = {"target": target, "drafter": drafter, "hardware": hardware, "workload": workload}
        items += gpu_items(**setup, mode=mode, offload=offload)
    return [item for item in items if item.device_bytes or item.host_bytes], caps


GPU_ITEMS = ("CUDA context", "CUDA graph pools", "prefill hidden states", "CUDA allocator slack")


def gpu_items(
    *, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload, mode: str, offload: str
) -> list[MemoryItem]:
    """What a GPU holds besides the weights and caches (GPU_ITEMS), each on every device: the CUDA context
    (runtime.environment.CUDA_CONTEXT_BYTES); with CUDA graphs, a pool per graphed model for the activations of its
    longest fixed-shape step (MAX_STEP_TOKENS tokens; an offloaded full cache's steps are graphed too, one
    recording per length bucket, which share the target's pool: a step's activations are freed when it ends);
    offloaded, the layer-wise prefill's hidden states of the whole prompt, held while the prefill runs; and
    PLANNED_SLACK_SHARE of the card for the rest."""
    size, copies, tiers = workload.dtype_bytes, hardware.gpus, MODE_TIERS[mode]
    offloaded = offload != OffloadMode.NONE
    pools = 0
    if hardware.cuda_graphs:
        pools += target.step_activation_bytes(MAX_STEP_TOKENS, size)
        pools += drafter.step_activation_bytes(MAX_STEP_TOKENS, size) if tiers.drafter else 0
    hidden = target.prefill_hidden_bytes(workload.context, size) if offloaded else 0
    return [
        MemoryItem("CUDA context", CUDA_CONTEXT_BYTES * copies, 0),
        MemoryItem("CUDA graph pools", pools * copies, 0),
        MemoryItem("prefill hidden states", hidden * copies, 0),
        MemoryItem("CUDA allocator slack", int(PLANNED_SLACK_SHARE * hardware.memory_bytes) * copies, 0),
    ]


def on_chip_layers(*, device_bytes: int, layer_bytes: int, num_layers: int, memory_limit: int) -> int:
    """How many layers' full keys and values fit on the device next to device_bytes and the ring an offloaded
    forward stages the others in (sizing.staged_layers); 0 where not even the ring fits."""
    for layers in range(num_layers, 0, -1):
        if device_bytes + staged_layers(num_layers, layers) * layer_bytes <= memory_limit:
            return layers
    return 0


def mode_row(
    *, mode: str, offload: str, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload
) -> Row:
    """The predicted latency and memory of one mode with one offload setting (see the module docstring)."""
    cfg, size, alpha = workload.engine, workload.dtype_bytes, workload.acceptance
    kv_size = workload.kv_dtype_bytes(hardware)
    items, caps = memory_items(
        target=target, drafter=drafter, hardware=hardware, workload=workload, mode=mode, offload=offload
    )
    limit = hardware.memory_bytes * hardware.gpus
    on_chip = 0
    if offload == OffloadMode.KV:
        device = sum(item.device_bytes for item in items)
        layer_bytes = kv_layer_bytes(target, caps.full, kv_size)
        on_chip = on_chip_layers(
            device_bytes=device, layer_bytes=layer_bytes, num_layers=target.num_layers, memory_limit=limit
        )
        items.append(staged_item(target, caps, kv_size, on_chip))
    streamed = target.num_layers - on_chip if offload == OffloadMode.KV else 0
    tiers = MODE_TIERS[mode]
    gamma = (cfg.gamma2 if tiers.retrieval else cfg.gamma1) if tiers.speculative else 0
    full = predicted_forward(
        shape=target,
        hardware=hardware,
        tokens=gamma + 1,
        positions=workload.context,
        dtype_bytes=size,
        kv_dtype_bytes=kv_size,
        weights=workload.weights,
        streamed_layers=streamed,
    )
    draft = retrieval = None
    drafting = 0.0  # seconds of drafting per full verification
    if tiers.drafter:
        window = min(workload.context, cfg.sink_tokens + cfg.draft_window)
        draft = predicted_forward(
            shape=drafter,
            hardware=hardware,
            tokens=1,
            positions=window,
            dtype_bytes=size,
            kv_dtype_bytes=kv_size,
            split=False,
        ).seconds
    if tiers.retrieval:
        # the budget, and on average half the recent positions committed since the last chunk selection
        attended = workload.budget + cfg.chunk_size + cfg.refresh_interval * (cfg.gamma2 + 1) // 2

        def on_retrieval(tokens: int) -> float:
            cost = predicted_forward(
                shape=target,
                hardware=hardware,
                tokens=tokens,
                positions=attended,
                dtype_bytes=size,
                kv_dtype_bytes=kv_size,
                weights=workload.weights,
            )
            return cost.seconds

        retrieval = on_retrieval(1)
        if tiers.drafter:  # retrieval verifications of gamma1 drafts until gamma2 tokens are there
            verifications = cfg.gamma2 / expected_tokens(alpha.draft, cfg.gamma1)
            drafting = verifications * (cfg.gamma1 * draft + on_retrieval(cfg.gamma1 + 1))
        else:
            drafting = cfg.gamma2 * retrieval
        selection = selection_seconds(target=target, hardware=hardware, workload=workload, offload=offload)
        drafting += selection / cfg.refresh_interval
        tokens = expected_tokens(alpha.retrieval, cfg.gamma2)
    elif tiers.drafter:
        drafting = cfg.gamma1 * draft
        tokens = expected_tokens(alpha.draft, cfg.gamma1)
    else:
        tokens = 1.0
    pass_seconds = drafting + full.seconds
    return Row(
        mode=mode,
        offload=offload,
        ms_per_token=1e3 * pass_seconds / tokens,
        tokens_per_pass=tokens,
        pass_ms=1e3 * pass_seconds,
        draft_ms=None if draft is None else 1e3 * draft,
        retrieval_ms=None if retrieval is None else 1e3 * retrieval,
        full_ms=1e3 * full.seconds,
        transfer_ms=1e3 * full.transfer_seconds,
        on_chip_layers=on_chip,
        memory=tuple(items),
        memory_limit_bytes=limit,
    )


def selection_seconds(*, target: ModelShape, hardware: Hardware, workload: Workload, offload: str) -> float:
    """One chunk selection of the retrieval cache: read the chunk mean keys, then copy the budget's keys and values
    from the full cache (over PCIe where it is offloaded) into the retrieval cache."""
    size, devices = workload.kv_dtype_bytes(hardware), hardware.gpus
    mean_keys = target.kv_elements(workload.context // workload.engine.chunk_size) // 2 * size / devices
    gathered = target.kv_elements(workload.budget) * size / devices
    source = hardware.pcie if offload == OffloadMode.KV else hardware.bandwidth
    return (mean_keys + gathered) / hardware.bandwidth + gathered / source


def predict_rows(*, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload) -> tuple[Row, ...]:
    """Every mode with and without the full KV cache offloaded."""
    return tuple(
        mode_row(mode=mode, offload=offload, target=target, drafter=drafter, hardware=hardware, workload=workload)
        for mode in MODES
        for offload in PLANNED_OFFLOADS
    )


def plan(*, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload) -> Plan:
    """Every mode with and without the full KV cache offloaded, and the recommended settings."""
    shared = {"target": target, "drafter": drafter, "hardware": hardware, "workload": workload}
    return Plan(predict_rows(**shared), recommend(**shared))


def context_sweep(workload: Workload) -> list[Workload]:
    """workload at the powers of two from SWEEP_START up to its context, and at its context: those long enough for
    the budget."""
    lengths = {workload.context}
    length = SWEEP_START
    while length < workload.context:
        lengths.add(length)
        length *= 2
    needed = max(workload.engine.chunk_size, workload.engine.budget or 0)
    return [replace(workload, context=length) for length in sorted(lengths) if length >= needed]


def best_gammas(
    *, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload, offload: str
) -> tuple[Row, Workload]:
    """TriForce's fastest predicted gamma1 (1..GAMMA1_SEARCH) and gamma2 (1..GAMMA2_SEARCH) with everything else
    as in workload: its row, and workload with those gammas."""
    best: tuple[Row, Workload] | None = None
    for gamma1 in range(1, GAMMA1_SEARCH + 1):
        for gamma2 in range(1, GAMMA2_SEARCH + 1):
            tried = replace(workload, engine=replace(workload.engine, gamma1=gamma1, gamma2=gamma2))
            row = mode_row(
                mode="triforce", offload=offload, target=target, drafter=drafter, hardware=hardware, workload=tried
            )
            if best is None or row.ms_per_token < best[0].ms_per_token:
                best = row, tried
    return best


def recommend(*, target: ModelShape, drafter: ModelShape, hardware: Hardware, workload: Workload) -> Recommendation:
    """The first offload setting (none, then kv) under which some budget fits; among the budgets that fit, the
    largest whose TriForce latency, with its best gammas, lies within BUDGET_TOLERANCE of the fastest one's.

    Acceptance is held fixed while the budget changes, so a smaller budget always predicts faster; a larger one
    is accepted at least as often (the TriForce paper's acceptance grows with the budget), which the tolerance
    buys where it costs little. Where nothing fits, the settings given are kept and the recommendation says so.
    """
    whole_chunks = workload.context // workload.engine.chunk_size * workload.engine.chunk_size
    budgets = [b for b in BUDGET_CANDIDATES if b <= whole_chunks and b % workload.engine.chunk_size == 0]
    budgets = budgets or [workload.budget]
    for offload in PLANNED_OFFLOADS:
        tried = []
        for budget in budgets:
            with_budget = replace(workload, engine=replace(workload.engine, budget=budget))
            row, best = best_gammas(
                target=target, drafter=drafter, hardware=hardware, workload=with_budget, offload=offload
            )
            if row.fits:
                tried.append((row, best))
        if tried:
            fastest = min(row.ms_per_token for row, _ in tried)
            row, chosen = max(
                ((r, w) for r, w in tried if r.ms_per_token <= fastest * (1 + BUDGET_TOLERANCE)),
                key=lambda pair: pair[1].budget,
            )
            return recommendation(triforce=row, workload=chosen, target=target, drafter=drafter, hardware=hardware)
    row = mode_row(
        mode="triforce", offload=OffloadMode.KV, target=target, drafter=drafter, hardware=hardware, workload=workload
    )
    return recommendation(triforce=row, workload=workload, target=target, drafter=drafter, hardware=hardware)


def recommendation(
    *, triforce: Row, workload: Workload, target: ModelShape, drafter: ModelShape, hardware: Hardware
) -> Recommendation:
    """The recommendation for TriForce's row under workload's settings, naming the fastest mode with them."""
    rows = [
        mode_row(
            mode=mode, offload=triforce.offload, target=target, drafter=drafter, hardware=hardware, workload=workload
        )
        for mode in MODES
    ]
    fitting = [row for row in rows if row.fits] or rows
    fastest = min(fitting, key=lambda row: row.ms_per_token)
    return Recommendation(
        mode=fastest.mode,
        offload=triforce.offload,
        budget=workload.budget,
        gamma1=workload.engine.gamma1,
        gamma2=workload.engine.gamma2,
        on_chip_layers=triforce.on_chip_layers,
        triforce_ms_per_token=triforce.ms_per_token,
        autoregressive_ms_per_token=rows[MODES.index("autoregressive")].ms_per_token,
        mode_ms_per_token=fastest.ms_per_token,
        fits=triforce.fits,
    )
