"""The models and machines `triforce plan` knows by name, its default acceptance rates, and reading a config.json.

Every model is written out as numbers (nothing is downloaded); a model's drafter is the one the tool ships for it,
else a Llama of JackFram/llama-68m's shape (2 layers, hidden 768, 12 heads, intermediate 3072), the drafter of the
TriForce paper, with the target's vocabulary. Machine figures are vendors' peak numbers or common effective ones,
rounded; memory counts 2^30 bytes per GB as GPU vendors do.
"""

import re
import struct
from dataclasses import dataclass, replace
from difflib import get_close_matches
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from triforce_cli.errors import ConfigError
from triforce_cli.plan.model import Acceptance, Hardware, ModelShape
from triforce_cli.runtime.model import ModelConfig, UnsupportedModelError, config_refusal

GIB = 2**30


@dataclass(frozen=True)
class ModelPreset:
    target: ModelShape
    drafter: ModelShape


def llama_68m_drafter(vocab_size: int) -> ModelShape:
    """JackFram/llama-68m's shape with the target's vocabulary (a drafter must share it): 68M parameters at its own
    32,000 tokens."""
    return ModelShape(
        name="llama-68m-shaped drafter",
        num_layers=2,
        hidden_size=768,
        intermediate_size=3072,
        num_heads=12,
        num_kv_heads=12,
        head_dim=64,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
    )


