"""Compact weights: linears computed from a GGUF checkpoint's Q4_1 blocks instead of dequantized floats.

On a CPU a decode step reads every weight once, so reading 4.6 bits instead of 32 per weight is most of the
step. The values are exactly the checkpoint's (the dense path dequantizes the same blocks); only the rounding
of the products differs. transformers supplies the GGUF-to-HF name map and the row order of q/k projections
(llama.cpp permutes their rows for its rotary layout). The runtime model fuses the q/k/v and the gate/up
projections into one linear each; from Q4_1 blocks, each part is computed by its own Q4Linear (ConcatLinear).
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from kernels.quantized import int4_linear, pack_q4_1
from triforce_cli.runtime.model import Transformer, replace_checkpoint_linears


class Q4Linear(nn.Module):
    """A bias-free linear whose weight lives as packed Q4_1 groups. x (T, K) float32 -> (T, N)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.packed, self.scales_and_zeros)


def q4_1_linears(gguf: Path, hf_config: PretrainedConfig) -> dict[str, Q4Linear]:
    """A Q4Linear for every weight stored as Q4_1 in gguf, by its Hugging Face module path (such as
    model.layers.0.mlp.up_proj)."""
    reader = GGUFReader(str(gguf))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(hf_config.model_type, TensorProcessor)(config=hf_config.to_dict())
    hf_names = get_gguf_hf_weights_map(skeleton, processor)
    linears = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or tensor.name not in hf_names:
            continue
        raw = torch.from_numpy(np.array(tensor.data))  # (N, K/32*20) uint8, rows in GGUF order
        row_order = processor.process(np.arange(raw.shape[0])[:, None], tensor.name).weights[:, 0]
        path = hf_names[tensor.name].removesuffix(".weight")
        linears[path] = Q4Linear(*pack_q4_1(raw[torch.from_numpy(row_order)]))
    return linears


def use_q4_1_weights(model: Transformer, gguf: Path, hf_config: PretrainedConfig) -> int:
    """Compute every bias-free linear stored as Q4_1 in gguf from its blocks; return how many checkpoint linears
    that is (replace_checkpoint_linears)."""
    return replace_checkpoint_linears(model, q4_1_linears(gguf, hf_config))
