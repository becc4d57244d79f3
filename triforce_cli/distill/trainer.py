"""`triforce distill`: train a small drafter for a target model, sharing its tokenizer and embeddings.

The drafter is the target's own architecture with a few layers, started from target layers the user picks, and
trained on the target's next-token distributions with the top-K distillation loss of HASS (Zhang et al., 2024,
arXiv 2408.15766): -sum over the target's K most likely tokens x of p(x) log q(x), which spends the drafter's
small capacity on the tokens speculative sampling can accept. Its embedding and output layer are the target's,
frozen, and are not written out: loading the drafter beside its target borrows them (see loading.py).

HASS's second idea, context alignment, trains a feature-level drafter on the features it will see while drafting
(its own). A token-level drafter sees accepted tokens while drafting, which follow the target's distribution;
`self_generate` aligns its training context the same way, with windows the target writes itself.

`init_from` starts from an earlier drafter of the same target instead of the target's layers: more steps on a
drafter already shipped, with a learning-rate schedule of their own.
"""

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from triforce_cli.corpus import BUILTIN_NAMES, shared_texts
from triforce_cli.decoding.sampling import SamplingConfig, acceptance_probability, probabilities
from triforce_cli.distill.data import (
    TeacherTargets,
    held_out_texts,
    load_tensors,
    save_tensors,
    self_generated_windows,
    text_windows,
    training_texts,
)
from triforce_cli.errors import ConfigError, ModelLoadError
from triforce_cli.runtime.loading import (
    DRAFTER_METADATA,
    SHARED_WEIGHTS,
    Checkpoint,
    StatusCallback,
    embedding_digest,
    load_hf_model,
    resolve_checkpoint,
    token_id_set,
)
from triforce_cli.runtime.model import ModelConfig, UnsupportedModelError, config_refusal, spread_over_vocabulary
from triforce_cli.runtime.store import content_identity

CHECKPOINT_NAME = "distill-checkpoint.safetensors"
PICKLED_CHECKPOINT_NAME = "distill-checkpoint.pt"  # the older, pickled format: refused, never read
WORK_FOLDER = "distill-work"  # teacher targets and self-generated windows, kept for --resume
SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DistillConfig:
    data: tuple[str, ...] = ()  # text files
    builtin: tuple[str, ...] = ()  # built-in documents (corpus.BUILTIN_NAMES)
    init_layers: tuple[int, ...] = (0, 1, 2)  # target layers the drafter starts from, in order
    init_from: str | None = None  # a drafter folder written by distill for this target: start from its weights
    draft_vocab: int = 8192  # tokens the drafter's output layer covers, the most frequent in the data; 0: all
    self_generate: int = 0  # extra training windows the target writes itself
    seq_len: int = 256
    batch_size: int = 8
    top_k: int = 5
    learning_rate: float = 5e-4
    warmup_steps: int = 20
    max_steps: int = 1000
    held_out_windows: int = 8
    held_out_text: tuple[str, ...] = ()  # built-in names or files to take them from; (): the training text
    eval_every: int = 50
    acceptance_temperature: float = 0.6  # held-out acceptance is reported at this temperature and at 0
    self_temperature: float = 0.6
    save_dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.data and not self.builtin:
            raise ConfigError("distill needs training text: `data` files and/or `builtin` documents")
        if not self.init_layers or min(self.init_layers) < 0:
            raise ConfigError("`init_layers` must name target layers, e.g. 0,1,2,3")
        if self.top_k < 1 or self.seq_len < 8 or self.batch_size < 1 or self.max_steps < 1:
            raise ConfigError(
                "`top_k` and `batch_size` must be at least 1, `seq_len` at least 8, `max_steps` at least 1"
            )
        if self.draft_vocab < 0:
            raise ConfigError("`draft_vocab` must be 0 (the whole vocabulary) or a token count")
        if self.held_out_windows < 1 or self.eval_every < 1 or self.self_generate < 0:
            raise ConfigError("`held_out_windows` and `eval_every` must be at least 1, `self_generate` not negative")
        rates = (self.learning_rate, self.acceptance_temperature, self.self_temperature)
        if not all(0 < rate < math.inf for rate in rates):
            raise ConfigError("the learning rate and temperatures must be positive finite numbers")
        trained_on = {*(text for name in self.builtin for text in shared_texts(name)), *map(text_file_key, self.data)}
        for name in self.held_out_text:
            if name not in BUILTIN_NAMES and not Path(name).expanduser().is_file():
                raise ConfigError(
                    f"`held_out_text` {name} is neither a file nor a built-in text ({', '.join(BUILTIN_NAMES)})"
                )
            if (shared_texts(name) if name in BUILTIN_NAMES else {text_file_key(name)}) & trained_on:
                raise ConfigError(
                    f"`held_out_text` {name} is also training text: hold out text the drafter does not see"
                )
        if self.save_dtype not in SAVE_DTYPES:
            raise ConfigError(f"unknown `save_dtype` '{self.save_dtype}' (choose from {', '.join(SAVE_DTYPES)})")


