"""One Llama-family decoder serving every tier: ``forward(tokens, start, cache) -> logits``.

RMSNorm, rotary embeddings (plain, linear, llama3, YaRN and Phi-3's LongRoPE scaling, initialised by
transformers' ``ROPE_INIT_FUNCTIONS``), grouped-query attention with optional q/k/v biases (Qwen2), SwiGLU MLP, tied
or separate output embeddings. Parameter names are those of Hugging Face's Llama/Qwen2 checkpoints, except that the
projections reading the same input are fused into one linear stacking their rows (qkv_proj, gate_up_proj, which
are Phi-3's own names): a decode step then makes three fewer calls per layer into the weight kernels, each of which
has a fixed cost.
fuse_checkpoint renames a checkpoint's state dict accordingly (Transformer.load_hf_state). Which cache is passed
in decides the tier; the model never branches on it.
Batch size is 1: tokens (T,), hidden states (T, C).

LongRoPE has a short and a long set of frequencies; transformers picks one per forward from the positions it sees,
which would make a forward verifying several tokens differ from single steps. Here the set is chosen once per
generation, from the positions it may reach (Transformer.fit_rope), and every forward of it uses that one.

use_steps() makes every decode step of up to MAX_STEP_TOKENS tokens on a cache made static a fixed-shape step:
the tokens are padded to a power of two, positions and the cache's write slot are device tensors, and attention
runs over the cache's whole buffers with a mask (kernels.attention_in_cache), so one recording per padded length
serves every position: on CUDA a CUDA graph (runtime/graphs.py), of the eager step (StepMode 'graphs') or of its
inductor compilation ('compiled'). Prefill chunks and steps on caches not made static stay eager.

A float32 model on the CPU whose linears are tiled or GGUF blocks runs every eager forward's layers through the CPU
step ops (kernels.step: DecoderLayer.step_forward), each row computed in one order of arithmetic (the numeric
contract): over a float16 cache in host memory a whole layer in one call (the cache's write read once per forward,
KVCache.eager_write), and there every layer of the forward in one call where no layer has hooks (cached_layers over
a LayerStack read once from the layers' operands: Transformer.stacked_layers), with the embedding's lookup and the
output layer the whole forward from ids to logits in one call (cached_step: Transformer.one_call), elsewhere its
norm, projection and RoPE in one call, the cache's update and attention, then the rest of the layer in one call.
Fixed-shape steps, other devices and dtypes, and dense linears run torch's ops.

prefill_layerwise() runs a prompt layer by layer instead of chunk by chunk (for a full cache in host memory, whose
every forward streams every layer's prefix to the device): the same forwards of the same chunks, in another order.
"""

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.hooks import RemovableHandle
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from triforce_cli.cache import EagerWrite, FullCache, KVCache, LayerwiseWrite, StaticStep
from triforce_cli.kernels import (
    attention,
    attention_backend,
    attention_in_cache,
    linear,
    runs_cache_attention,
    segment_keys,
)
from triforce_cli.kernels.step import (
    Projection,
    StackWrite,
    attention_input,
    cached_layer,
    cached_layers,
    cached_step,
    layer_output,
    layer_stack,
    output_head,
    output_logits,
    rms_norm,
    stack_layer,
    step_ops_available,
)
from triforce_cli.offload.weights import WeightStream
from triforce_cli.runtime.forms import StepMode
from triforce_cli.runtime.graphs import StepGraphs
from triforce_cli.runtime.rotations import RotationTable

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
MAX_STEP_TOKENS = 128  # longest decode step run with a fixed shape (MAX_GAMMA + 1 rounded up); longer: eager


class ModuleChanges:
    """A count of the changes that may change a layer's step operands: a submodule, parameter or buffer
    registered on any module in this process (torch's global registration hooks, which module assignment goes
    through), and what changes the layers in place (moved or loaded: DecoderLayer; attention's backend:
    Transformer.use_attention). Transformer.stacked_layers reads the layers' operands again only after one, not at
    every step (30 layers' lookups, with the caches cold after the layers' kernels, cost ~0.15 ms a step)."""

    count = 0

    @classmethod
    def note(cls, *_registered) -> None:
        cls.count += 1


for _register in (
    nn.modules.module.register_module_module_registration_hook,
    nn.modules.module.register_module_parameter_registration_hook,
    nn.modules.module.register_module_buffer_registration_hook,
):
    _register(ModuleChanges.note)  # returns None: the registered object stays as given


FLOAT32_ROWS = torch.empty(0)  # any float32 rows on the CPU, where only their dtype and device are asked


def stack_write(step: EagerWrite) -> StackWrite:
    """What kernels.step.cached_layers (and cached_step) read and write of the cache for a forward writing step."""
    return StackWrite(
        step.keys, step.values, step.slots.start, step.first_slots, step.origin, step.slots_are_positions,
        segment_keys(step.slots_are_positions), step.queries is not None,
    )  # fmt: skip


class OneCall(NamedTuple):
    """Transformer.one_call's operands of kernels.step.cached_step."""

    stack: torch.ScriptObject  # the layers (stacked_layers')
    embedding: list[torch.Tensor | None]  # the token embedding's table (step_embedding)
    head: torch.ScriptObject  # the final norm and output layer (step_head)


class OneCallKey(NamedTuple):
    """What Transformer.one_call's answer for an eager write depends on besides the tokens."""

    module_changes: int  # ModuleChanges.count: the modules' operands, their attention backends
    hook_handles: int  # RemovableHandle.next_id: a hook registered anywhere since (a layer with hooks runs alone)
    output_ids: torch.Tensor | None  # restrict_output's tokens, the same tensor
    keys_dtype: torch.dtype  # the cache's keys, which attention must read (runs_cache_attention)
    keys_device: torch.device

    def holds(self, now: "OneCallKey") -> bool:
        """Whether an answer read under this key holds under now."""
        return (
            self.module_changes == now.module_changes
            and self.hook_handles == now.hook_handles
            and self.output_ids is now.output_ids
            and self.keys_dtype == now.keys_dtype
            and self.keys_device == now.keys_device
        )


