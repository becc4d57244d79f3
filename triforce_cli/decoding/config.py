"""Run-time settings of the speculative pipeline, validated in one place."""

import math
from dataclasses import dataclass, field
from enum import StrEnum

from triforce_cli.decoding.sampling import SamplingConfig
from triforce_cli.decoding.speculation_length import GammaPolicy
from triforce_cli.errors import ConfigError
from triforce_cli.kernels import CHUNK_SCORES, ChunkScore
from triforce_cli.runtime.forms import OFFLOAD_CHOICES, OffloadMode

GAMMA_POLICIES = tuple(policy.value for policy in GammaPolicy)

DEFAULT_BUDGET = 1024


@dataclass(frozen=True)
class Tiers:
    """The tiers a mode runs below target@full, the tier every mode has."""

    retrieval: bool  # target@retrieval: the target on the retrieval cache
    drafter: bool  # a drafter tier: a model on a StreamingLLM cache and/or the n-gram proposer (EngineConfig.ngram)

    @property
    def speculative(self) -> bool:
        """Whether target@full verifies drafts, instead of sampling every token itself."""
        return self.retrieval or self.drafter


class Mode(StrEnum):
    """The tiers a generation runs (EngineConfig.mode): every mode ends in target@full."""

    AUTOREGRESSIVE = "autoregressive"  # target@full alone
    RETRIEVAL = "retrieval"  # target@retrieval -> target@full
    STREAMING = "streaming"  # drafter@StreamingLLM -> target@full
    TRIFORCE = "triforce"  # drafter@StreamingLLM -> target@retrieval -> target@full


MODE_TIERS = {
    Mode.AUTOREGRESSIVE: Tiers(retrieval=False, drafter=False),
    Mode.RETRIEVAL: Tiers(retrieval=True, drafter=False),
    Mode.STREAMING: Tiers(retrieval=False, drafter=True),
    Mode.TRIFORCE: Tiers(retrieval=True, drafter=True),
}
MODES = tuple(mode.value for mode in Mode)
MAX_GAMMA = 64  # drafts per verification: far past where verifying them costs more than it saves
MAX_REFRESH_INTERVAL = 256  # full verifications between chunk selections: the retrieval cache keeps their tokens
MAX_DRAFT_CACHE = 1 << 20  # positions of the drafter's StreamingLLM cache (sinks + window)
# Prompt tokens per prefill forward (a prefill block; not the retrieval cache's chunks, EngineConfig.chunk_size), by
# device. On the CPU, the block at which a prompt prefilled fastest with SDPA's attention, and close to the fastest
# with the extension's chunk attention, which cache_attention (kernels.attention) replaced; see
# docs/performance.md. On a GPU, 4,096: a block's attention is a few fused
# kernel calls whatever the context (FlashAttention, or the sdpa backend's torch_attention), whose tiles of 128
# query rows then number Hkv * G*T / 128 = 1,024 for an 8B model's 32 query heads, enough to fill every SM of an
# H100 (512 tokens gave 128 for its 132), and 128K tokens take 32 forwards rather than 256, each paying the
# layers' launches once. Its activations, about 0.5 GiB for an 8B model in bfloat16 (logits of the last row only),
# are an item of the memory plan (decoding.sizing.prefill_activation_bytes); prefix reuse keeps whole blocks
# where a position's bits depend on the forward's shape (outside the numeric contract: Engine.exact_positions).
PREFILL_BLOCK = {"cpu": 256, "cuda": 4096}


