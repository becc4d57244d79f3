"""Checkpoint resolution and loading, one code path for every source.

A model spec is a local folder (config.json + tokenizer + safetensors, sharded or not), a single .safetensors
file beside its config, a GGUF file, a Hugging Face hub id, or nothing for the embedded default. GGUF files are
dequantized once by transformers into a safetensors folder in the user cache; every source then loads from
such a folder.
"""

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from triforce_cli import offload
from triforce_cli.errors import ConfigError, ModelLoadError
from triforce_cli.kernels import half_weights_available
from triforce_cli.kernels.memory import huge_pages_available, onto_huge_pages
from triforce_cli.runtime.context_window import extend_context
from triforce_cli.runtime.embedded import EMBEDDED_NAME, embedded_gguf_path
from triforce_cli.runtime.forms import WEIGHT_FORMATS, OffloadMode, StepMode, WeightForm
from triforce_cli.runtime.gguf_weights import (
    GGUFEmbedding,
    describe_types,
    expanded_types,
    use_gguf_weights,
    weight_types,
)
from triforce_cli.runtime.half_weights import round_to_half, use_half_weights
from triforce_cli.runtime.model import (
    ModelConfig,
    Transformer,
    UnsupportedModelError,
    config_refusal,
    long_rope_frequencies,
    rope_frequencies,
)
from triforce_cli.runtime.native import kernel_error
from triforce_cli.runtime.parallel import apply_tp
from triforce_cli.runtime.store import (
    content_identity,
    entries,
    evict,
    mark_used,
    models_folder,
    remove,
    write_atomically,
)
from triforce_cli.runtime.tiled_weights import TiledEmbedding, tiled_weights_apply, use_tiled_weights

StatusCallback = Callable[[str], None]
EMBEDDING_WEIGHT = "model.embed_tokens.weight"
SHARED_WEIGHTS = (EMBEDDING_WEIGHT, "lm_head.weight")  # what a distilled drafter borrows from its target
DRAFTER_METADATA = "triforce_drafter"  # config.json key written by `triforce distill`
CONVERSION_RECORD = "triforce-conversion.json"  # the sizes of a converted checkpoint's files, to check it whole
HEADER_BYTES = 1 << 20  # of each weight file, hashed into a checkpoint's fingerprint
HUGE_PAGE_GROUP = 16 << 20  # bytes: the least a buffer of weights copied onto huge pages holds (keep_on_huge_pages)