def padded_length(num_tokens: int) -> int:
    """The fixed length a decode step of num_tokens runs at: the next power of two, so that a tier verifying up
    to g tokens needs about log2(g) graphs, and a step computes less than twice its tokens."""
    return 1 << (num_tokens - 1).bit_length()


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this runtime implements."""


def config_refusal(error: BaseException) -> BaseException:
    """What to tell of an error reading a config: for a check of huggingface_hub's strict dataclasses (a hidden size
    that the heads do not divide), the check's own error, not its one-line heading."""
    return error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ is not None else error


# the shape fields every Llama-family config has, by their names here and in a transformers config
HF_SHAPE_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on q/k/v projections
    output_bias: bool  # bias on the attention output projection
    mlp_bias: bool
    rope: dict
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3)
    # per layer, the sliding window W of a windowed layer (a query at position i reads keys j with i - W < j <= i),
    # None for a layer reading every earlier key; empty: no layer is windowed
    sliding_windows: tuple[int | None, ...] = ()

    def sliding_window(self, layer: int) -> int | None:
        """The window of layer (sliding_windows), None where it reads every earlier key."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def shared_window(self) -> int | None:
        """The sliding window W where every layer has the same one (Mistral's, Phi-3's), else None: a full cache
        then needs to hold only the positions a query can read (cache.FullCache's window)."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 and None not in windows else None

    @classmethod
    def from_hf(cls, hf: PretrainedConfig) -> "ModelConfig":
        if getattr(hf, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"model type '{getattr(hf, 'model_type', None)}' is not Llama-family")
        rope = dict(getattr(hf, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(f"rope type '{rope.get('rope_type')}' is not supported")
        for theirs in (*HF_SHAPE_NAMES.values(), "num_key_value_heads", "max_position_embeddings"):
            size = getattr(hf, theirs, None)
            optional = theirs == "num_key_value_heads" and size is None  # then as many as the query heads
            if not optional and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise UnsupportedModelError(f"config {theirs} {size!r}: a positive whole number is needed")
        partial = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0)
        if partial != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            **{ours: getattr(hf, theirs) for ours, theirs in HF_SHAPE_NAMES.items()},
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
            output_bias=bool(getattr(hf, "attention_bias", False)) and hf.model_type != "qwen2",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope=rope,
            qk_norm=hf.model_type == "qwen3",
            sliding_windows=hf_sliding_windows(hf),
        )


def hf_sliding_windows(hf: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it, () where no layer has one.

    Mistral and Phi-3 window every layer when sliding_window is set (Phi-3's 128K models set one wider than their
    context: no position is ever hidden). Qwen2 and Qwen3 configs set sliding_window to None
    unless use_sliding_window, and window the layers whose layer_types entry is "sliding_attention" (by default
    those from max_window_layers on).
    """
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    if hf.model_type in ("mistral", "phi3"):
        return (window,) * hf.num_hidden_layers
    if hf.model_type in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        return ()
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * hf.num_hidden_layers
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(windows) else ()


def rope_frequencies(hf: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (head_dim/2,) and the cos/sin scale of the configured RoPE variant (LongRoPE's short
    set: see long_rope_frequencies)."""
    rope = hf.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (rope["rope_theta"] ** exponents), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")


def long_rope_frequencies(hf: PretrainedConfig) -> torch.Tensor | None:
    """LongRoPE's long inverse frequencies (head_dim/2,), those transformers uses once a forward's positions pass
    original_max_position_embeddings (their cos/sin scale is the short set's); None for every other RoPE variant."""
    rope = hf.rope_parameters
    if rope.get("rope_type") != "longrope":
        return None
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=rope["original_max_position_embeddings"] + 1)
    return inv_freq


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (H, T, D) in Llama's half-split layout, [x1 * cos - x2 * sin, x2 * cos + x1 * sin], by
    rotation (T, 2, 2, D/2) = [[cos, -sin], [sin, cos]] (Transformer.rotary): half i is the sum over halves j of
    x_j * rotation[:, i, j], two ops (a product and a sum over a dim of 2), each half the sum of two rounded
    products as x * cos + roll(x) * sin gives it.

    Returns:
        (H, T, D), contiguous whatever x's strides (a decode step's grouped query rows are then a view).
    """
    halves = x.unflatten(-1, (1, 2, x.shape[-1] // 2))  # (H, T, 1, 2, D/2)
    return (halves * rotation).sum(dim=-2).flatten(-2)


def fused_projections(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """Each fused projection of a decoder layer -> the checkpoint's projections whose rows it stacks, in order, with
    their output rows; names relative to the layer."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.qkv_proj": (
            ("self_attn.q_proj", q_rows),
            ("self_attn.k_proj", kv_rows),
            ("self_attn.v_proj", kv_rows),
        ),
        "mlp.gate_up_proj": (("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)),
    }


def checkpoint_parts(module: str, cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The checkpoint's modules that the runtime module path fuses, with their output rows, in row order; empty
    where the module is not a fused projection."""
    for fused, parts in fused_projections(cfg).items():
        if module.endswith(f".{fused}"):
            layer = module.removesuffix(fused)  # "model.layers.<i>."
            return tuple((layer + part, rows) for part, rows in parts)
    return ()


def fuse_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename a state dict with Hugging Face's names, in place, as the runtime names it: each layer's q, k and v
    weights (and biases) concatenated along their output rows into qkv_proj's, its gate and up weights (and biases)
    into gate_up_proj's.

    Each projection's parts leave state as their fused tensor enters it, so (unless held elsewhere) they are freed
    projection by projection, and memory never holds more than one projection twice. Every other entry stays as it
    is, and so do the parts of a projection the state holds only in part, for load_state_dict to report.

    Returns:
        state itself.
    """
    for layer in range(cfg.num_layers):
        for projection, parts in fused_projections(cfg).items():
            for param in ("weight", "bias"):
                names = [f"model.layers.{layer}.{part}.{param}" for part, _ in parts]
                if all(name in state for name in names):
                    state[f"model.layers.{layer}.{projection}.{param}"] = torch.cat([state.pop(name) for name in names])
    return state


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) normalised and scaled in one op, in x's dtype (accumulated in float32 inside: on CUDA a
        single fused kernel), the same in eager and fixed-shape steps."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def spread_over_vocabulary(logits: torch.Tensor, output_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits (N, V') for the tokens output_ids (V',) as logits (N, vocab_size), -inf for every other token."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    return full.index_copy_(1, output_ids, logits)


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) computed by kernels.linear, fast for the few rows of a decode step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ConcatLinear(nn.Module):
    """A fused projection computed part by part, for parts that cannot share one weight matrix (GGUF blocks of
    different kinds): x (T, K) -> the parts' outputs side by side (T, sum of their N)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def projection(self) -> Projection | None:
        """The parts' operands side by side for the CPU step ops, None where a part has none."""
        parts = [projection_of(part) for part in self.parts]
        return None if None in parts else Projection.side_by_side(parts)