def text_file_key(path: str) -> str:
    """One spelling of a text file's path, to tell whether two flags name the same file."""
    return str(Path(path).expanduser().resolve())


@dataclass
class DistillProgress:
    phase: str  # 'self-generate', 'teacher' or 'train'
    done: int
    total: int
    loss: float | None = None
    acceptance: float | None = None  # held-out, at the acceptance temperature
    greedy_acceptance: float | None = None  # held-out argmax agreement


@dataclass
class DistillResult:
    folder: Path
    steps: int
    tokens: int  # training tokens seen
    seconds: float
    history: list[dict] = field(default_factory=list)  # one entry per evaluation
    finished: bool = False  # max_steps reached
    interrupted: bool = False  # stopped by Ctrl-C (neither finished nor interrupted: by the time limit)


def load_teacher(
    spec: str | None, status: StatusCallback | None = None
) -> tuple[Checkpoint, PreTrainedModel, PreTrainedTokenizerBase]:
    """The target (None: the embedded default) as a float32 transformers model, with its tokenizer."""
    checkpoint = resolve_checkpoint(spec, status)
    try:
        teacher = load_hf_model(str(checkpoint.folder), torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint.folder, trust_remote_code=False)
        ModelConfig.from_hf(teacher.config)
    except (ValueError, OSError, StrictDataclassError) as err:
        raise ModelLoadError(f"cannot load {checkpoint.name} as a transformers model: {config_refusal(err)}") from None
    except UnsupportedModelError as err:
        raise ModelLoadError(f"{checkpoint.name}: {err}") from None
    return checkpoint, teacher.eval(), tokenizer


def topk_distillation_loss(
    draft_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor
) -> torch.Tensor:
    """HASS top-K loss: mean over positions of -sum_k p(x_k) log q(x_k), x_k the target's top-K tokens.

    draft_logits (B, L, V'); teacher_ids (B, L, K) index its last dimension, and negative ids (tokens the
    drafter cannot propose) are left out; teacher_logp (B, L, K).
    """
    draft_logp = torch.log_softmax(draft_logits.float(), dim=-1)
    picked = draft_logp.gather(-1, teacher_ids.long().clamp_min(0))  # (B, L, K)
    weights = teacher_logp.float().exp() * (teacher_ids >= 0)
    return -(weights * picked).sum(dim=-1).mean()


def frequent_tokens(windows: torch.Tensor, vocab_size: int, count: int, always: set[int]) -> torch.Tensor:
    """The count most frequent token ids of windows (ties to the lower id), with the always ids, sorted."""
    frequency = torch.bincount(windows.flatten(), minlength=vocab_size).float()
    frequency[list(always)] = math.inf
    return frequency.topk(min(count, vocab_size), sorted=False).indices.sort().values


def drafter_config(target_config: PretrainedConfig, init_layers: tuple[int, ...]) -> PretrainedConfig:
    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers = len(init_layers)
    layer_types = getattr(target_config, "layer_types", None)
    if layer_types:
        config.layer_types = [layer_types[i] for i in init_layers]
    return config


