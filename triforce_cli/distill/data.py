"""Training data for `triforce distill`: token windows from text files or the target's own samples, and the
target's top-K next-token distributions over them, computed once and kept on disk so a run can resume.

What a run keeps on disk is safetensors, tensors beside one JSON record in the file's metadata: reading it runs
no code, unlike a pickle.
"""

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from triforce_cli.corpus import BUILTIN_NAMES, builtin_document
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.prompts import read_prompt
from triforce_cli.runtime.store import write_atomically

ProgressCallback = Callable[[int, int], None]  # (done, total)
RECORD_KEY = "triforce_distill"  # the safetensors metadata entry holding a saved file's JSON record


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], record: dict) -> None:
    """Write tensors and a JSON record to a new file, then move it to path: an interrupted write keeps the last."""
    contiguous = {name: tensor.contiguous() for name, tensor in tensors.items()}
    write_atomically(path, lambda partial: save_file(contiguous, partial, metadata={RECORD_KEY: json.dumps(record)}))


def load_tensors(path: Path, remedy: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and JSON record save_tensors wrote to path; a ConfigError ending in remedy for any other file."""
    try:
        with safe_open(path, "pt") as file:
            record = json.loads((file.metadata() or {})[RECORD_KEY])
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118 (not iterable)
    except (SafetensorError, OSError, ValueError, KeyError):
        record = None
    if not isinstance(record, dict):
        raise ConfigError(f"{path} is not a file triforce distill wrote: {remedy}")
    return tensors, record


def training_texts(files: tuple[str, ...], builtin: tuple[str, ...]) -> list[str]:
    """The text of each named file and built-in document (see corpus.py)."""
    unknown = [name for name in builtin if name not in BUILTIN_NAMES]
    if unknown:
        raise ConfigError(f"unknown built-in text '{unknown[0]}' (choose from {', '.join(BUILTIN_NAMES)})")
    return [read_prompt(file) for file in files] + [builtin_document(name) for name in builtin]


def held_out_texts(names: tuple[str, ...]) -> list[str]:
    """The text of each --held-out entry: a built-in document's name (see corpus.py) or a file."""
    return [builtin_document(name) if name in BUILTIN_NAMES else read_prompt(name) for name in names]


def text_windows(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], seq_len: int, minimum: int = 2, kind: str = "training"
) -> torch.Tensor:
    """The texts' tokens, each text followed by EOS, cut into non-overlapping windows: (N, seq_len), N >= minimum."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text).input_ids
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    count = len(ids) // seq_len
    if count < minimum:
        raise ConfigError(
            f"the {kind} text has {len(ids)} tokens: at least {minimum * seq_len} are needed for `seq_len` {seq_len}"
        )
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


@torch.inference_mode()
def self_generated_windows(
    teacher: PreTrainedModel,
    seeds: torch.Tensor,
    seq_len: int,
    temperature: float,
    batch_size: int,
    on_progress: ProgressCallback | None = None,
) -> torch.Tensor:
    """Windows the target writes itself: each seed's first quarter, continued by sampling: (N, seq_len)."""
    prefix = max(1, seq_len // 4)
    windows = []
    for start in range(0, len(seeds), batch_size):
        prompts = seeds[start : start + batch_size, :prefix]
        out = teacher.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=seq_len - prefix,
            min_new_tokens=seq_len - prefix,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            pad_token_id=teacher.generation_config.eos_token_id,
        )
        windows.append(out[:, :seq_len])
        if on_progress is not None:
            on_progress(min(start + batch_size, len(seeds)), len(seeds))
    return torch.cat(windows)


class TeacherTargets:
    """The target's top-K next-token ids and log-probabilities for every window position.

    Filled batch by batch and saved every SAVE_SECONDS and on leaving fill, so an interrupted run picks up where
    it stopped. Each save rewrites the whole file, tens of MB for a few MB of text: a save per batch would spend
    more time writing than computing.
    """

    SAVE_SECONDS = 60.0

    def __init__(self, windows: torch.Tensor, top_k: int, path: Path, teacher: str):
        """teacher: an identity of the target (Distiller.teacher_identity); a file another target filled is computed
        again, never trained on."""
        self.windows = windows  # (N, L)
        self.top_k = top_k
        self.path = path
        self.teacher = teacher
        n, length = windows.shape
        saved, record = load_tensors(path, "delete it to compute it again") if path.is_file() else ({}, {})
        if (
            saved.keys() == {"windows", "ids", "logp"}
            and record.get("teacher") == teacher
            and isinstance(record.get("done"), int)
            and 0 <= record["done"] <= n
            and torch.equal(saved["windows"], windows)
            and saved["ids"].shape == saved["logp"].shape == (n, length, top_k)
        ):
            self.ids, self.logp, self.done = saved["ids"], saved["logp"], record["done"]
        else:
            self.ids = torch.zeros(n, length, top_k, dtype=torch.int32)  # (N, L, K)
            self.logp = torch.zeros(n, length, top_k, dtype=torch.float16)  # (N, L, K)
            self.done = 0

    @property
    def complete(self) -> bool:
        return self.done == len(self.windows)

    @torch.inference_mode()
    def fill(
        self,
        teacher: PreTrainedModel,
        batch_size: int,
        on_progress: ProgressCallback | None = None,
        deadline: float = math.inf,
    ) -> None:
        """Compute the missing batches, stopping early (saved) once time.monotonic() passes deadline."""
        saved_done, saved_at = self.done, time.monotonic()
        try:
            while not self.complete and time.monotonic() < deadline:
                batch = self.windows[self.done : self.done + batch_size]
                logp = torch.log_softmax(teacher(batch).logits.float(), dim=-1)  # (B, L, V)
                top_logp, top_ids = logp.topk(self.top_k, dim=-1)
                end = self.done + len(batch)
                self.ids[self.done : end] = top_ids.to(torch.int32)
                self.logp[self.done : end] = top_logp.to(torch.float16)
                self.done = end
                if time.monotonic() - saved_at >= self.SAVE_SECONDS:
                    self._save()
                    saved_done, saved_at = self.done, time.monotonic()
                if on_progress is not None:
                    on_progress(self.done, len(self.windows))
        finally:  # also on Ctrl-C: the batches done so far are kept
            if self.done != saved_done:
                self._save()

    def _save(self) -> None:
        """Write the file whole, so that a second Ctrl-C while writing leaves the last save in place."""
        tensors = {"windows": self.windows, "ids": self.ids, "logp": self.logp}
        save_tensors(self.path, tensors, {"done": self.done, "teacher": self.teacher})