def projection_of(module: nn.Module) -> Projection | None:
    """The operands of a linear computed by the CPU extension's products (tiles or GGUF blocks in host memory: their
    modules' projection()), for the CPU step ops; None for any other."""
    projection = getattr(module, "projection", None)
    return projection() if projection is not None else None


@dataclass(frozen=True)
class LayerOperands:
    """What the CPU step ops read of a decoder layer (DecoderLayer.step_operands): its norms' weights, its projections'
    operands (kernels.step.Projection) and the modules they were read from."""

    modules: tuple[nn.Module | None, ...]  # the layer's linears and norms, whose replacement makes these stale
    attention: "Attention"
    input_norm: torch.Tensor
    input_eps: float
    qkv: Projection
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Projection
    post_norm: torch.Tensor
    post_eps: float
    gate_up: Projection
    down: Projection


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj: nn.Module = Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)  # q, k, v rows
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.output_bias)
        self.scale = cfg.head_dim**-0.5
        self.backend: str | None = None  # kernels.attention_backend's choice; None: the fastest for the tensors
        # Qwen3: each query and key head normalised before RoPE; None elsewhere
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.window = cfg.sliding_window(layer)  # sliding window, None: every earlier key

    def forward(
        self, x: torch.Tensor, rotation: torch.Tensor, cache: KVCache | EagerWrite | LayerwiseWrite | StaticStep
    ) -> torch.Tensor:
        """The attention output (T, C) of x (T, C) at the positions rotation (T, 2, 2, D/2) rotates by, written to
        cache (a fixed-shape step's: StaticStep, which holds what every layer of the step shares)."""
        num_tokens = x.shape[0]
        rotated_heads = self.num_heads + self.num_kv_heads  # queries, then keys
        qkv = self.qkv_proj(x).view(num_tokens, rotated_heads + self.num_kv_heads, self.head_dim).transpose(0, 1)
        qk = qkv[:rotated_heads]  # (Hq + Hkv, T, D)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[: self.num_heads]), self.k_norm(qk[self.num_heads :])])
        qk = rotate(qk, rotation)  # contiguous
        q, k, v = qk[: self.num_heads], qk[self.num_heads :], qkv[rotated_heads:]
        # the window applies by slot where a view holds consecutive positions (the full cache); draft caches
        # approximate it
        window = self.window if cache.slots_are_positions else None
        if cache.static_step:
            keys, values = cache.step_update(self.layer, q, k, v)  # (Hkv, S, D), all slots
            backend = self.backend or attention_backend(x.device, x.dtype)
            first_slot = cache.first_slot(self.layer) if self.window else None
            masked = backend != "flash" or first_slot is not None
            bias = cache.step_bias(self.layer, self.window) if masked else None
            out = attention_in_cache(
                q, keys, values, cache.write_start, self.scale, backend, window, first_slot, bias
            )  # (Hq, T, D) laid out as (T, Hq, D)
        else:
            keys, values = cache.update(self.layer, q, k, v)  # (Hkv, L, D), in the cache's dtype
            segment = segment_keys(cache.slots_are_positions)
            out = attention(q, keys, values, self.scale, self.backend, window, cache.origin, segment)  # (Hq, T, D)
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        gate_up_rows = 2 * cfg.intermediate_size
        self.gate_up_proj: nn.Module = Linear(cfg.hidden_size, gate_up_rows, bias=cfg.mlp_bias)  # gate, up rows
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # step_operands' answer and the modules it was read from; dropped when tensors move or load (_apply,
        # _load_from_state_dict), read anew when a module is replaced
        self._operands: LayerOperands | None = None
        self._operands_of: tuple[nn.Module, ...] = ()

    def _modules_read(self) -> tuple[nn.Module | None, ...]:
        """The linears and norms step_operands reads, looked up in the modules' own tables (a step asks per layer)."""
        layer = self._modules
        attn, mlp = layer["self_attn"]._modules, layer["mlp"]._modules
        return (
            attn["qkv_proj"],
            attn["o_proj"],
            mlp["gate_up_proj"],
            mlp["down_proj"],
            layer["input_layernorm"],
            layer["post_attention_layernorm"],
            attn.get("q_norm"),
            attn.get("k_norm"),
        )

    def step_operands(self) -> LayerOperands | None:
        """The layer's operands for the CPU step ops (kernels.step), or None where they do not compute it: a linear
        outside the extension's products (dense, on another device), a norm weight not float32 on the CPU, or an
        extension without the step ops. Read once and kept while the same modules are in place."""
        modules = self._modules_read()
        if modules != self._operands_of:
            self._operands, self._operands_of = self._read_operands(modules), modules
        return self._operands

    def _read_operands(self, modules: tuple[nn.Module, ...]) -> LayerOperands | None:
        qkv, o_proj, gate_up, down, input_norm, post_norm, q_norm, k_norm = modules
        projections = [projection_of(module) for module in (qkv, o_proj, gate_up, down)]
        norms = [norm.weight for norm in (input_norm, post_norm, q_norm, k_norm) if norm is not None]
        cpu_float32 = all(w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in norms)
        if None in projections or not cpu_float32 or not step_ops_available():
            return None
        return LayerOperands(
            modules,
            self.self_attn,
            input_norm.weight,
            input_norm.eps,
            projections[0],
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            projections[1],
            post_norm.weight,
            post_norm.eps,
            projections[2],
            projections[3],
        )

    def _apply(self, fn, recurse=True):
        self._operands_of = ()
        ModuleChanges.note()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._operands_of = ()
        ModuleChanges.note()
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        cache: KVCache | EagerWrite | LayerwiseWrite | StaticStep,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """The hidden states (T, C) after this layer of x (T, C), whose positions rotate by rotation (T, 2, 2, D/2).

        chunk: None for one forward of the T tokens over a cache prepared for them; else a layerwise write's
        forwards (Transformer.prefill_layerwise) of chunk tokens each, in turn, each one's output written over its
        rows of x, which is returned. Either way the layer is called once, so that its forward hooks run once per
        pass over it (offload/weights.py streams the layer's weights in one).
        """
        if chunk is None:
            on_step_ops = x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()
            operands = self.step_operands() if on_step_ops and not cache.static_step else None
            if operands is not None:
                return self.step_forward(x, rotation, cache, operands)
            x = x + self.self_attn(self.input_layernorm(x), rotation, cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        for first in range(0, x.shape[0], chunk):
            rows = slice(first, first + chunk)
            x[rows] = self.forward(x[rows], rotation[rows], cache)
        return x

    def step_forward(
        self,
        x: torch.Tensor,
        rotation: torch.Tensor,
        cache: KVCache | EagerWrite | LayerwiseWrite,
        operands: LayerOperands,
    ) -> torch.Tensor:
        """forward() of one eager forward on the CPU in float32 through the CPU step ops (kernels.step): the whole
        layer in one call where it writes a cache's storage (EagerWrite) and attends with cache_attention; else the
        layer's first half in one call, the cache's update, attention, the second half in one call."""
        attn = operands.attention
        window = attn.window if cache.slots_are_positions else None
        segment = segment_keys(cache.slots_are_positions)
        if isinstance(cache, EagerWrite) and runs_cache_attention(attn.backend, x, cache.keys):
            x, q = cached_layer(
                x, operands.input_norm, operands.input_eps, operands.qkv, rotation, attn.num_heads,
                attn.num_kv_heads, operands.q_norm, operands.k_norm, cache.keys, cache.values, attn.layer,
                cache.slots.start, cache.first_slots[attn.layer], attn.scale, cache.origin, window, segment,
                operands.o_proj, operands.post_norm, operands.post_eps, operands.gate_up, operands.down,
            )  # fmt: skip
            cache.keep_queries(attn.layer, q)
            return x
        q, k, v = attention_input(
            x, operands.input_norm, operands.input_eps, operands.qkv, rotation, attn.num_heads, attn.num_kv_heads,
            operands.q_norm, operands.k_norm,
        )  # fmt: skip
        keys, values = cache.update(attn.layer, q, k, v)  # (Hkv, L, D)
        out = attention(q, keys, values, attn.scale, attn.backend, window, cache.origin, segment)  # (Hq, T, D)
        return layer_output(
            x, out, operands.o_proj, operands.post_norm, operands.post_eps, operands.gate_up, operands.down
        )


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scale: float, long_inv_freq: torch.Tensor | None = None
    ):
        """inv_freq (D/2,) and rope_scale: rope_frequencies'; long_inv_freq: long_rope_frequencies' for LongRoPE,
        whose inv_freq is then the short set (see fit_rope)."""
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope_scale = rope_scale
        # LongRoPE: both sets of frequencies, fit_rope copying one into inv_freq; rope_factors names the one there
        self.rope_factors: str | None = None
        if long_inv_freq is not None:
            self.register_buffer("short_inv_freq", inv_freq.clone(), persistent=False)
            self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
            self.rope_factors = "short"
        self.output_ids: torch.Tensor | None = None  # see restrict_output
        self.rotations = RotationTable(self.rotary)  # eager forwards' rotations (rotation)
        # the fixed-shape step (use_steps): compute_logits, or its compilation; None: every step eager
        self.fixed_step: Callable[..., torch.Tensor] | None = None
        self.step_graphs = StepGraphs()  # its recordings, per cache and padded length
        # the layers' weights streamed from host memory (offload.offload_weights), or None: all on the device
        self.weight_stream: WeightStream | None = None
        # stacked_layers' stack and the layers' operands it was read from; the operands as last read (None where a
        # layer has none), their attention backends, and ModuleChanges.count then
        self._stack: torch.ScriptObject | None = None
        self._stack_of: tuple[LayerOperands, ...] = ()
        self._operands: tuple[LayerOperands, ...] | None = None
        self._backends: frozenset[str | None] = frozenset()
        # step_head's head, and ModuleChanges.count and output_ids when it was read; step_embedding's operands, and
        # ModuleChanges.count when they were read
        self._head: torch.ScriptObject | None = None
        self._head_of: tuple[int, torch.Tensor | None] | None = None
        self._embedding: list[torch.Tensor | None] | None = None
        self._embedding_read: int | None = None
        self._operands_read: int | None = None
        # one_call's last answer for an eager write, where it was not None, and what it was read under (OneCallKey)
        self._one_call: tuple[OneCallKey, OneCall] | None = None
        # weight_bytes_read's count and ModuleChanges.count when it was made
        self._weight_bytes: int = 0
        self._weights_counted: int | None = None

    @property
    def device(self) -> torch.device:
        """Where the model computes (its rotary frequencies' device; streamed layers' weights visit it)."""
        return self.inv_freq.device

    def restrict_output(self, output_ids: torch.Tensor) -> None:
        """Compute logits for output_ids (V',) only; every other token gets -inf, so probability 0.

        A drafter's output layer over the most frequent tokens costs V'/V of the full one (FR-Spec, Zhao et al.,
        2025, arXiv 2502.14856). Speculative sampling stays exact: tokens it never proposes are left to the
        residual distribution of the tier above.
        """
        rows = self.lm_head.weight[output_ids].detach().clone()
        self.lm_head = Linear(
            self.config.hidden_size, len(output_ids), bias=False, device=rows.device, dtype=rows.dtype
        )
        self.lm_head.weight = nn.Parameter(rows, requires_grad=False)
        self.output_ids = output_ids.to(rows.device)

    def load_hf_state(self, state: dict[str, torch.Tensor], assign: bool = False) -> tuple[list[str], list[str]]:
        """Load a state dict with Hugging Face's names (fused in place by fuse_checkpoint), not strictly; return the
        missing and the unexpected keys as load_state_dict does, a missing fused projection named by its parts
        absent from state.

        assign: take state's tensors as the parameters, as load_state_dict(assign=True) does.
        """
        missing, unexpected = self.load_state_dict(fuse_checkpoint(state, self.config), strict=False, assign=assign)
        absent = []
        for key in missing:
            module, _, param = key.rpartition(".")
            parts = [f"{part}.{param}" for part, _ in checkpoint_parts(module, self.config)] or [key]
            absent += [name for name in parts if name not in state]
        return absent, unexpected

    @classmethod
    def from_hf_config(cls, hf: PretrainedConfig) -> "Transformer":
        cfg = ModelConfig.from_hf(hf)
        inv_freq, rope_scale = rope_frequencies(hf, cfg.head_dim)
        return cls(cfg, inv_freq, rope_scale, long_rope_frequencies(hf))

    def rope_factors_for(self, context_length: int) -> str | None:
        """The LongRoPE set ('short' or 'long') fit_rope(context_length) chooses; None for other RoPE variants."""
        if self.rope_factors is None:
            return None
        return "long" if context_length > self.config.rope["original_max_position_embeddings"] else "short"

    def fit_rope(self, context_length: int) -> None:
        """Rotate every forward from now on with the RoPE frequencies for a generation of up to context_length
        positions (prompt and new tokens); a no-op but for LongRoPE (Phi-3).

        LongRoPE's long set where context_length exceeds original_max_position_embeddings, else its short set. This
        is transformers' rule for a forward of the whole sequence, but chosen once per generation instead of per
        forward (transformers takes the last position of each forward, dynamic_rope_update): the logits of a
        forward verifying several tokens then equal those of single steps, so every mode is token-for-token the
        autoregressive one. The set is copied into inv_freq, whose address compiled steps and CUDA graphs hold.
        """
        chosen = self.rope_factors_for(context_length)
        if chosen is not None and chosen != self.rope_factors:
            with torch.no_grad():
                self.inv_freq.copy_(self.long_inv_freq if chosen == "long" else self.short_inv_freq)
            self.rope_factors = chosen

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rotation (T, 2, 2, D/2) = [[cos, -sin], [sin, cos]] of positions (T,), as rotate() takes it."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        cos, sin = freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale
        rotation = torch.stack((cos, -sin, sin, cos), dim=1).unflatten(1, (2, 2))  # (T, 2, 2, D/2)
        return rotation.to(dtype)

    def rotation(self, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """rotary's rotation (count, 2, 2, D/2) of positions [start, start + count), read from its table of
        blocks (runtime.rotations): what an eager forward rotates with."""
        return self.rotations.rotation(start, count, dtype, self.inv_freq)

    def use_attention(self, backend: str) -> None:
        """Compute attention with one kernel family ('flash', 'sdpa' or 'cpu', see kernels.attention_backend)."""
        for layer in self.model.layers:
            layer.self_attn.backend = backend
        ModuleChanges.note()

    @property
    def attention_backend(self) -> str:
        """The kernel family attention runs on: as set by use_attention, else the fastest for the weights."""
        dtype = self.model.norm.weight.dtype  # a parameter in every weight form
        return self.model.layers[0].self_attn.backend or attention_backend(self.device, dtype)

    @property
    def step_mode(self) -> StepMode:
        """How decode steps on caches made static run (use_steps)."""
        if self.fixed_step is None:
            return StepMode.EAGER
        return StepMode.GRAPHS if self.fixed_step == self.compute_logits else StepMode.COMPILED

    def use_steps(self, mode: StepMode, backend: str = "inductor") -> None:
        """Run decode steps on caches made static (KVCache.make_static) as mode says: 'eager' as any forward,
        'graphs' as fixed-shape steps recorded once per cache and padded length (CUDA graphs, runtime/graphs.py),
        'compiled' as those steps compiled by torch.compile first (compile_steps).

        backend: torch.compile's backend for 'compiled'.
        """
        if mode == StepMode.COMPILED:
            self.compile_steps(backend)
            return
        self.step_graphs = StepGraphs()
        self.fixed_step = self.compute_logits if mode == StepMode.GRAPHS else None

    def compile_steps(self, backend: str = "inductor") -> None:
        """Run decode steps on caches made static as fixed-shape steps compiled by torch.compile (fullgraph, static
        shapes), each recorded once per cache and padded length (use_steps' 'compiled'). Inductor keeps what it
        compiles on disk (runtime.store.keep_compiled_steps), for later processes.

        backend: torch.compile's backend ("aot_eager" traces the same graphs without generating code).
        """
        # one graph per padded length (log2 of MAX_STEP_TOKENS + 1 at most) per cache kind, for every compiled
        # model, all of them recompilations of compute_logits, whose default limit is 8
        graphs = (MAX_STEP_TOKENS.bit_length() + 1) * 3 * 2
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)
        self.step_graphs = StepGraphs()
        self.fixed_step = torch.compile(self.compute_logits, fullgraph=True, dynamic=False, backend=backend)

    def forward(
        self, tokens: torch.Tensor, start: int, cache: KVCache, num_logits: int | None = None, decoding: bool = True
    ) -> torch.Tensor:
        """Logits (num_logits or T, V) for tokens (T,) at positions [start, start + T), writing them to cache.

        decoding: False for a prefill chunk, which always runs eager (one recorded step serves no two prompts).
        A fixed-shape step longer than the cache's longest recorded one (StepGraphs.limit) runs eager too.
        """
        num_tokens = tokens.shape[0]
        keep = num_logits or num_tokens
        if decoding and self.fixed_step is not None and cache.write_start is not None:
            padded = padded_length(num_tokens)
            longest = self.step_graphs.longest(cache, MAX_STEP_TOKENS)
            if padded <= min(MAX_STEP_TOKENS, longest, cache.max_write or padded):
                return self._fixed_shape_step(tokens, start, cache, keep, padded)
        if torch.is_inference_mode_enabled():  # entering it again costs ~50 us once a step has emptied the caches
            return self._eager_forward(tokens, start, cache, keep)
        with torch.inference_mode():
            return self._eager_forward(tokens, start, cache, keep)

    def _eager_forward(self, tokens: torch.Tensor, start: int, cache: KVCache, keep: int) -> torch.Tensor:
        """forward()'s logits (keep, V) from an eager forward of tokens (T,)."""
        cache.prepare(start, tokens.shape[0])
        return self.compute_logits(tokens, start, cache, keep)

    def _fixed_shape_step(
        self, tokens: torch.Tensor, start: int, cache: KVCache, keep: int, padded: int
    ) -> torch.Tensor:
        """forward()'s logits (keep, V) from its fixed-shape step of tokens (T,) padded to `padded` rows."""
        num_tokens = tokens.shape[0]
        cache.prepare(start, num_tokens, padding=padded - num_tokens)
        tokens = F.pad(tokens, (0, padded - num_tokens))  # padding rows: token 0, written past cache.length
        positions = torch.arange(start, start + padded, device=tokens.device)
        # an offloaded cache's step, with its copies and events, is recorded eager (runtime/graphs.py)
        step = self.compute_logits if isinstance(cache, FullCache) and cache.stream is not None else self.fixed_step
        slots = cache.step_slots(start + padded)
        logits = self.step_graphs.run(step, tokens, positions, cache, slots)
        # a copy: a recorded step's outputs are overwritten by its next replay
        return logits[num_tokens - keep : num_tokens].clone()

    def compute_logits(
        self, tokens: torch.Tensor, positions: torch.Tensor | int, cache: KVCache, num_logits: int | None = None
    ) -> torch.Tensor:
        """Logits (num_logits or T, V) for tokens (T,) at their positions, on a cache prepared for them.

        The step forward() runs, eager or recorded; a fixed-shape step (the cache prepared with padding) compiles
        with fullgraph=True, without a graph break, once for every position, and records as one CUDA graph.

        Args:
            positions: (T,) on the device (a fixed-shape step computes their rotation), or the first of T
                consecutive positions (an eager forward reads theirs from the table: rotation).
        """
        if cache.static_step:  # what every layer of a fixed-shape step shares, built once on the device
            step = cache.begin_step(tokens.shape[0], self.config.num_heads // self.config.num_kv_heads)
        else:  # an eager forward's write, read once for every layer where the cache's storage takes it
            step = cache.eager_write() or cache
            one_call = self.one_call(tokens, step) if isinstance(positions, int) else None
            if one_call is not None:
                return self.run_one_call(one_call, tokens, positions, step, num_logits)
        x = self.model.embed_tokens(tokens)  # (T, C)
        if isinstance(positions, int):
            rotation = self.rotation(positions, tokens.shape[0], x.dtype)
        else:
            rotation = self.rotary(positions, x.dtype)
        stack = None if cache.static_step else self.stacked_layers(x, step)
        if stack is not None:
            x = self.run_stack(stack, x, rotation, step)
        else:
            for layer in self.model.layers:
                x = layer(x, rotation, step)
        if cache.static_step:
            step.finish()
        if num_logits is not None and num_logits < x.shape[0]:
            x = x[-num_logits:]
        return self.output(x)

    def stacked_layers(self, x: torch.Tensor, step: KVCache | EagerWrite) -> torch.ScriptObject | None:
        """The layers as one call (kernels.step.cached_layers) for an eager forward of x (T, C) writing step, where
        each layer would run cached_layer (DecoderLayer.step_forward) and none has hooks (a streamed layer's weights
        arrive in its hooks); else None. Read from the layers' operands once, and again when those change."""
        if isinstance(x, FakeTensor) or x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        return self._layer_stack(step)

    def _layer_stack(self, step: KVCache | EagerWrite) -> torch.ScriptObject | None:
        """stacked_layers' stack for float32 rows on the CPU."""
        if not isinstance(step, EagerWrite) or torch.is_grad_enabled():
            return None
        layers = self.model.layers
        if self._operands_read != ModuleChanges.count:
            operands = tuple(layer.step_operands() for layer in layers)
            if None in operands:
                self._operands = None
            else:
                same = len(operands) == len(self._stack_of) and all(map(operator.is_, operands, self._stack_of))
                self._operands = self._stack_of if same else operands
            self._backends = frozenset(o.attention.backend for o in self._operands or ())
            self._operands_read = ModuleChanges.count
        operands = self._operands
        if operands is None or any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers):
            return None
        if not all(runs_cache_attention(b, FLOAT32_ROWS, step.keys) for b in self._backends):
            return None
        if operands is not self._stack_of:
            self._stack, self._stack_of = self._build_stack(operands), operands
        return self._stack

    @staticmethod
    def _build_stack(operands: tuple[LayerOperands, ...]) -> torch.ScriptObject:
        stack = layer_stack()
        for o in operands:
            attn = o.attention
            stack_layer(
                stack, norm_weight=o.input_norm, eps=o.input_eps, qkv=o.qkv, q_heads=attn.num_heads,
                kv_heads=attn.num_kv_heads, q_norm=o.q_norm, k_norm=o.k_norm, layer=attn.layer, scale=attn.scale,
                window=attn.window, o_proj=o.o_proj, post_norm=o.post_norm, post_eps=o.post_eps, gate_up=o.gate_up,
                down=o.down,
            )  # fmt: skip
        return stack

    def run_stack(
        self, stack: torch.ScriptObject, x: torch.Tensor, rotation: torch.Tensor, step: EagerWrite
    ) -> torch.Tensor:
        """The last layer's output (T, C) of stacked_layers' stack over x (T, C); the layers' queries kept where the
        cache keeps them, as each layer's own call keeps them."""
        x, queries = cached_layers(stack, x, rotation, stack_write(step))
        self._keep_stack_queries(step, queries)
        return x

    def _keep_stack_queries(self, step: EagerWrite, queries: list[torch.Tensor]) -> None:
        """The stack's layers' queries (Hq, T, D), in its order, kept where the cache keeps them."""
        for o, q in zip(self._stack_of, queries):
            step.keep_queries(o.attention.layer, q)

    def one_call(self, tokens: torch.Tensor, step: KVCache | EagerWrite) -> OneCall | None:
        """What an eager forward of tokens (T,) writing step needs to run in one call from ids to logits
        (kernels.step.cached_step): the layers' stack (stacked_layers'), the embedding's operands (step_embedding)
        and the output layer's head (step_head), where each runs in the extension; else None.

        Asked before every decode step, so an answer for an eager write is kept with what it depends on besides the
        tokens (OneCallKey) and read again only when that changes: looking it up anew takes ~100 us once a step has
        emptied the CPU's caches, a drafter step's twentieth."""
        if isinstance(tokens, FakeTensor) or tokens.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        if not isinstance(step, EagerWrite) or torch.is_grad_enabled():
            return None
        key = OneCallKey(
            ModuleChanges.count, RemovableHandle.next_id, self.output_ids, step.keys.dtype, step.keys.device
        )
        kept = self._one_call
        if kept is not None and kept[0].holds(key):
            return kept[1]
        embedding, head = self.step_embedding(), self.step_head()
        stack = None if embedding is None or head is None else self._layer_stack(step)
        answer = None if stack is None else OneCall(stack, embedding, head)
        self._one_call = None if answer is None else (key, answer)  # a refusal is asked again (a hook removed)
        return answer

    def run_one_call(
        self,
        one_call: OneCall,
        tokens: torch.Tensor,
        start: int,
        step: EagerWrite,
        num_logits: int | None,
    ) -> torch.Tensor:
        """The logits (num_logits or T, V) of one_call's step over tokens (T,) from position start; the layers'
        queries kept where the cache keeps them."""
        stack, embedding, head = one_call
        rotation = self.rotation(start, tokens.shape[0], torch.float32)
        keep = num_logits or tokens.shape[0]
        logits, queries = cached_step(stack, embedding, head, tokens, rotation, stack_write(step), keep)
        self._keep_stack_queries(step, queries)
        return logits

    def weight_bytes_read(self) -> int:
        """Bytes of the weights every forward reads (the layers, the final norm, the output layer: weight_bytes),
        counted again only after a module change (ModuleChanges): the costed policy prices a dozen forwards before
        each generation's first token, and each count walks every parameter."""
        if self._weights_counted != ModuleChanges.count:
            self._weight_bytes = weight_bytes(self.model.layers, self.model.norm, self.lm_head)
            self._weights_counted = ModuleChanges.count
        return self._weight_bytes

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """model.norm of the last layer's hidden states x (N, C): on the CPU in float32 by the step ops' RMSNorm, as
        every layer's norms there (one order of arithmetic for any N, and no torch op to bring back into the CPU's
        caches after a step has streamed its weights through them), else by the module."""
        norm = self.model.norm
        on_step_ops = x.device.type == "cpu" and x.dtype == norm.weight.dtype == torch.float32
        if on_step_ops and not torch.is_grad_enabled() and step_ops_available():
            return rms_norm(x, norm.weight, norm.eps)
        return norm(x)

    def step_head(self) -> torch.ScriptObject | None:
        """The output layer as one call (kernels.step.output_logits) for float32 hidden states on the CPU, where the
        step ops compute it (a float32 norm on the CPU, the output layer in the extension's products); else None.
        Read once, and again after a module change or restrict_output."""
        if self._head_of is None or self._head_of[0] != ModuleChanges.count or self._head_of[1] is not self.output_ids:
            norm, projection = self.model.norm, projection_of(self.lm_head)
            usable = projection is not None and step_ops_available() and norm.weight.dtype == torch.float32
            usable = usable and norm.weight.device.type == "cpu" and norm.weight.is_contiguous()
            self._head = None
            if usable:
                self._head = output_head(norm.weight, norm.eps, projection, self.output_ids, self.config.vocab_size)
            self._head_of = (ModuleChanges.count, self.output_ids)
        return self._head

    def step_embedding(self) -> list[torch.Tensor | None] | None:
        """The token embedding's table as kernels.step.cached_step reads it (its module's step_operands; a plain
        float32 table on the CPU: it, None, None), or None where the extension does not look it up. Read once, and
        again after a module change."""
        if self._embedding_read != ModuleChanges.count:
            module = self.model.embed_tokens
            operands = getattr(module, "step_operands", None)
            if operands is not None:
                self._embedding = operands()
            elif isinstance(module, nn.Embedding) and module.max_norm is None:
                table = module.weight
                on_cpu = table.device.type == "cpu" and table.dtype == torch.float32 and table.is_contiguous()
                self._embedding = [table, None, None] if on_cpu else None
            else:
                self._embedding = None
            self._embedding_read = ModuleChanges.count
        return self._embedding

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (N, V) of the last layer's hidden states x (N, C): -inf outside restrict_output's tokens."""
        on_step_ops = x.device.type == "cpu" and x.dtype == torch.float32 and not isinstance(x, FakeTensor)
        # a compiled step (use_steps) traces the modules
        on_step_ops = on_step_ops and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        head = self.step_head() if on_step_ops else None
        if head is not None:
            return output_logits(head, x)
        logits = self.lm_head(self.final_norm(x)).float()  # (N, V) or (N, V')
        if self.output_ids is None:
            return logits
        return spread_over_vocabulary(logits, self.output_ids, self.config.vocab_size)

    def prefill_layerwise(
        self,
        tokens: torch.Tensor,
        start: int,
        cache: FullCache,
        chunk: int,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits after the last of tokens at positions [start, start + T), written to cache layer by layer: each
        layer runs every chunk of the tokens before the next layer runs any (cache.full.LayerwiseWrite).

        Each (layer, chunk) is the forward that forward() runs for that chunk, with the same shapes and inputs: the
        chunk's rows of the embedding, the rotary rotation of its own positions, and keys and values (Hkv, L, D)
        with the cache's strides. So the keys, values and logits are those of forward() chunk by chunk, bit for
        bit wherever the same kernels run on the same shapes (the CPU's, and CUDA's fixed-algorithm ones).

        What this holds on the device besides one forward's activations (prefill_layerwise_bytes): the hidden
        states of all T tokens between layers, (T, hidden_size) in the model's dtype, and their rotation, cos and sin
        of (T, head_dim) each: for 128K tokens of Llama-3.1-8B in bfloat16, 128K x 4096 x 2 bytes = 1 GiB and
        2 x 128K x 128 x 2 bytes = 64 MiB. A prompt whose share does not fit is run in segments, one call each
        (decoding.prefill.prefill): each call fetches the positions before its start once per offloaded layer.

        Args:
            tokens: (T,) token ids on the model's device.
            start: the position of the first; cache holds [0, start) already.
            cache: the full cache, on the device or offloaded (offload.offload_kv).
            chunk: tokens per forward of a layer.
            on_layer: called with the number of layers done, after each.
        Returns:
            Float32 logits (1, V) after the last token.
        """
        num_tokens = tokens.shape[0]
        with torch.inference_mode():
            x = self.model.embed_tokens(tokens)  # (T, C)
            rotation = self.rotation(start, num_tokens, x.dtype)  # (T, 2, 2, D/2), as forward() reads it
            write = LayerwiseWrite(cache, start, num_tokens)
            for index, layer in enumerate(self.model.layers):
                write.begin_layer(index)
                x = layer(x, rotation, write, chunk)
                write.end_layer()
                if on_layer is not None:
                    on_layer(index + 1)
            return self.output(x[-1:])

    def prefill_layerwise_bytes(self, num_tokens: int) -> int:
        """Device bytes prefill_layerwise holds for num_tokens besides one forward's: their hidden states (T, C) and
        rotation (T, 2, 2, D/2: cos and sin, (T, D) each), in the model's dtype."""
        cfg = self.config
        return num_tokens * (cfg.hidden_size + 2 * cfg.head_dim) * self.model.norm.weight.element_size()