def build_drafter(
    teacher: PreTrainedModel, init_layers: tuple[int, ...], output_ids: torch.Tensor | None = None
) -> PreTrainedModel:
    """The target's architecture with len(init_layers) layers copied from it, sharing its frozen embeddings.

    With output_ids (V',) its output layer is the target's rows for those tokens: logits (B, L, V').
    """
    drafter = AutoModelForCausalLM.from_config(drafter_config(teacher.config, init_layers))
    for index, source in enumerate(init_layers):
        drafter.model.layers[index].load_state_dict(teacher.model.layers[source].state_dict())
    drafter.model.norm.load_state_dict(teacher.model.norm.state_dict())
    drafter.model.embed_tokens = teacher.model.embed_tokens
    drafter.lm_head = teacher.lm_head
    if output_ids is not None:
        drafter.lm_head = torch.nn.Linear(teacher.config.hidden_size, len(output_ids), bias=False)
        drafter.lm_head.weight = torch.nn.Parameter(teacher.lm_head.weight[output_ids].detach().clone())
    for name in SHARED_WEIGHTS:
        drafter.get_parameter(name).requires_grad_(False)
    return drafter


@dataclass(frozen=True)
class DrafterStart:
    """The trained weights (without the borrowed embeddings) and output vocabulary of an earlier drafter."""

    weights: dict[str, torch.Tensor]
    output_ids: torch.Tensor | None