@dataclass(frozen=True)
class EngineConfig:
    """How tokens are proposed and verified.

    mode: ``autoregressive`` (target@full only), ``retrieval`` (target@retrieval -> target@full), ``streaming``
    (drafter@StreamingLLM -> target@full) or ``triforce`` (all three tiers).
    budget: tokens of prompt chunks the retrieval cache keeps; None picks min(1024, the prompt's whole chunks).
    chunk_size: tokens per retrieval chunk, the unit the retrieval cache scores and keeps (``--chunk-size``).
    chunk_score: how the retrieval cache scores chunks against the query: ``mean`` (its mean key, TriForce's) or
    ``bound`` (Quest's bound from its minimum and maximum keys; kernels/retrieval.py).
    gamma1: drafter tokens per verification by the tier above it; gamma2: tokens target@full verifies per pass
    in ``triforce`` and ``retrieval`` modes. The retrieval tier drafts fewer than gamma1 where target@full wants
    fewer tokens than gamma1 + 1.
    gamma_policy: ``fixed`` gammas, or adapted after every verification (``heuristic``: +2/-1;
    ``throughput``: most expected tokens per second, timed; ``costed``: the same from prices fixed before decoding,
    plain steps unless drafting promises more), with gamma1/gamma2 as ceilings (speculation_length.py); ``auto``
    is costed (see speculation_policy). Under throughput and costed, target@full in ``triforce`` mode also
    chooses, by the same measure, between the retrieval tier's tokens and the drafter's own (the middle tier
    skipped where it does not pay); ``fixed`` and ``heuristic`` keep all three tiers.
    refresh_interval: full verifications between two chunk selections of the retrieval cache; a selection that
        falls due while the full tier drafts straight from the drafter waits until the retrieval tier drafts again.
    prefill_block: prompt tokens per prefill forward (a prefill block, apart from the retrieval chunks); None:
        PREFILL_BLOCK's for the target's device.
    ngram: draft with the training-free n-gram proposer: alone, or first with the model drafter drafting where it
    finds no continuation (speculative.FallbackProposer); None (the default) puts it first wherever a model
    drafter is given, and leaves it out otherwise (Engine.uses_ngram). ngram_max is the longest suffix it looks up;
    ngram_min_match the fewest tokens a match must hold to propose (decoding/ngram.py). Under the costed policy
    its drafts are also offered to the target on its full cache at every step whose tokens the host has read
    (speculative.ModelTier.lookup).
    offload: ``none`` (every cache on the device) or ``kv`` (the target's full KV cache in host memory, streamed to
    the device layer by layer for each forward over it, offload/kv.py), with the first ``on_chip_layers`` layers
    kept on the device; ``kv+weights`` streams the other layers' weights too (offload/weights.py).
    cache_positions: positions (prompt plus new tokens) the caches are allocated for at the first generation, for
    an engine that serves many prompts (a chat, a server, a benchmark): every prompt up to that long then reuses
    the same buffers, and compiled steps their graphs. None: sized to the first prompt. Either way a longer prompt
    grows them, the old ones released first, and they never shrink (decoding/sizing.py).
    """

    mode: Mode = Mode.TRIFORCE
    budget: int | None = None
    chunk_size: int = 16
    chunk_score: ChunkScore = ChunkScore.MEAN
    sink_tokens: int = 16
    draft_window: int = 496
    gamma1: int = 2
    gamma2: int = 6
    gamma_policy: GammaPolicy = GammaPolicy.AUTO
    max_new_tokens: int = 256
    refresh_interval: int = 4
    prefill_block: int | None = None  # tokens per prefill forward; None: PREFILL_BLOCK for the target's device
    ngram: bool | None = None
    ngram_max: int = 3
    ngram_min_match: int = 3
    ignore_eos: bool = False  # generate max_new_tokens whatever the model samples
    offload: OffloadMode = OffloadMode.NONE
    on_chip_layers: int = 0
    cache_positions: int | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODE_TIERS:
            raise ConfigError(f"unknown mode '{self.mode}' (choose from {', '.join(MODES)})")
        drafter_modes = " or ".join(mode for mode, tiers in MODE_TIERS.items() if tiers.drafter)
        checks = [
            (self.chunk_size > 0, "chunk size must be positive"),
            (
                self.chunk_score in CHUNK_SCORES,
                f"unknown chunk score '{self.chunk_score}' (choose from {', '.join(CHUNK_SCORES)})",
            ),
            (self.budget is None or self.budget > 0, "budget must be positive"),
            (
                self.budget is None or self.chunk_size <= 0 or self.budget % self.chunk_size == 0,
                f"budget {self.budget} is not a multiple of chunk size {self.chunk_size}",
            ),
            (self.sink_tokens >= 0, "sink tokens must not be negative"),
            (self.draft_window > 0, "draft window must be positive"),
            (0 < self.gamma1 <= MAX_GAMMA, f"gamma1 must lie in 1..{MAX_GAMMA}"),
            (0 < self.gamma2 <= MAX_GAMMA, f"gamma2 must lie in 1..{MAX_GAMMA}"),
            (
                self.gamma_policy in GAMMA_POLICIES,
                f"unknown gamma policy '{self.gamma_policy}' (choose from {', '.join(GAMMA_POLICIES)})",
            ),
            (self.max_new_tokens > 0, "max new tokens must be positive"),
            (
                self.draft_window >= self.speculation_depth,
                (
                    f"draft window {self.draft_window} must hold at least gamma1 + gamma2 + 2 ="
                    f" {self.speculation_depth} tokens, the most a verification can roll back"
                ),
            ),
            (
                0 < self.refresh_interval <= MAX_REFRESH_INTERVAL,
                f"refresh interval must lie in 1..{MAX_REFRESH_INTERVAL}",
            ),
            (
                self.sink_tokens + self.draft_window <= MAX_DRAFT_CACHE,
                f"sink tokens + draft window must not exceed {MAX_DRAFT_CACHE} positions",
            ),
            (self.prefill_block is None or self.prefill_block > 0, "prefill block must be positive"),
            (self.ngram_max > 0, "n-gram length must be positive"),
            (self.ngram_min_match > 0, "n-gram match must be positive"),
            (
                self.offload in OFFLOAD_CHOICES,
                f"unknown offload '{self.offload}' (choose from {', '.join(OFFLOAD_CHOICES)})",
            ),
            (self.on_chip_layers >= 0, "on-chip layers must not be negative"),
            (
                self.on_chip_layers == 0 or self.offload != OffloadMode.NONE,
                (
                    "`on_chip_layers` keeps layers of an offloaded KV cache on the device: give `offload` kv (or"
                    " kv+weights) with it, or leave it out"
                ),
            ),
            (self.cache_positions is None or self.cache_positions > 0, "cache positions must be positive"),
            (not self.ngram or self.uses_drafter, f"`ngram` needs a `mode` with a drafter tier ({drafter_modes})"),
            (0 <= self.sampling.temperature < math.inf, "temperature must be a finite number, 0 or more"),
            (0 < self.sampling.top_p <= 1, "top-p must lie in (0, 1]"),
            (self.sampling.top_k >= 0, "top-k must not be negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def prefill_block_on(self, device_type: str) -> int:
        """Tokens per prefill forward on a device of this type ('cpu', 'cuda'): prefill_block, else PREFILL_BLOCK's."""
        return self.prefill_block or PREFILL_BLOCK.get(device_type, PREFILL_BLOCK["cuda"])

    @property
    def speculation_depth(self) -> int:
        """Most positions any cache may hold beyond the committed sequence within one top-level step."""
        return self.gamma1 + self.gamma2 + 2

    @property
    def speculation_policy(self) -> GammaPolicy:
        """The policy to run: ``auto`` is costed, seeded or not: its choices follow prices fixed before decoding and
        the acceptance counts, so a seeded sampled run repeats exactly (throughput's follow the clock)."""
        return GammaPolicy.COSTED if self.gamma_policy == GammaPolicy.AUTO else GammaPolicy(self.gamma_policy)

    @property
    def uses_retrieval(self) -> bool:
        return MODE_TIERS[self.mode].retrieval

    @property
    def uses_drafter(self) -> bool:
        return MODE_TIERS[self.mode].drafter

    def budget_for(self, prompt_tokens: int) -> int:
        """The retrieval budget for a prompt; an explicit budget must fit inside it."""
        whole_chunks = prompt_tokens // self.chunk_size * self.chunk_size
        if self.budget is None:
            if whole_chunks == 0:
                raise ConfigError(
                    f"prompt of {prompt_tokens} tokens is shorter than one retrieval chunk ({self.chunk_size});"
                    " use a smaller `chunk_size` or `mode` streaming/autoregressive"
                )
            return min(DEFAULT_BUDGET, whole_chunks)
        if self.budget > whole_chunks:
            raise ConfigError(
                f"budget {self.budget} is larger than the prompt's {whole_chunks} tokens in whole chunks"
                f" of {self.chunk_size}"
            )
        return self.budget