def weight_bytes(*models: nn.Module) -> int:
    """Bytes of the models' weights, parameters and buffers (packed weights' tiles and blocks), each tensor counted
    once (a drafter may share the target's embedding)."""
    tensors = {t.data_ptr(): t.nbytes for m in models for t in (*m.parameters(), *m.buffers())}
    return sum(tensors.values())


def dense_rows(weight: torch.Tensor) -> Linear:
    """A bias-free Linear holding weight (N, K), without initialising it first."""
    rows = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    rows.weight = nn.Parameter(weight, requires_grad=False)
    return rows


def replace_checkpoint_linears(
    model: Transformer,
    replacements: dict[str, nn.Module],
    combine: Callable[[list[nn.Module]], nn.Module] = ConcatLinear,
) -> int:
    """Compute the checkpoint's linears named in replacements (module path in Hugging Face's names -> a module
    computing x @ weight.T) by those modules; return how many were used.

    Only bias-free linears are replaced. A fused projection with all its parts among them becomes combine(parts);
    with some, a ConcatLinear of its parts, each part not among them keeping its own rows of the fused weight.
    """
    used = 0
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        parts = checkpoint_parts(path, model.config) or ((path, module.out_features),)
        found = [replacements.get(part) for part, _ in parts]
        if all(part is None for part in found):
            continue
        if len(parts) == 1:
            model.set_submodule(path, found[0])
        elif all(part is not None for part in found):
            model.set_submodule(path, combine(found))
        else:
            rows = module.weight.detach().split([n for _, n in parts])
            computed = [part if part is not None else dense_rows(w.clone()) for part, w in zip(found, rows)]
            model.set_submodule(path, ConcatLinear(computed))
        used += sum(part is not None for part in found)
    return used
