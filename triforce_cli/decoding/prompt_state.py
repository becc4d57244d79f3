"""A prefilled prompt that can be reused: the full KV cache, the last queries and the next-token logits.

Prefill of a long prompt dominates end-to-end time on a CPU, so ``Engine.prefill`` captures it once; every mode
of a benchmark, every repeat, and later runs through ``--prompt-cache`` restore it instead of recomputing.
Files are safetensors, named by a hash of the model's source, dtype, weight format and rotary setting and the
prompt's token ids.
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cache import FullCache
from kernels import PackedPrefix
from triforce_cli.errors import PromptError
from triforce_cli.runtime.loading import LoadedModel


@dataclass
class PromptState:
    prompt_ids: torch.Tensor  # (P,)
    keys: torch.Tensor  # (layers, Hkv, P, D)
    values: torch.Tensor  # (layers, Hkv, P, D)
    last_queries: torch.Tensor  # (layers, Hq, D): queries at the last prompt position
    last_logits: torch.Tensor  # (1, V): logits after the last prompt token
    packed: list[PackedPrefix] | None = field(default=None, compare=False, repr=False)  # pack_prefix's, not saved

    @classmethod
    def capture(cls, full: FullCache, prompt_ids: list[int], last_logits: torch.Tensor) -> "PromptState":
        length = full.length
        queries = torch.stack([full.query_at(layer, length - 1) for layer in range(full.keys.shape[0])])
        return cls(
            torch.tensor(prompt_ids, dtype=torch.long),
            full.keys[:, :, :length].clone(),
            full.values[:, :, :length].clone(),
            queries.clone(),
            last_logits.clone(),
        )

    def matches(self, prompt_ids: list[int]) -> bool:
        return self.prompt_ids.tolist() == list(prompt_ids)

    def restore(self, full: FullCache, pack: bool = False) -> None:
        """Put the prompt into a full cache as if it had just been prefilled.

        pack: also give the cache the prompt's packed float16 copy (FullCache.pack_prefix), made on the first
        restore and kept here for the next.
        """
        length = self.keys.shape[2]
        full.reset()
        full.prepare(0, length)
        full.keys[:, :, :length] = self.keys
        full.values[:, :, :length] = self.values
        full.queries = [q[:, None, :] for q in self.last_queries]  # (Hq, 1, D) per layer
        full.query_start = length - 1
        if pack:
            self.packed = full.pack_prefix(self.packed)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        tensors = {name: t for name, t in vars(self).items() if isinstance(t, torch.Tensor)}
        save_file({name: t.contiguous() for name, t in tensors.items()}, partial)
        partial.rename(path)

    @classmethod
    def load(cls, path: Path, device: torch.device | str = "cpu") -> "PromptState":
        try:
            return cls(**load_file(path, device=str(device)))
        except (OSError, SafetensorError, TypeError) as err:
            raise PromptError(f"cannot read prompt cache {path}: {err}") from None


def prompt_cache_file(folder: Path, target: LoadedModel, prompt_ids: list[int]) -> Path:
    """The file in folder for prompt_ids, named by a hash of what decides their keys and values: the checkpoint,
    dtype, weight format, rotary setting (--context-window rescales RoPE at every position) and the token ids."""
    rotary = json.dumps(
        [getattr(target.hf_config, "rope_parameters", None), target.hf_config.max_position_embeddings],
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha256(f"{target.source}|{target.dtype}|{target.weights}|{rotary}|".encode())
    digest.update(torch.tensor(prompt_ids, dtype=torch.long).numpy().tobytes())
    return folder / f"prompt-{digest.hexdigest()[:16]}.safetensors"


def find_prompt_state(folder: Path, target: LoadedModel, prompt_ids: list[int]) -> tuple[Path, PromptState | None]:
    """Where the prefill of prompt_ids by target is kept in folder, and the state saved there, if any."""
    path = prompt_cache_file(folder, target, prompt_ids)
    if not path.is_file():
        return path, None
    state = PromptState.load(path, target.device)
    return path, state if state.matches(prompt_ids) else None
