"""GGUF weights: the target's linears and embedding computed from the GGUF file's own blocks (Q4_0, Q4_1, Q8_0,
Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K; kernels.gguf.BLOCK_KINDS).

On a CPU a decode step reads every weight once, so reading 6 to 10 bits per weight instead of 16 or 32 is most
of the step. A file may mix types tensor by tensor (a Q4_K_M file holds Q4_K, Q6_K and, for rows whose width is not
a multiple of 256, Q5_0 tensors); each tensor keeps its own. A tensor of another type (Q2_K, Q3_K, an IQ type, float16)
is dequantized to float32 by the loader, and load_model says which (weight_types). The values are the checkpoint's (the dense path dequantizes the same blocks); only float32 rounding
differs (kernels.gguf). transformers supplies the GGUF-to-HF name map and the row order
of the q/k projections (llama.cpp permutes their rows for its rotary layout). The runtime fuses the q/k/v and the
gate/up projections into one linear each; their blocks are stacked the same way, a tile of 16 rows at a time.
A tied embedding is one set of blocks serving both the token lookup and the output layer.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from triforce_cli.kernels.gguf import (
    BLOCK_KINDS,
    LANES,
    PackedBlocks,
    blocks_linear,
    blocks_rows,
    dequantize,
    pack_blocks,
)
from triforce_cli.kernels.step import Projection
from triforce_cli.runtime.model import ConcatLinear, ModuleChanges, Transformer, replace_checkpoint_linears
from triforce_cli.runtime.store import content_identity, write_atomically

BLOCKS_FILE = "gguf-blocks/blocks.safetensors"  # in a converted checkpoint's folder: its packed blocks
BLOCKS_LAYOUT = "records-of-16/3"  # kernels.gguf's layout; a kept copy in another is read anew
TYPES_FILE = "gguf-blocks/types.json"  # in a converted checkpoint's folder: the file's weight types, counted
CACHE_LINE = 64  # bytes: a block's record is whole lines of it


class GGUFLinear(nn.Module):
    """A bias-free linear whose weight lives as packed GGUF blocks. x (T, K) float32 -> (T, N)."""

    def __init__(self, packed: PackedBlocks):
        super().__init__()
        self.out_features, self.in_features = packed.out_features, packed.in_features
        self.four_bit, self.groups, self.minimums = packed.four_bit, packed.groups, packed.minimums
        self.register_buffer("records", packed.records)
        self._packed: PackedBlocks | None = None  # packed's, for the records in place

    @property
    def packed(self) -> PackedBlocks:
        """The blocks as kernels.gguf takes them, made once for the records in place (with its operands' views)."""
        records = self._buffers["records"]
        if self._packed is None or self._packed.records is not records:
            self._packed = PackedBlocks(records, self.four_bit, self.groups, self.minimums, self.out_features)
        return self._packed

    def _apply(self, fn, recurse=True):
        self._packed = None  # views of the records as they were: not kept alive past a move
        ModuleChanges.note()  # nor by a model's embedding read for its one-call step (Transformer.step_embedding)
        return super()._apply(fn, recurse)

    @property
    def weight(self) -> torch.Tensor:
        """The float32 (N, K) weight the blocks hold."""
        return dequantize(self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blocks_linear(x, self.packed)

    def projection(self) -> Projection | None:
        """The blocks as the CPU step ops take them (kernels.step), None off the CPU."""
        if self.records.device.type != "cpu":
            return None
        return Projection(self.packed.operands(), [self.out_features])


class GGUFEmbedding(nn.Module):
    """A token embedding read from packed GGUF blocks: ids (T,) -> (T, C) float32, the same values dequantize
    gives."""

    def __init__(self, blocks: GGUFLinear):
        super().__init__()
        self.blocks = blocks

    @property
    def weight(self) -> torch.Tensor:
        return self.blocks.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return blocks_rows(self.blocks.packed, ids)

    def step_operands(self) -> list[torch.Tensor | None] | None:
        """The blocks' q, d and m as kernels.step.cached_step looks rows up in them, None off the CPU."""
        projection = self.blocks.projection()
        return None if projection is None else projection.operands


def stack(parts: list[GGUFLinear]) -> nn.Module:
    """One linear computing parts side by side: their tiles stacked where each part has whole tiles of rows and the
    same kind of blocks, else a ConcatLinear of them."""
    forms = {part.packed.form for part in parts}
    if len(forms) > 1 or any(part.out_features % LANES for part in parts):
        return ConcatLinear(parts)
    first = parts[0].packed
    records = torch.cat([part.records for part in parts])
    return GGUFLinear(
        PackedBlocks(records, first.four_bit, first.groups, first.minimums, sum(part.out_features for part in parts))
    )


def read_gguf_blocks(gguf: Path, hf_config: PretrainedConfig) -> dict[str, PackedBlocks]:
    """The weights the file stores in a type kept packed (BLOCK_KINDS), packed, by Hugging Face parameter name
    without '.weight' (such as model.layers.0.mlp.up_proj or model.embed_tokens)."""
    from gguf import GGUFReader  # imported here: only a .gguf checkpoint needs the package

    reader = GGUFReader(str(gguf))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(hf_config.model_type, TensorProcessor)(config=hf_config.to_dict())
    hf_names = get_gguf_hf_weights_map(skeleton, processor)
    found = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_KINDS or tensor.name not in hf_names:
            continue
        raw = torch.from_numpy(np.array(tensor.data))  # (N, K/32 * block bytes) uint8, rows in GGUF order
        row_order = processor.process(np.arange(raw.shape[0])[:, None], tensor.name).weights[:, 0]
        packed = pack_blocks(raw[torch.from_numpy(row_order)], tensor.tensor_type.name)
        found[hf_names[tensor.name].removesuffix(".weight")] = packed
    return found


def kept_blocks(records: torch.Tensor, rows: int, four_bit: bool, groups: int, minimums: bool) -> PackedBlocks:
    """PackedBlocks from a kept copy's records and form; a ValueError where the records cannot be of that form. A
    file's tensors lie where its header ends, seldom on a 64-byte boundary: copied to one, so that every record is
    whole cache lines as pack_blocks lays them out."""
    if records.data_ptr() % CACHE_LINE:
        records = records.clone()
    packed = PackedBlocks(records, four_bit, groups, minimums, rows)
    if records.dim() != 3 or records.shape[2] != packed.record_bytes:
        raise ValueError(f"records of {tuple(records.shape)} bytes are not blocks of their form")
    return packed


def gguf_blocks(gguf: Path, hf_config: PretrainedConfig, folder: Path) -> dict[str, PackedBlocks]:
    """read_gguf_blocks, kept in folder (the checkpoint's converted folder) after the first time: reading the file's
    metadata and name map takes seconds. The copy is used only while the GGUF file's content (store.content_identity:
    copies of one file installed in several places share the converted folder) and the packed layout are those it
    was written with."""
    stored = folder / BLOCKS_FILE
    source = f"{BLOCKS_LAYOUT}|{content_identity(gguf)}"
    if stored.is_file():
        try:
            with safe_open(stored, framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get("source") == source:
                    return {
                        name: kept_blocks(handle.get_tensor(name), *form)
                        for name, form in json.loads(metadata["forms"]).items()
                    }
        except (OSError, SafetensorError, KeyError, ValueError, TypeError):
            pass  # unreadable: written anew below
    found = read_gguf_blocks(gguf, hf_config)
    tensors = {name: p.records for name, p in found.items()}
    forms = json.dumps({name: (p.out_features, p.four_bit, p.groups, p.minimums) for name, p in found.items()})
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(
            stored, lambda partial: save_file(tensors, partial, metadata={"source": source, "forms": forms})
        )
    except OSError:
        pass  # a read-only cache: read the file again next time
    return found


def use_gguf_weights(model: Transformer, gguf: Path, hf_config: PretrainedConfig, folder: Path) -> int:
    """Compute every bias-free linear (and the embedding) the file stores in blocks from those blocks; return how
    many checkpoint weights that is. folder: the checkpoint's converted folder, where the packed blocks are kept."""
    return apply_gguf_blocks(model, gguf_blocks(gguf, hf_config, folder))


def apply_gguf_blocks(model: Transformer, blocks: dict[str, PackedBlocks]) -> int:
    """Replace the model's linears (and embedding) named in blocks (Hugging Face names without '.weight') by
    modules computing from them, fused projections stacked; return how many checkpoint weights were replaced."""
    linears = {name: GGUFLinear(packed) for name, packed in blocks.items()}
    embedding = linears.pop("model.embed_tokens", None)
    used = replace_checkpoint_linears(model, linears, combine=stack)
    if embedding is not None:
        model.model.embed_tokens = GGUFEmbedding(embedding)
        if model.config.tie_word_embeddings and model.output_ids is None:
            model.lm_head = embedding
        used += 1
    return used


def weight_types(gguf: Path, folder: Path) -> dict[str, int]:
    """How many of the file's weight matrices (tensors of two or more dimensions) each GGUF type holds, such as
    {'Q5_0': 166, 'Q4_K': 16, 'Q6_K': 14, 'Q8_0': 15}, most first; kept in folder (the converted checkpoint's)
    after the first time, while the file's content is the same."""
    stored = folder / TYPES_FILE
    source = content_identity(gguf)
    try:
        kept = json.loads(stored.read_text())
        if kept.get("source") == source:
            return kept["types"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # absent or unreadable: counted anew below
    from gguf import GGUFReader  # imported here: only a .gguf checkpoint needs the package

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(gguf)).tensors if len(t.shape) > 1)
    types = dict(counts.most_common())
    try:
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(stored, lambda partial: partial.write_text(json.dumps({"source": source, "types": types})))
    except OSError:
        pass  # a read-only cache: counted again next time
    return types


def expanded_types(types: dict[str, int]) -> dict[str, int]:
    """The types of weight_types that gguf weights do not keep packed: the loader dequantizes them to float32."""
    return {kind: count for kind, count in types.items() if kind not in BLOCK_KINDS and kind != "F32"}


def describe_types(types: dict[str, int]) -> str:
    """'Q5_0 x166, Q4_K x16' for weight_types."""
    return ", ".join(f"{kind} x{count}" for kind, count in types.items())