def read_drafter_start(config: DistillConfig, target: Checkpoint, vocab_size: int) -> DrafterStart:
    """The drafter folder config.init_from, checked against the target and the drafter shape config asks for."""
    folder = Path(config.init_from)
    name = f"`init_from` {folder}"
    try:
        settings = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"{name}: no readable config.json there") from None
    metadata = settings.get(DRAFTER_METADATA) or {}
    recorded = ("target", "embedding_sha256", "distill")
    if not all(key in metadata for key in recorded) or not (folder / "model.safetensors").is_file():
        raise ConfigError(f"{name} is not a drafter folder written by triforce distill")
    if metadata["embedding_sha256"] != embedding_digest(target.weight_files):
        raise ConfigError(
            f"{name} was distilled for {metadata['target']}; its embeddings are not those of {target.name}"
        )
    layers = tuple(metadata["distill"].get("init_layers", ()))
    if layers != config.init_layers:
        named = ",".join(map(str, layers))
        raise ConfigError(f"{name} started from target layers {named}; pass `init_layers` {named}")
    output_ids = metadata.get("output_ids")
    covered = len(output_ids) if output_ids else 0
    if covered != (config.draft_vocab if config.draft_vocab < vocab_size else 0):
        raise ConfigError(f"{name} covers {covered or 'all'} output tokens; pass `draft_vocab` {covered}")
    weights = {key: tensor.float() for key, tensor in load_file(folder / "model.safetensors").items()}
    return DrafterStart(weights, torch.tensor(output_ids) if output_ids else None)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write a checkpoint's state (what Distiller._save_checkpoint gathers) to one safetensors file: drafter weights,
    optimizer tensors and output ids as tensors, everything else as its JSON record."""
    tensors = {f"drafter.{name}": tensor for name, tensor in state["drafter"].items()}
    if state["output_ids"] is not None:
        tensors["output_ids"] = state["output_ids"]
    record = {key: state[key] for key in ("config", "step", "seconds", "history")}
    record["optimizer"] = None
    if state["optimizer"] is not None:
        per_parameter = {}
        for index, values in state["optimizer"]["state"].items():
            per_parameter[str(index)] = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
            tensors |= {f"optimizer.{index}.{k}": v for k, v in values.items() if isinstance(v, torch.Tensor)}
        record["optimizer"] = {"param_groups": state["optimizer"]["param_groups"], "state": per_parameter}
    save_tensors(path, tensors, record)


def read_checkpoint(path: Path) -> dict:
    """The state save_checkpoint wrote to path, as it was given; a ConfigError for any other file."""
    remedy = "start again with a new `out`"
    tensors, record = load_tensors(path, remedy)
    try:
        state = {key: record[key] for key in ("config", "step", "seconds", "history")}
        state["drafter"] = {
            name.removeprefix("drafter."): tensor for name, tensor in tensors.items() if name.startswith("drafter.")
        }
        state["output_ids"] = tensors.get("output_ids")
        state["optimizer"] = None
        if record["optimizer"] is not None:
            per_parameter = {int(index): values for index, values in record["optimizer"]["state"].items()}
            for name, tensor in tensors.items():
                if name.startswith("optimizer."):
                    _, index, key = name.split(".", 2)
                    per_parameter[int(index)][key] = tensor
            groups = [
                {
                    key: tuple(value) if isinstance(value, list) and key != "params" else value
                    for key, value in group.items()
                }
                for group in record["optimizer"]["param_groups"]
            ]  # JSON turned tuples (AdamW's betas) into lists
            state["optimizer"] = {"state": per_parameter, "param_groups": groups}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"{path} is not a checkpoint triforce distill wrote: {remedy}") from None
    return state


def learning_rate(config: DistillConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth over max_steps."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class Distiller:
    """One distillation run into an output folder, resumable from the checkpoint it keeps there."""

    @property
    def teacher_identity(self) -> str:
        """The target's config and weight files by content (store.content_identity): what the saved top-K of
        another target never matches."""
        digest = hashlib.sha256((self.target.folder / "config.json").read_bytes())
        for path in self.target.weight_files:
            digest.update(content_identity(path).encode())
        return digest.hexdigest()

    def __init__(
        self,
        config: DistillConfig,
        teacher: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        target: Checkpoint,
        out: Path,
        resume: bool = False,
    ):
        if config.top_k > teacher.config.vocab_size:
            raise ConfigError(f"`top_k` {config.top_k} is more than the target's {teacher.config.vocab_size} tokens")
        self.config = config
        self.teacher = teacher.eval()
        self.tokenizer = tokenizer
        self.target = target
        self.out = out
        self.work = out / WORK_FOLDER
        checkpoint_path = out / CHECKPOINT_NAME
        if (out / PICKLED_CHECKPOINT_NAME).is_file() and not checkpoint_path.is_file():
            raise ConfigError(
                f"{out} holds a {PICKLED_CHECKPOINT_NAME} written in an older format that cannot be read safely: "
                "start again with a new `out`"
            )
        if checkpoint_path.is_file() and not resume:
            raise ConfigError(f"{out} holds an unfinished distillation: pass `resume`, or choose another `out`")
        if resume and not checkpoint_path.is_file():
            raise ConfigError(f"nothing to resume: {out} has no {CHECKPOINT_NAME}")
        available = teacher.config.num_hidden_layers
        if max(config.init_layers) >= available:
            raise ConfigError(f"`init_layers` names layer {max(config.init_layers)}, but the target has {available}")
        self.work.mkdir(parents=True, exist_ok=True)
        self.checkpoint = read_checkpoint(checkpoint_path) if resume else None
        # compared as the checkpoint's JSON record holds the settings: tuples as lists
        if self.checkpoint is not None and self.checkpoint["config"] != json.loads(json.dumps(asdict(config))):
            raise ConfigError(f"{out} was started with other settings; resume with the same flags")
        self.start: DrafterStart | None = None  # read only before training: a checkpoint has what it gave
        if config.init_from and not self._resumes_training:
            self.start = read_drafter_start(config, target, teacher.config.vocab_size)
        self.drafter: PreTrainedModel | None = None  # built once the data (and so the draft vocabulary) is known
        self.optimizer: torch.optim.Optimizer | None = None
        self.output_ids: torch.Tensor | None = None
        self.step = 0
        self.seconds = 0.0  # training time of earlier runs of this checkpoint
        self.history: list[dict] = []
        self._started = time.monotonic()

    @property
    def _resumes_training(self) -> bool:
        """Whether a checkpoint with trained steps is resumed: it then holds the weights and the vocabulary."""
        return self.checkpoint is not None and bool(self.checkpoint["step"])

    def _windows(self, on_progress: Callable[[DistillProgress], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Training and held-out windows (N, L); held-out ones are real text only, from --held-out where given."""
        cfg = self.config
        real = text_windows(self.tokenizer, training_texts(cfg.data, cfg.builtin), cfg.seq_len)
        generator = torch.Generator().manual_seed(cfg.seed)
        if cfg.held_out_text:
            texts = held_out_texts(cfg.held_out_text)
            pool = text_windows(self.tokenizer, texts, cfg.seq_len, minimum=1, kind="held-out")
            held_out = pool[torch.randperm(len(pool), generator=generator)[: cfg.held_out_windows]]
            train = real[torch.randperm(len(real), generator=generator)]  # shuffled, as --self-generate seeds
        else:
            order = torch.randperm(len(real), generator=generator)
            held = min(cfg.held_out_windows, len(real) // 2)
            held_out, train = real[order[:held]], real[order[held:]]
        if cfg.self_generate:
            path = self.work / "self-generated.safetensors"
            saved = load_tensors(path, "delete it to compute it again")[0].get("windows") if path.is_file() else None
            if saved is None or saved.shape != (cfg.self_generate, cfg.seq_len):
                torch.manual_seed(cfg.seed)
                seeds = train[torch.arange(cfg.self_generate) % len(train)]
                saved = self_generated_windows(
                    self.teacher, seeds, cfg.seq_len, cfg.self_temperature, cfg.batch_size,
                    lambda done, total: on_progress(DistillProgress("self-generate", done, total)),
                )  # fmt: skip
                save_tensors(path, {"windows": saved}, {})
            train = torch.cat([train, saved])
        return train, held_out

    def _build(self, train: torch.Tensor) -> None:
        """The drafter and optimizer, restored from the checkpoint when resuming."""
        cfg = self.config
        vocab_size = self.teacher.config.vocab_size
        if self._resumes_training:
            self.output_ids = self.checkpoint["output_ids"]  # whatever --init-from holds by now
        elif self.start is not None:
            self.output_ids = self.start.output_ids
        elif 0 < cfg.draft_vocab < vocab_size:
            always = token_id_set(self.teacher.generation_config.eos_token_id)
            self.output_ids = frequent_tokens(train, vocab_size, cfg.draft_vocab, always)
        torch.manual_seed(cfg.seed)
        self.drafter = build_drafter(self.teacher, cfg.init_layers, self.output_ids)
        if self.start is not None:
            try:
                loaded = self.drafter.load_state_dict(self.start.weights, strict=False)
            except RuntimeError:  # a tensor of another shape
                loaded = None
            if loaded is None or loaded.unexpected_keys or set(loaded.missing_keys) - set(SHARED_WEIGHTS):
                raise ConfigError(f"`init_from` {cfg.init_from}: its weights do not fit a drafter of this target")
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=0.0)
        if self._resumes_training:
            self.drafter.load_state_dict(self.checkpoint["drafter"], strict=False)
            self.optimizer.load_state_dict(self.checkpoint["optimizer"])
            self.step, self.seconds, self.history = (
                self.checkpoint["step"], self.checkpoint["seconds"], self.checkpoint["history"]
            )  # fmt: skip

    @torch.inference_mode()
    def evaluate(
        self, held_out: torch.Tensor, target_probs: torch.Tensor, target_argmax: torch.Tensor
    ) -> tuple[float, float]:
        """Held-out (acceptance at the acceptance temperature, greedy agreement) of the drafter's next tokens."""
        self.drafter.eval()
        logits = self.drafter(held_out).logits.flatten(0, 1)  # (N * L, V')
        self.drafter.train()
        if self.output_ids is not None:
            logits = spread_over_vocabulary(logits, self.output_ids, self.teacher.config.vocab_size)  # (N * L, V)
        sampling = SamplingConfig(temperature=self.config.acceptance_temperature)
        accept = acceptance_probability(target_probs, probabilities(logits, sampling)).mean()
        greedy = (logits.argmax(dim=-1) == target_argmax).float().mean()
        return float(accept), float(greedy)

    def run(self, on_progress: Callable[[DistillProgress], None], max_minutes: float | None = None) -> DistillResult:
        """Prepare data, then train until max_steps or the time limit; checkpoint and write the drafter."""
        cfg = self.config
        self._started = time.monotonic()
        deadline = self._started + 60 * max_minutes if max_minutes is not None else math.inf
        train, held_out = self._windows(on_progress)
        targets = TeacherTargets(train, cfg.top_k, self.work / "teacher-top-k.safetensors", self.teacher_identity)
        targets.fill(
            self.teacher, cfg.batch_size, lambda done, total: on_progress(DistillProgress("teacher", done, total)),
            deadline=deadline,
        )  # fmt: skip
        if not targets.complete:
            return self.stop()
        self._build(train)
        teacher_ids = targets.ids.long()  # (N, L, K) in the full vocabulary
        if self.output_ids is not None:
            position = torch.full((self.teacher.config.vocab_size,), -1, dtype=torch.long)
            position[self.output_ids] = torch.arange(len(self.output_ids))
            teacher_ids = position[teacher_ids]  # positions in the drafter's output, -1 where it has none
        with torch.inference_mode():
            logits = self.teacher(held_out).logits.flatten(0, 1)  # (N * L, V)
            target_probs = probabilities(logits, SamplingConfig(temperature=cfg.acceptance_temperature))
            target_argmax = logits.argmax(dim=-1)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + 1))
        self.drafter.train()
        while self.step < cfg.max_steps and time.monotonic() < deadline:
            picked = order[(torch.arange(cfg.batch_size) + self.step * cfg.batch_size) % len(train)]
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, self.step)
            logits = self.drafter(train[picked]).logits  # (B, L, V')
            loss = topk_distillation_loss(logits, teacher_ids[picked], targets.logp[picked])
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in self.drafter.parameters() if p.requires_grad], 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            progress = DistillProgress("train", self.step, cfg.max_steps, float(loss.detach()))
            if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                progress.acceptance, progress.greedy_acceptance = self.evaluate(held_out, target_probs, target_argmax)
                self.history.append(
                    {"step": self.step, "loss": progress.loss, "acceptance": progress.acceptance,
                     "greedy_acceptance": progress.greedy_acceptance}
                )  # fmt: skip
                if self.step < cfg.max_steps:
                    self._save_checkpoint()
            on_progress(progress)
        return self.stop()

    def _save_checkpoint(self) -> None:
        """Write what --resume needs to continue as if uninterrupted: weights, optimizer, vocabulary, progress."""
        trained = {}
        if self.drafter is not None:
            trained = {k: v for k, v in self.drafter.state_dict().items() if k not in SHARED_WEIGHTS}
        state = {
            "config": asdict(self.config),
            "drafter": trained,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "output_ids": self.output_ids,
            "step": self.step,
            "seconds": self.seconds + time.monotonic() - self._started,
            "history": self.history,
        }
        save_checkpoint(self.out / CHECKPOINT_NAME, state)

    def stop(self, interrupted: bool = False) -> DistillResult:
        """Write the drafter trained so far and report; keep a checkpoint until max_steps is reached."""
        seconds = self.seconds + time.monotonic() - self._started
        finished = self.step >= self.config.max_steps
        if finished:
            (self.out / CHECKPOINT_NAME).unlink(missing_ok=True)
        else:
            self._save_checkpoint()
        if self.step:
            self.export(seconds)
        tokens = self.step * self.config.batch_size * self.config.seq_len
        return DistillResult(self.out, self.step, tokens, seconds, self.history, finished, interrupted)

    def export(self, seconds: float) -> None:
        """Write config, trained weights (without the borrowed embeddings) and tokenizer: a --draft folder."""
        dtype = SAVE_DTYPES[self.config.save_dtype]
        tensors = {
            name: tensor.detach().to(dtype).contiguous()
            for name, tensor in self.drafter.state_dict().items()
            if name not in SHARED_WEIGHTS
        }
        save_file(tensors, self.out / "model.safetensors")
        config = drafter_config(self.teacher.config, self.config.init_layers)
        start = Path(self.config.init_from).resolve().name if self.config.init_from else None
        metadata = {
            "target": self.target.name,
            "embedding_sha256": embedding_digest(self.target.weight_files),
            "steps": self.step,
            "seconds": round(seconds, 1),
            "distill": asdict(self.config)
            | {
                "data": [Path(f).name for f in self.config.data],
                "init_from": start,
                "held_out_text": [Path(name).name for name in self.config.held_out_text],
            },
            "held_out": self.history[-1] if self.history else None,
        }
        if self.output_ids is not None:
            metadata["output_ids"] = self.output_ids.tolist()
        setattr(config, DRAFTER_METADATA, metadata)
        config.save_pretrained(self.out)
        self.tokenizer.save_pretrained(self.out)