LLAMA_2_7B_128K = ModelShape(  # NousResearch/Yarn-Llama-2-7b-128k, the TriForce paper's target
    name="Llama-2-7B-128K",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=11008,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    vocab_size=32000,
    tie_word_embeddings=False,
)
LLAMA_3_1_8B = ModelShape(
    name="Llama-3.1-8B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_3_1_ROPE = {  # Llama 3.1's RoPE scaling (its config.json), for building a model of its shape at 128K
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
QWEN2_7B = ModelShape(
    name="Qwen2-7B",
    num_layers=28,
    hidden_size=3584,
    intermediate_size=18944,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    vocab_size=152064,
    tie_word_embeddings=False,
    attention_bias=True,
)
SMOLLM2_135M = ModelShape(  # the embedded model (runtime/embedded.py)
    name="SmolLM2-135M",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
)
SMOLLM2_135M_DRAFTER = ModelShape(  # triforce_cli/drafters/smollm2-135m-instruct/config.json: 8,192 output_ids
    name="smollm2-135m-instruct drafter",
    num_layers=3,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
    output_vocab=8192,
)
EMBEDDED_PRESET = SMOLLM2_135M.name
MODELS = {
    shape.name: ModelPreset(shape, drafter)
    for shape, drafter in (
        (LLAMA_2_7B_128K, llama_68m_drafter(LLAMA_2_7B_128K.vocab_size)),
        (LLAMA_3_1_8B, llama_68m_drafter(LLAMA_3_1_8B.vocab_size)),
        (QWEN2_7B, llama_68m_drafter(QWEN2_7B.vocab_size)),
        (SMOLLM2_135M, SMOLLM2_135M_DRAFTER),
    )
}

# Per-draft acceptance (alpha: accepted over judged drafts), T 0.6 / top-p 0.9, the shipped drafter, from
# docs/bench/2026-11-25-7.5k-sampling-hf-llamacpp.json, docs/bench/2026-11-22-7.5k-sampling-half-hf.json and
# docs/bench/2026-11-24-32k-sampling-half.json: drafter -> retrieval 0.38 / 0.44 / 0.47 and drafter -> target
# (streaming) 0.47 / 0.49 / 0.48, mean 0.455; retrieval -> target 0.98 / 0.92 / 0.93 (triforce) and 0.91 / 0.95 /
# 0.92 (retrieval), mean 0.935, in line with the TriForce paper (Sun et al., 2024, arXiv 2404.11912), whose 4K
# retrieval cache is accepted more than 90% of the time by Llama2-7B-128K at about 120K tokens.
DEFAULT_ACCEPTANCE = Acceptance(draft=0.45, retrieval=0.93)

# Fixed cost of one decoder layer per forward: about a dozen kernels, about a microsecond each when replayed from a
# CUDA graph, about five microseconds of Python and launch each when eager (assumptions, not measurements).
CUDA_GRAPH_LAYER_OVERHEAD_S = 15e-6
EAGER_LAYER_OVERHEAD_S = 60e-6
PCIE4_X16 = 25e9  # effective bytes/s host to device of PCIe 4.0 x16 with pinned memory
PCIE5_X16 = 50e9
PCIE_ALL_REDUCE_S = 30e-6  # one small all-reduce between two GPUs over PCIe, without NVLink

RTX_4090 = Hardware(
    name="rtx-4090",
    memory_bytes=24 * GIB,
    bandwidth=1008e9,
    pcie=PCIE4_X16,
    flops=165e12,  # bfloat16 dense tensor
    layer_overhead_s=CUDA_GRAPH_LAYER_OVERHEAD_S,
    cuda_graphs=True,
)
HARDWARE = {
    hardware.name: hardware
    for hardware in (
        RTX_4090,
        # two RTX 4090s in tensor parallel: each offloads over its own PCIe link and all-reduces over PCIe; eager
        # steps, as the TriForce paper's offloading system runs there (no CUDA graphs with tensor parallelism)
        replace(
            RTX_4090,
            name="2x-rtx-4090",
            gpus=2,
            link=PCIE4_X16,
            all_reduce_s=PCIE_ALL_REDUCE_S,
            layer_overhead_s=EAGER_LAYER_OVERHEAD_S,
            cuda_graphs=False,
        ),
        Hardware(
            name="a100-80gb",
            memory_bytes=80 * GIB,
            bandwidth=2039e9,
            pcie=PCIE4_X16,
            flops=312e12,
            layer_overhead_s=CUDA_GRAPH_LAYER_OVERHEAD_S,
            cuda_graphs=True,
        ),
        Hardware(
            name="h100",
            memory_bytes=80 * GIB,
            bandwidth=3350e9,
            pcie=PCIE5_X16,
            flops=989e12,
            layer_overhead_s=CUDA_GRAPH_LAYER_OVERHEAD_S,
            cuda_graphs=True,
        ),
    )
}
THIS_CPU = "this-cpu"  # measured on the spot (plan/measure.py)
THIS_GPU = "this-gpu"  # the CUDA device, measured on the spot (plan/measure.py)
MEASURED = (THIS_CPU, THIS_GPU)
HARDWARE_CHOICES = (*HARDWARE, *MEASURED)
BRAND_WORDS = re.compile("nvidia|geforce|rtx")  # words a card's name is written with or without


def spelling_key(text: str) -> str:
    """A name as people type it with case, spaces, dashes, underscores and dots dropped: 'Llama 3.1 8B',
    'llama-3.1-8b' and 'LLAMA_3.1_8B' all read 'llama318b'."""
    return re.sub(r"[\s._-]+", "", text.lower())


def hardware_key(text: str) -> str:
    """spelling_key without the brand words a card's name is also written with: 'NVIDIA GeForce RTX 4090',
    'rtx4090' and '4090' all read '4090'."""
    return BRAND_WORDS.sub("", spelling_key(text))


MODEL_SPELLINGS = {spelling_key(name): name for name in MODELS}


def hardware_spellings() -> dict[str, str]:
    """Each key a machine preset is known by (hardware_key), with and without its memory, as cards are named both
    ways: 'a100' and 'a10080gb' for a100-80gb, 'h100' and 'h10080gb' for h100."""
    spellings = {hardware_key(name): name for name in MEASURED}
    for name, hardware in HARDWARE.items():
        memory = f"{hardware.memory_bytes // GIB}gb"
        bare = hardware_key(name).removesuffix(memory)
        spellings |= {bare: name, bare + memory: name}
    return spellings


HARDWARE_SPELLINGS = hardware_spellings()


def did_you_mean(key: str, spellings: dict[str, str]) -> str:
    """' (did you mean rtx-4090?)' for the preset whose key is closest to key, or '' where none is close."""
    close = get_close_matches(key, spellings, n=1)
    return f" (did you mean {spellings[close[0]]}?)" if close else ""


def hardware_name(spelling: str) -> str:
    """The machine preset spelled (RTX 4090, rtx4090, 4090, A100-80GB, a100: see hardware_key), by its name."""
    key = hardware_key(spelling)
    if key in HARDWARE_SPELLINGS:
        return HARDWARE_SPELLINGS[key]
    choices = ", ".join(HARDWARE_CHOICES)
    raise ConfigError(f"unknown hardware '{spelling}': choose from {choices}{did_you_mean(key, HARDWARE_SPELLINGS)}")


def model_preset(name_or_path: str) -> ModelPreset:
    """A preset by name, spelled any way spelling_key reads alike, else the config.json of a local folder or file (or
    the config a GGUF file's metadata implies), read with transformers; its drafter is then the one shipped for a
    preset of its shape (shipped_drafter), else a llama-68m-shaped one with its vocabulary. A preset's exact name
    (any case) wins over a file of that name, another spelling only where no such file exists. Nothing is
    downloaded."""
    path = Path(name_or_path).expanduser()
    key = spelling_key(name_or_path)
    named = MODEL_SPELLINGS.get(key)
    if named is not None and (named.lower() == name_or_path.lower() or not path.exists()):
        return MODELS[named]
    if not path.exists():
        raise ConfigError(
            f"unknown model '{name_or_path}': give a preset ({', '.join(MODELS)}), a local config.json or a folder"
            f" holding one, or a .gguf file{did_you_mean(key, MODEL_SPELLINGS)}"
        )
    from transformers import AutoConfig  # slow to import: only for a config file

    try:
        if path.suffix == ".gguf":  # the config its metadata implies, as transformers reads it
            hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
        else:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        config = ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as err:
        raise ConfigError(f"{path}: {err}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error, StrictDataclassError) as err:
        raise ConfigError(f"{path} is not a readable model config: {config_refusal(err)}") from None
    name = path.stem if path.suffix == ".gguf" else (path.parent if path.is_file() else path).name or str(path)
    target = ModelShape.from_config(name=name, config=config)
    return ModelPreset(target, shipped_drafter(target) or llama_68m_drafter(target.vocab_size))


def shipped_drafter(target: ModelShape) -> ModelShape | None:
    """The drafter the tool ships for a preset whose shape target has (its file or folder under any name: the
    embedded default's GGUF file is SmolLM2-135M's shape), else None."""
    for preset in MODELS.values():
        if replace(preset.target, name=target.name) == target:
            return preset.drafter
    return None


def with_figures(
    hardware: Hardware,
    *,
    gpus: int | None = None,
    memory_gb: float | None = None,
    bandwidth_gbs: float | None = None,
    pcie_gbs: float | None = None,
    tflops: float | None = None,
) -> Hardware:
    """hardware with the figures given in place of its own (None keeps one). More than one GPU where the machine
    has no link between them links them over its PCIe with PCIE_ALL_REDUCE_S per all-reduce."""
    if gpus is not None and gpus > 1 and hardware.measured:
        raise ConfigError(f"`gpus` {gpus} needs a GPU machine, not {hardware.name}")
    devices = hardware.gpus if gpus is None else gpus
    pcie = hardware.pcie if pcie_gbs is None else pcie_gbs * 1e9
    linked = devices == 1 or hardware.link > 0
    return replace(
        hardware,
        gpus=devices,
        memory_bytes=hardware.memory_bytes if memory_gb is None else round(memory_gb * GIB),
        bandwidth=hardware.bandwidth if bandwidth_gbs is None else bandwidth_gbs * 1e9,
        pcie=pcie,
        flops=hardware.flops if tflops is None else tflops * 1e12,
        link=hardware.link if linked else pcie,
        all_reduce_s=hardware.all_reduce_s if linked else PCIE_ALL_REDUCE_S,
    )
