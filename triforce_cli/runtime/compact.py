"""Compact weights: linears computed from a GGUF checkpoint's Q4_1 blocks instead of dequantized floats.

On a CPU a decode step reads every weight once, so reading 4.6 bits instead of 32 per weight is most of the
step. The values are exactly the checkpoint's (the dense path dequantizes the same blocks); only the rounding
of the products differs. transformers supplies the GGUF-to-HF name map and the row order of q/k projections
(llama.cpp permutes their rows for its rotary layout).
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from kernels.quantized import int4_linear, pack_q4_1


class Q4Linear(nn.Module):
    """A bias-free linear whose weight lives as packed Q4_1 groups. x (T, K) float32 -> (T, N)."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.packed, self.scales_and_zeros)


def use_q4_1_weights(model: nn.Module, gguf: Path, hf_config: PretrainedConfig) -> int:
    """Replace every bias-free linear stored as Q4_1 in gguf by a Q4Linear; return how many were replaced."""
    reader = GGUFReader(str(gguf))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    processor = TENSOR_PROCESSORS.get(hf_config.model_type, TensorProcessor)(config=hf_config.to_dict())
    hf_names = get_gguf_hf_weights_map(skeleton, processor)
    modules = dict(model.named_modules())
    replaced = 0
    for tensor in reader.tensors:
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or tensor.name not in hf_names:
            continue
        path = hf_names[tensor.name].removesuffix(".weight")
        module = modules.get(path)
        if not isinstance(module, nn.Linear) or module.bias is not None:
            continue
        raw = torch.from_numpy(np.array(tensor.data))  # (N, K/32*20) uint8, rows in GGUF order
        row_order = processor.process(np.arange(raw.shape[0])[:, None], tensor.name).weights[:, 0]
        model.set_submodule(path, Q4Linear(*pack_q4_1(raw[torch.from_numpy(row_order)])))
        replaced += 1
    return replaced