def token_id_set(ids: int | list[int] | None) -> set[int]:
    """A config's token id field (one id, a list, or None) as a set."""
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, list) else {ids}


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    source: str = ""  # the checkpoint folder it was loaded from
    weight_files: tuple[Path, ...] = ()
    gguf: Path | None = None  # the GGUF file it was converted from, if any
    weights: str = WeightForm.DENSE  # one of WEIGHT_FORMATS

    @cached_property
    def file_types(self) -> dict[str, int]:
        """The GGUF file's weight matrices by type (gguf_weights.weight_types); empty for another checkpoint."""
        return {} if self.gguf is None else weight_types(self.gguf, Path(self.source))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.model.norm.weight.dtype  # a parameter in every weight form

    @property
    def device(self) -> torch.device:
        return self.model.device

    def check_drafts_for(self, target: "LoadedModel") -> None:
        """A ConfigError where this model cannot draft for target: their token ids must mean the same tokens."""
        vocabulary = self.tokenizer.get_vocab() == target.tokenizer.get_vocab()
        if not vocabulary or self.model.config.vocab_size != target.model.config.vocab_size:
            raise ConfigError(f"drafter {self.name} does not share the vocabulary of {target.name}")

    @cached_property
    def fingerprint(self) -> str:
        """A hash that changes with the checkpoint behind this model: each weight file's resolved path, size,
        modification time and first megabyte (the safetensors header and more), the GGUF file it came from, the
        tokenizer's files, and the config as loaded (every setting the forward reads: an edited config.json is another
        model); for a model built in memory (no files), its parameters' values."""
        digest = hashlib.sha256(self.hf_config.to_json_string(use_diff=False).encode())
        files = [*self.weight_files, *([self.gguf] if self.gguf is not None else [])]
        if self.source:
            files += sorted(Path(self.source).glob("tokenizer*"))
        for path in files:
            stat = path.stat()
            digest.update(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
            with path.open("rb") as handle:
                digest.update(handle.read(HEADER_BYTES))
        if not files:
            for name, tensor in self.model.state_dict().items():
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    @property
    def eos_token_ids(self) -> set[int]:
        ids = token_id_set(self.hf_config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids


def converted_folder(gguf: Path, status: StatusCallback | None = None) -> Path:
    """The safetensors folder made from a GGUF file, converting it on first use (and again where the copy is no
    longer whole). It is named by the file's content (store.content_identity), so copies of one file installed in
    several places share one conversion. Two processes converting at once each write a folder of their own; the
    first to finish is kept. The least recently used conversions go when the models folder outgrows the cache
    limit."""
    identity = content_identity(gguf)
    target = models_folder() / f"{gguf.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    if (target / "config.json").is_file():
        if _conversion_is_whole(target, identity):
            mark_used(target)
            return target
        if status is not None:
            status(f"the converted copy {target} is incomplete or was changed: converting {gguf.name} again")
        remove(target)
    if status is not None:
        status(f"converting {gguf.name} to safetensors once, into {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, lambda partial: _convert(gguf, identity, partial))
    _remove_unreachable_conversions(keep=target)
    evict(models_folder(), keep=target)
    return target


def _convert(gguf: Path, identity: str, folder: Path) -> None:
    """Write the safetensors checkpoint of gguf into folder, with the record _conversion_is_whole checks. The status
    line says what happens; transformers' progress bar stays off."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    folder.mkdir()
    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    except (ValueError, KeyError, OSError, struct.error, StrictDataclassError) as err:  # struct.error: cut short
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {err}") from None
    finally:
        hf_logging.enable_progress_bar()
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors")
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    sizes = {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()}
    (folder / CONVERSION_RECORD).write_text(json.dumps({"source": identity, "sizes": sizes}, indent=1))


def _conversion_record(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / CONVERSION_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("sizes"), dict) else None


def _conversion_is_whole(folder: Path, identity: str) -> bool:
    """Whether a converted checkpoint was made from the file with this identity and every file of it still has the
    size it was written with."""
    record = _conversion_record(folder)
    if record is None or record.get("source") != identity:
        return False
    try:
        return all((folder / name).stat().st_size == size for name, size in record["sizes"].items())
    except (OSError, TypeError):
        return False


def _remove_unreachable_conversions(keep: Path) -> None:
    """Remove conversions no run can ask for any more: those without the source record of converted_folder (an
    earlier layout named them by the GGUF file's path, one copy per place the file was installed)."""
    for entry in entries(models_folder()):
        converted = (entry.path / CONVERSION_RECORD).is_file()
        if entry.path != keep and converted and "source" not in (_conversion_record(entry.path) or {}):
            remove(entry.path)


def download_folder(repo_id: str) -> Path:
    """A hub checkpoint's local snapshot (from the local HF cache when offline)."""
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as err:  # noqa: BLE001 - the hub client raises many kinds: offline, not found, gated, bad id
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelLoadError(
            f"unknown model '{repo_id}': not a local file or folder, and not available from the hub ({reason})"
        ) from None


@dataclass(frozen=True)
class Checkpoint:
    name: str
    folder: Path  # config.json and tokenizer
    weight_files: list[Path]  # safetensors
    gguf: Path | None = None  # the GGUF file the folder was converted from


def resolve_checkpoint(spec: str | None, status: StatusCallback | None = None) -> Checkpoint:
    """Where a model spec's config, tokenizer and weights are, converting GGUF files on first use."""
    if spec is None:
        gguf = embedded_gguf_path()
        return Checkpoint(EMBEDDED_NAME, *_folder_files(converted_folder(gguf, status)), gguf)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Checkpoint(path.stem, *_folder_files(converted_folder(path, status)), path)
    if path.is_file() and path.suffix == ".safetensors":
        return Checkpoint(path.stem, path.parent, [path])
    if path.is_dir():
        return Checkpoint(path.name, *_folder_files(path))
    if path.exists():
        raise ModelLoadError(f"model path {spec} is not a folder, a .gguf file or a .safetensors file")
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise ModelLoadError(f"model path {spec} does not exist")
    return Checkpoint(spec, *_folder_files(download_folder(spec)))


def _folder_files(folder: Path) -> tuple[Path, list[Path]]:
    files = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    if not files:
        raise ModelLoadError(f"{folder} has no .safetensors weights")
    return folder, files


def embedding_digest(weight_files) -> str:
    """SHA-256 of the stored input-embedding tensor: identifies the target a distilled drafter belongs to."""
    for file in weight_files:
        with safe_open(file, framework="pt") as handle:
            if EMBEDDING_WEIGHT in handle.keys():  # noqa: SIM118 - safe_open has no __contains__
                tensor = handle.get_tensor(EMBEDDING_WEIGHT)
                return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()
    raise ModelLoadError(f"no {EMBEDDING_WEIGHT} in {', '.join(str(f) for f in weight_files)}")


def borrow_shared_weights(
    name: str, hf_config: PretrainedConfig, state: dict, shared_from: "LoadedModel | None"
) -> bool:
    """Fill a distilled drafter's missing embedding and output layer with its target's (the same tensors, or the
    values of a packed form); return whether it did."""
    metadata = getattr(hf_config, DRAFTER_METADATA, None)
    if not metadata or EMBEDDING_WEIGHT in state:
        return False
    if shared_from is None:
        raise ModelLoadError(
            f"{name} is a drafter distilled for {metadata['target']} and borrows its embeddings: load it with --draft"
        )
    if embedding_digest(shared_from.weight_files) != metadata["embedding_sha256"]:
        raise ModelLoadError(
            f"drafter {name} was distilled for {metadata['target']}; its embeddings are not those of {shared_from.name}"
        )
    target = shared_from.model
    state[EMBEDDING_WEIGHT] = target.model.embed_tokens.weight
    if not hf_config.tie_word_embeddings:
        state["lm_head.weight"] = target.lm_head.weight
    return True


def check_weight_format(weights: str, checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> None:
    """A clear error where the weight format cannot be used for this checkpoint, dtype and device."""
    if weights not in WEIGHT_FORMATS:
        raise ModelLoadError(f"unknown weight format '{weights}' (choose from {', '.join(WEIGHT_FORMATS)})")
    on_cpu_in_float32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if weights == WeightForm.GGUF:
        if not (checkpoint.gguf is not None and on_cpu_in_float32):
            raise ModelLoadError("gguf weights need a GGUF checkpoint, the CPU and float32")
        if (error := kernel_error()) is not None:
            raise ModelLoadError(error)
    if weights == WeightForm.HALF:
        if not (on_cpu_in_float32 and half_weights_available()):
            raise ModelLoadError("half weights need the CPU, float32 and a torch build with fbgemm (x86)")
        if (error := kernel_error()) is not None:  # the tiled product computes them
            raise ModelLoadError(error)


@dataclass(frozen=True)
class BuildOptions:
    """What a model built from a checkpoint's state becomes (transform_model), and where it is put: the runtime's
    side of a load's set-up (decoding.setup.Setup).

    Attributes:
        device: where the model computes.
        dtype: the weights' dtype; the checkpoint's tensors are cast to it in host memory.
        weights: the weight form, one of WEIGHT_FORMATS ('half' and 'gguf' exist on the CPU in float32 only).
        tensor_parallel: shard the decoder layers over the default process group (parallel.apply_tp; with one
            process, nothing changes).
        offload_weights: keep the decoder layers from resident_layers on in host memory and stream them to the
            device for each forward (offload.offload_weights, EngineConfig.offload kv+weights).
        resident_layers: with offload_weights, the first layers whose weights live on the device.
        attention: the attention kernel family (Transformer.use_attention); None: the fastest for the weights.
        steps: how decode steps run (Transformer.use_steps); None: eager.
    """

    device: torch.device
    dtype: torch.dtype = torch.float32
    weights: str = WeightForm.DENSE
    tensor_parallel: bool = False
    offload_weights: bool = False
    resident_layers: int = 0
    attention: str | None = None
    steps: StepMode | None = None


def runtime_config(hf_config: PretrainedConfig, name: str) -> ModelConfig:
    """The runtime's config of a checkpoint, or a ModelLoadError naming it where this runtime cannot run it."""
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as err:
        raise ModelLoadError(f"{name}: {err}") from None


def read_host_state(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's safetensors files by name, in host memory as the files store them."""
    state = {}
    for file in files:
        try:
            state.update(load_file(file))
        except (OSError, SafetensorError) as err:
            raise ModelLoadError(f"cannot read weights {file}: {err}") from None
    return state


def tensor_places(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Each parameter and buffer of model once, in module order, as the (module, name) places that hold it (a tensor
    several modules share, a tied output layer, is one entry), leaving out the layers whose weights stream from host
    memory (model.weight_stream)."""
    stream = getattr(model, "weight_stream", None)
    layers = [] if stream is None else stream.streamed_layers
    streamed = {id(module) for layer in layers for module in layer.modules()}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # id of each tensor -> the modules holding it, its names
    for module in model.modules():
        if id(module) not in streamed:
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                holders.setdefault(id(tensor), []).append((module, name))
    return list(holders.values())


def put_in_places(places: list[tuple[nn.Module, str]], tensor: torch.Tensor, was: torch.Tensor) -> None:
    """tensor where `was` was held (tensor_places), a Parameter where it was one."""
    if isinstance(was, nn.Parameter):
        tensor = nn.Parameter(tensor, was.requires_grad)
    for module, name in places:
        setattr(module, name, tensor)


def move_to_device(model: nn.Module, device: torch.device) -> None:
    """Move model's parameters and buffers (tensor_places) to device one tensor at a time, so that each host copy is
    freed (where nothing else holds it) as its device copy exists; a shared tensor moves once and stays shared, and
    one on the device already (a drafter's borrowed embedding) stays as it is."""
    with torch.no_grad():
        for places in tensor_places(model):
            tensor = getattr(*places[0])
            on_device = tensor.to(device)
            if on_device is not tensor:
                put_in_places(places, on_device, tensor)


def owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether tensor is on the CPU and all of its storage, so that a copy of it shares nothing with any other."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes


def keep_on_huge_pages(model: nn.Module) -> None:
    """Copy model's CPU parameters and buffers (tensor_places) onto huge pages (kernels.memory), where this machine
    has them: consecutive tensors side by side in buffers of at least HUGE_PAGE_GROUP bytes (a decoder layer's GGUF
    blocks fill no huge page alone), one buffer at a time, each original freed as its copy exists, so that loading
    holds at most one buffer more than the model. A view of a larger storage stays where it is. The values are the
    same bits."""
    if not huge_pages_available():
        return
    group: list[tuple[list[tuple[nn.Module, str]], torch.Tensor]] = []  # (places, tensor) for the next buffer
    with torch.no_grad():
        for places in tensor_places(model):
            tensor = getattr(*places[0])
            if owns_its_storage(tensor):
                group.append((places, tensor))
            if sum(t.nbytes for _, t in group) >= HUGE_PAGE_GROUP:
                copy_onto_huge_pages(group)
                group = []
        if group:
            copy_onto_huge_pages(group)


def copy_onto_huge_pages(group: list[tuple[list[tuple[nn.Module, str]], torch.Tensor]]) -> None:
    """Each (places, tensor) of group's tensor replaced in its places by its copy in one buffer (onto_huge_pages)."""
    copies = onto_huge_pages([tensor for _, tensor in group])
    for (places, tensor), copy in zip(group, copies, strict=True):
        put_in_places(places, copy, tensor)


def build_model(
    state: dict[str, torch.Tensor], hf_config: PretrainedConfig, dtype: torch.dtype, name: str
) -> Transformer:
    """The runtime model of a checkpoint's state, built in host memory (gpt-fast's _load_model has the same shape):

    1. cast each tensor to dtype (before fusing: the fused copies are then of the smaller dtype);
    2. build the model, fusing q/k/v and gate/up (fuse_checkpoint: each projection's parts freed as its fused
       tensor exists), and restrict a distilled drafter's output layer to its tokens (Transformer.restrict_output).

    Args:
        state: the checkpoint's tensors by Hugging Face's names, in host memory (a tensor already on the device,
            such as a drafter's borrowed embedding, stays there); emptied as the model takes them over.
        hf_config: the checkpoint's config, its context window set.
        dtype: the weights' dtype.
        name: the checkpoint's name, for errors.
    Returns:
        The model in eval mode, where the state was.
    Raises:
        ModelLoadError: weights that do not fit the config, or that it lacks or does not use.
    """
    model_config = runtime_config(hf_config, name)
    for key, tensor in state.items():
        state[key] = tensor.to(dtype)
    inv_freq, rope_scale = rope_frequencies(hf_config, model_config.head_dim)  # in host memory, as everything here
    long_inv_freq = long_rope_frequencies(hf_config)
    with torch.device("meta"):
        model = Transformer(model_config, inv_freq, rope_scale, long_inv_freq)
    try:
        missing, unexpected = model.load_hf_state(state, assign=True)
    except RuntimeError as err:  # a tensor whose shape is not the one config.json implies
        detail = next((line.strip() for line in str(err).splitlines() if "mismatch" in line), str(err).splitlines()[0])
        raise ModelLoadError(f"{name}: its weights do not fit its config.json ({detail})") from None
    state.clear()  # the model holds them now: a transform that replaces one frees it
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing:
        raise ModelLoadError(f"{name}: checkpoint lacks weights such as {missing[0]}")
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ModelLoadError(f"{name}: checkpoint has weights this runtime does not use, such as {unexpected[0]}")
    output_ids = (getattr(hf_config, DRAFTER_METADATA, None) or {}).get("output_ids")
    if output_ids:  # before the weight form, which then packs the restricted output layer too
        model.restrict_output(torch.tensor(output_ids))
    return model.eval()


def transform_model(
    model: Transformer, options: BuildOptions, checkpoint: Checkpoint, hf_config: PretrainedConfig
) -> Transformer:
    """Apply a load's set-up to a model built in host memory (build_model): every transform once, in a fixed order,
    the first ones before any tensor crosses to the device (gpt-fast's apply_tp has the same shape).

    1. the weight form (half or gguf weights; the CPU only); on the CPU in float32, the linears left dense are laid
       out in tiles for the tiled product (tiled_weights.py), unless sharded or streamed;
    2. shard the decoder layers (options.tensor_parallel, parallel.apply_tp);
    3. weight offload (options.offload_weights): the streamed layers stay in host memory, page-locked for a CUDA
       device, and their two-slot ring is allocated on the device;
    4. every other tensor crosses to the device, once, already cast and sharded (move_to_device); on the CPU, the
       weights are copied onto huge pages instead (keep_on_huge_pages), which a decode step reads faster;
    5. the attention kernels (options.attention, Transformer.use_attention), then the step mode (options.steps,
       Transformer.use_steps).

    The device thus holds at most the weights it keeps: no unfused or unsharded copy, no streamed layer.

    Args:
        model: build_model's, in host memory.
        options: device, weight form, sharding, weight offload, attention kernels and step mode.
        checkpoint: the model's checkpoint: its GGUF file and folder for gguf weights.
        hf_config: the checkpoint's config (gguf weights read the file's tensors by it).
    Returns:
        model, on options.device but for its streamed layers.
    Raises:
        ConfigError: a transform that cannot apply (heads that do not divide by the processes, weights that
            are not dense to shard or stream).
    """
    if options.weights == WeightForm.GGUF:
        use_gguf_weights(model, checkpoint.gguf, hf_config, checkpoint.folder)
    if options.weights == WeightForm.HALF:
        use_half_weights(model)
    elif tiled_weights_apply(options.device, options.dtype) and not (
        options.tensor_parallel or options.offload_weights
    ):
        use_tiled_weights(model)  # every dense linear left: a dense model's, a GGUF file's dequantized ones
    if options.tensor_parallel:
        apply_tp(model)
    if options.offload_weights:
        try:
            offload.offload_weights(model, options.device, options.resident_layers)
        except ValueError as err:
            raise ConfigError(f"`offload` {OffloadMode.KV_WEIGHTS}: {err}") from None
    move_to_device(model, options.device)
    if options.device.type == "cpu":
        keep_on_huge_pages(model)
    if model.output_ids is not None:  # a plain attribute, no buffer: move_to_device leaves it
        model.output_ids = model.output_ids.to(options.device)
    if options.attention is not None:
        model.use_attention(options.attention)
    if options.steps is not None:
        model.use_steps(options.steps)
    return model


def model_from_state(
    state: dict[str, torch.Tensor], hf_config: PretrainedConfig, options: BuildOptions, checkpoint: Checkpoint
) -> Transformer:
    """The runtime model of a checkpoint's state as options say: built in host memory (build_model, emptying
    state), then transformed and put on the device (transform_model)."""
    model = build_model(state, hf_config, options.dtype, checkpoint.name)
    return transform_model(model, options, checkpoint, hf_config)


def load_model(
    spec: str | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    status: StatusCallback | None = None,
    weights: str = WeightForm.DENSE,
    shared_from: LoadedModel | None = None,
    context_window: int | None = None,
    tensor_parallel: bool = False,
    offload_weights: bool = False,
    resident_layers: int = 0,
    checkpoint: Checkpoint | None = None,
    attention: str | None = None,
    steps: StepMode | None = None,
) -> LoadedModel:
    """Load a Llama-family checkpoint into the runtime model, with its tokenizer and config: its tensors are read
    into host memory, built and transformed there, once, before they cross to the device (model_from_state).

    checkpoint: spec's checkpoint where it is resolved already (resolve_checkpoint), else None: resolved here.

    shared_from: the target, when loading a drafter; a drafter written by `triforce distill` borrows its
    embedding and output layer (see borrow_shared_weights).

    weights: 'dense' computes from float weights; 'half' (CPU, float32) rounds the weight matrices to float16
    and reads them as such, half the bytes per step (half_weights.py); 'gguf' computes from a GGUF file's own blocks
    (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K; GGUF source, CPU, float32; gguf_weights.py); a note names the
    file's types that are dequantized instead.

    context_window: positions to accept; beyond the trained context, RoPE is scaled with YaRN (context_window.py).

    tensor_parallel, offload_weights, resident_layers, attention, steps: see BuildOptions.
    """
    checkpoint = checkpoint or resolve_checkpoint(spec, status)
    name, folder, files = checkpoint.name, checkpoint.folder, checkpoint.weight_files
    check_weight_format(weights, checkpoint, dtype, device)
    if torch.device(device).type == "cpu":
        kernel_error()  # the CPU extension, where it builds: prefill attention (and GGUF blocks) run on it
    try:
        hf_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # a checkpoint's code never runs
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError, StrictDataclassError) as err:  # the last: a config its own checks refuse
        raise ModelLoadError(f"cannot read config or tokenizer of {name}: {config_refusal(err)}") from None
    if context_window is not None:
        extend_context(hf_config, context_window)
    runtime_config(hf_config, name)  # an architecture this runtime cannot run fails before any weight is read
    state = read_host_state(files)
    borrowed = borrow_shared_weights(name, hf_config, state, shared_from)
    options = BuildOptions(
        torch.device(device), dtype, weights, tensor_parallel, offload_weights, resident_layers, attention, steps
    )
    model = model_from_state(state, hf_config, options, checkpoint)
    if shared_from is not None and isinstance(shared_from.model.model.embed_tokens, GGUFEmbedding):
        model.model.embed_tokens = shared_from.model.model.embed_tokens  # the target's blocks, not a float copy
    elif borrowed and isinstance(shared_from.model.model.embed_tokens, TiledEmbedding):
        model.model.embed_tokens = shared_from.model.model.embed_tokens  # the target's tiles, not a copy
    loaded = LoadedModel(name, model, tokenizer, hf_config, str(folder), tuple(files), checkpoint.gguf, weights)
    expanded = expanded_types(loaded.file_types) if weights == WeightForm.GGUF else {}
    if expanded and status is not None:
        status(f"{name}: {describe_types(expanded)} weights are not kept packed: computed from float32 copies")
    return loaded


def load_hf_model(
    source: str,
    dtype: torch.dtype,
    target: PreTrainedModel | None = None,
    config: PretrainedConfig | None = None,
    half_weights: bool = False,
    device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """A checkpoint folder as a transformers model on device, attention by torch SDPA; a drafter written by
    `triforce distill` gets target's embedding and output layer (transformers computes its output over the whole
    vocabulary).

    config: the runtime's config of the same model (its context window), instead of the folder's.
    half_weights: round the weight matrices to float16 values, as the runtime's 'half' weights hold them.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        # safetensors only: a pickled weights file beside them is never unpickled
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=dtype,
            config=config,
            use_safetensors=True,
            attn_implementation="sdpa",
            trust_remote_code=False,
        )
        model = model.to(device).eval()
    finally:
        hf_logging.enable_progress_bar()
    if target is not None and getattr(model.config, DRAFTER_METADATA, None):
        model.model.embed_tokens = target.model.embed_tokens
        model.lm_head = target.lm_head
    if half_weights:
        round_to_half(model)
    return model
