"""Bytes per weight of the target for `triforce plan --weights`: the dtype's, or GGUF blocks kept packed on the CPU.

A GGUF file's blocks are held as kernels.gguf packs them (BlockKind.bytes_per_weight: 0.75 bytes for the 4-bit
types, 1.125 for Q8_0 and Q5_0, 1.25 for Q5_1, Q5_K and Q6_K), and a type not kept packed as float32. A quantization
named as llama.cpp names it (q4_k_m, q8_0, ...) is turned into types per tensor as llama.cpp's quantizer chooses
them (llama-quant.cpp, llama_tensor_get_type), in the parts that weigh:
- the output layer (the embedding, where it is tied) is Q6_K but in a Q8_0 file;
- the *_M mixes give the value projection and the MLP's down projection Q6_K in the layers where llama.cpp spends
  more bits (the first and last eighth, and every third between);
- a K-quant tensor whose rows are not a multiple of 256 wide takes the 32-weight type llama.cpp falls back to
  (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), as every tensor of a model 576 wide does.
A file (`--model file.gguf`) gives its own types, tensor by tensor.
"""

from pathlib import Path

from triforce_cli.errors import ConfigError
from triforce_cli.kernels.gguf import BLOCK_TYPES
from triforce_cli.plan.model import ModelShape, WeightBytes

SUPER_BLOCK = 256  # weights of a K-quant block: rows narrower than a multiple of it fall back
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# a quantization llama.cpp names -> the base type and, for the *_M mixes, the type of the tensors given more bits
GGUF_MIXES = {
    "q4_0": ("Q4_0", None),
    "q4_1": ("Q4_1", None),
    "q5_0": ("Q5_0", None),
    "q5_1": ("Q5_1", None),
    "q8_0": ("Q8_0", None),
    "q4_k_s": ("Q4_K", None),
    "q5_k_s": ("Q5_K", None),
    "q6_k": ("Q6_K", None),
    "q4_k_m": ("Q4_K", "Q6_K"),
    "q5_k_m": ("Q5_K", "Q6_K"),
}
FLOAT32_BYTES = 4.0  # a type not kept packed is computed from a float32 copy
WEIGHT_PLANS = ("dtype", *GGUF_MIXES)  # what `plan --weights` takes


def packed_bytes(kind: str) -> float:
    """Bytes per weight a GGUF type takes as gguf weights hold it."""
    return BLOCK_TYPES[kind].bytes_per_weight() if kind in BLOCK_TYPES else FLOAT32_BYTES


def _fitted(kind: str, width: int) -> str:
    """The type a tensor with rows `width` wide gets: a K-quant falls back where its super-blocks do not fit."""
    return FALLBACK.get(kind, kind) if width % SUPER_BLOCK else kind


def _more_bits(layer: int, layers: int) -> bool:
    """Whether llama.cpp's *_M mixes give this layer's value and down projections more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_weight_bytes(name: str, shape: ModelShape) -> WeightBytes:
    """The bytes per weight of a llama.cpp quantization (GGUF_MIXES) of a model of this shape."""
    base, more = GGUF_MIXES[name]
    hidden, attended = shape.hidden_size, shape.num_heads * shape.head_dim
    kv_rows = shape.num_kv_heads * shape.head_dim
    # each projection: (parameters, row width, whether it is one the *_M mixes give more bits)
    projections = [
        (attended * hidden, hidden, False),  # q
        (kv_rows * hidden, hidden, False),  # k
        (kv_rows * hidden, hidden, True),  # v
        (hidden * attended, attended, False),  # output
        (2 * shape.intermediate_size * hidden, hidden, False),  # gate and up
        (hidden * shape.intermediate_size, shape.intermediate_size, True),  # down
    ]
    layer_bytes = 0.0
    for layer in range(shape.num_layers):
        for parameters, width, promoted in projections:
            kind = more if more and promoted and _more_bits(layer, shape.num_layers) else base
            layer_bytes += parameters * packed_bytes(_fitted(kind, width))
    weights = sum(parameters for parameters, _, _ in projections) * shape.num_layers
    output = packed_bytes(_fitted("Q8_0" if base == "Q8_0" else "Q6_K", hidden))
    return WeightBytes(name, layers=layer_bytes / weights, output=output)


def file_weight_bytes(path: Path) -> WeightBytes:
    """The bytes per weight of a GGUF file's own tensors: its decoder layers' matrices, and its output layer (the
    embedding where it is tied)."""
    from gguf import GGUFReader

    try:
        tensors = [t for t in GGUFReader(str(path)).tensors if len(t.shape) > 1]
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is not a readable GGUF file: {err}") from None
    sums = {"layers": [0.0, 0], "output": [0.0, 0]}
    by_name = {t.name: t for t in tensors}
    output = by_name.get("output.weight") or by_name.get("token_embd.weight")
    for tensor in tensors:
        part = "layers" if tensor.name.startswith("blk.") else "output" if tensor is output else None
        if part is not None:
            sums[part][0] += int(tensor.n_elements) * packed_bytes(tensor.tensor_type.name)
            sums[part][1] += int(tensor.n_elements)
    if not all(count for _, count in sums.values()):
        raise ConfigError(f"{path} holds no decoder layers and output layer of a Llama-family model")
    return WeightBytes(path.name, *(total / count for total, count in sums.values()))


def weight_bytes(name: str | None, *, model: str, shape: ModelShape) -> WeightBytes | None:
    """What `plan --weights name` plans for the target: None for the dtype's bytes; a GGUF_MIXES quantization of
    shape; name None: a .gguf model file's own types, else the dtype's."""
    if name is None:
        path = Path(model).expanduser()
        return file_weight_bytes(path) if path.suffix == ".gguf" and path.is_file() else None
    return None if name == "dtype" else mix_weight_bytes(name, shape)
