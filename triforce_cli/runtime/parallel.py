"""Tensor parallelism over torch.distributed (launched by torchrun), as a transform of a built model.

``apply_tp(model)`` shards each decoder layer gpt-fast style across the ranks of the default process group: the
fused q/k/v and gate/up projections by output rows (each rank keeps its query and KV heads, and its share of the
MLP), the output and down projections by input columns, each followed by one all-reduce. The embedding, the norms
and the vocabulary projection stay whole, so every rank computes the full logits and, with the same seed, samples
the same tokens: no rank drifts. The model's config then counts the rank's own heads, so every cache built for it
(full, retrieval, offloaded) holds only those; retrieval scoring works per KV head and needs no communication.
NCCL on CUDA, gloo on the CPU (``init_parallel``). The loader applies it while the weights are still in host memory
(loading.transform_model), so that each rank's device receives its shard only.

The all-reduces are functional collectives (torch.distributed._functional_collectives), which torch.compile traces
into the step's graph: a sharded decode step compiles with fullgraph=True, and on NCCL is captured as a CUDA graph.

The ranks must take every decision together: one that goes its own way runs other collectives, or collectives of
other shapes, and the rest wait in theirs forever. Tokens and verification outcomes are rank 0's (from_rank_zero),
the seed is rank 0's (shared_seed), and whatever a rank reads of its own state, such as its free memory, is
replaced by the least any rank read (least) before anything is decided on it.
"""

import atexit
import os
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from triforce_cli.errors import ConfigError
from triforce_cli.runtime.model import Linear, Transformer


def launch_rank() -> int:
    """This process's rank as torchrun set it (0 without torchrun), known before the process group is joined."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def pending_group() -> tuple[int, int | None]:
    """The processes this one computes among, and, where torchrun started it and it has yet to join their group
    (init_parallel), the GPU index torchrun gave it (LOCAL_RANK); None where it joins nothing."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched <= 1 or dist.is_initialized():
        return world_size(), None
    return launched, int(os.environ.get("LOCAL_RANK", "0"))


def init_parallel(device: torch.device) -> torch.device:
    """Join torchrun's process group where torchrun started this process (WORLD_SIZE > 1); return the device this
    rank computes on (cuda:LOCAL_RANK on a GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # left to interpreter shutdown, gloo's threads may still run and abort the process after its work is done
    atexit.register(dist.destroy_process_group)
    return device


def shared_seed(seed: int, device: torch.device) -> int:
    """Rank 0's seed on every rank, so that all draw the same random numbers. device: the model's, where the
    broadcast's tensor must live (NCCL carries only CUDA tensors)."""
    if world_size() == 1:
        return seed
    value = torch.tensor([seed % (1 << 63)], dtype=torch.long, device=device)
    dist.broadcast(value, src=0)
    return int(value)


def from_rank_zero(tokens: torch.Tensor) -> torch.Tensor:
    """Rank 0's copy of tokens (or of a verification's outcome) on every rank, in place, on their device. Ranks
    compute the same logits only up to rounding (their all-reduces may sum in another order), and a token drawn
    or accepted differently on one rank would send it down another path until a collective hangs: every rank takes
    rank 0's choices."""
    if world_size() > 1:
        dist.broadcast(tokens, src=0)
    return tokens


# least's stand-in for a rank that knows no bound (None): above any byte count a machine has
_UNBOUNDED = 1 << 62


def least(value: int | None, device: torch.device) -> int | None:
    """The least of every rank's value, on every rank: what a decision on a quantity that each rank reads of its
    own state (the free memory of its device or its host) must be taken on, so that every rank takes the same.

    Args:
        value: this rank's reading; None: no bound known here (a rank that knows one bounds them all).
        device: the model's, where the all-reduce's tensor must live (NCCL carries only CUDA tensors).
    Returns:
        The minimum over the ranks; None where no rank knows a bound. value itself in a single process.
    """
    if world_size() == 1:
        return value
    reading = torch.tensor([_UNBOUNDED if value is None else value], dtype=torch.long, device=device)
    dist.all_reduce(reading, op=dist.ReduceOp.MIN)
    agreed = int(reading)
    return None if agreed == _UNBOUNDED else agreed


class AllReduce(nn.Module):
    """A row-parallel projection: each rank's partial product (its input columns), summed over the ranks by a
    functional all-reduce, which a compiled step traces into its graph (eager, it waits on first use)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.inner(x), "sum", dist.group.WORLD)


def _rows(weight: torch.Tensor, parts: list[int], shard: int, shards: int) -> torch.Tensor:
    """The rank's share of each part of a fused projection's rows (or of a bias), concatenated."""
    pieces = weight.split(parts)
    return torch.cat([piece.chunk(shards)[shard] for piece in pieces])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


def apply_tp(model: Transformer) -> None:
    """Shard model across the default process group (module docstring); a ConfigError where its heads do not
    divide by the world size or its weights are not dense."""
    shards, shard = world_size(), rank()
    if shards == 1:
        return
    cfg = model.config
    if cfg.num_kv_heads % shards or cfg.num_heads % shards or cfg.intermediate_size % shards:
        raise ConfigError(
            f"{cfg.num_kv_heads} KV heads, {cfg.num_heads} query heads and {cfg.intermediate_size} MLP rows must"
            f" all divide by the {shards} processes: launch torchrun with a --nproc-per-node that divides them"
        )
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if not all(
            isinstance(m, Linear) for m in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ):
            raise ConfigError("tensor parallelism shards dense weights: use `weights` dense")
        qkv = attention.qkv_proj
        parts = [q_rows, kv_rows, kv_rows]
        attention.qkv_proj = _linear(
            _rows(qkv.weight, parts, shard, shards), None if qkv.bias is None else _rows(qkv.bias, parts, shard, shards)
        )
        out = attention.o_proj
        attention.o_proj = AllReduce(
            _linear(out.weight.chunk(shards, dim=1)[shard], out.bias if shard == 0 else None)  # bias added once
        )
        gate_up = mlp.gate_up_proj
        parts = [cfg.intermediate_size, cfg.intermediate_size]
        mlp.gate_up_proj = _linear(
            _rows(gate_up.weight, parts, shard, shards),
            None if gate_up.bias is None else _rows(gate_up.bias, parts, shard, shards),
        )
        down = mlp.down_proj
        mlp.down_proj = AllReduce(_linear(down.weight.chunk(shards, dim=1)[shard], down.bias if shard == 0 else None))
        attention.num_heads //= shards
        attention.num_kv_heads //= shards
    model.config = replace(
        cfg,
        num_heads=cfg.num_heads // shards,
        num_kv_heads=cfg.num_kv_heads // shards,
        intermediate_size=cfg.intermediate_size // shards,
    )
