"""A prefilled prompt that can be reused: the full KV cache, the last queries and the next-token logits.

Prefill of a long prompt dominates end-to-end time on a CPU, so ``Engine.prefill`` captures it once; every mode
of a benchmark, every repeat, and later runs through ``--prompt-cache`` restore it instead of recomputing.

A saved prefill must never serve a run it does not belong to. Its file is named by a hash of everything that
shapes the prefilled state (``PromptCache.key``): the checkpoint's fingerprint (resolved paths, sizes, times and
headers of its files, tokenizer included), dtype and the KV cache's (cache.kv_dtype: the keys and values saved are
the cache's own), weight format, rotary setting (with LongRoPE's set, which the
run's prompt and new tokens choose: Transformer.fit_rope), attention kernel, the CPU extension's build where a CPU
model computes with it (runtime.native.kernel_build: kernels of another order of arithmetic leave other bits),
prefill chunk and the prompt's token ids. The file holds that key in full and a checksum of its tensors; a file
whose key or checksum does not match, whose keys and values are not in the cache's dtype, or that cannot be read
at all, is prefilled again and replaced, with one line saying so.

Under the numeric contract (Engine.exact_positions) a prompt's entry is saved again after its generation with the
answer the full cache holds after it (PromptState.answer_ids), so that the next turn of a conversation keeps it too.
A prompt that only starts like a saved one (the same document, another question) reuses the prefix it shares with
the saved state (Engine's prefix reuse): under the numeric contract the whole shared prefix, which may end inside a
prefill chunk, elsewhere its whole prefill chunks. The saved state is found through an index of block hashes
(``PREFIX_INDEX``): one hash per whole chunk of a saved prompt, each covering the settings and every token id up to
the chunk's end, mapped to the file; the prompt's own block hashes are looked up longest first, so no saved state is
read but the one reused, and the length kept is then the ids' common prefix (Engine.generate), past the chunk the
hashes found. The index is a hint: the file it names is checked (key, checksum, the shared ids) as an exact match
is, and an index that is lost or stale only loses reuse.
"""

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from triforce_cli.cache import FullCache, kv_dtype
from triforce_cli.errors import ConfigError
from triforce_cli.runtime.loading import LoadedModel, StatusCallback
from triforce_cli.runtime.native import kernel_build
from triforce_cli.runtime.store import PARTIAL_SUFFIX, PROMPT_ENTRIES, evict, mark_used, write_atomically

TENSOR_NAMES = ("prompt_ids", "answer_ids", "keys", "values", "last_queries", "last_logits")
PREFIX_INDEX = ".prefix-index.json"  # block hash -> saved file (a dot name: never counted or evicted as an entry)


@dataclass
class PromptState:
    """A prefilled prompt of P tokens, and the A tokens of an answer decoded after it whose keys and values the full
    cache held after the generation (Engine.with_answer; none in a state saved after the prefill). A full cache
    keeping only its window (FullCache.window) holds the last positions alone: keys and values then hold positions
    [first_position, P + A), first_position = P + A - n.

    The logits and queries are the prompt's: restored for the prompt itself (restore), the state serves it whole;
    for a longer prompt that starts with its ids, the answer's positions too (restore with the answer, the longer
    prompt computing its own last positions)."""

    prompt_ids: torch.Tensor  # (P,)
    answer_ids: torch.Tensor  # (A,): answer tokens held after the prompt, each position computed by decoding
    keys: torch.Tensor  # (layers, Hkv, n, D), n <= P + A: positions [P + A - n, P + A)
    values: torch.Tensor  # (layers, Hkv, n, D)
    last_queries: torch.Tensor  # (layers, Hq, D): queries at the last prompt position
    last_logits: torch.Tensor  # (1, V): logits after the last prompt token

    @classmethod
    def capture(cls, full: FullCache, prompt_ids: list[int], last_logits: torch.Tensor) -> "PromptState":
        full.settle()
        _, keys, values = full.held()
        queries = full.queries_at(full.length - 1)
        return cls(
            torch.tensor(prompt_ids, dtype=torch.long),
            torch.zeros(0, dtype=torch.long),
            keys.clone(),
            values.clone(),
            queries.clone(),
            last_logits.clone(),
        )

    @property
    def held_ids(self) -> list[int]:
        """The ids whose positions the state holds: the prompt's, then the answer's."""
        return [*self.prompt_ids.tolist(), *self.answer_ids.tolist()]

    @property
    def first_position(self) -> int:
        """The first position keys and values hold: 0 but for a full cache that kept only its window."""
        return self.prompt_ids.shape[0] + self.answer_ids.shape[0] - self.keys.shape[2]

    def matches(self, prompt_ids: list[int]) -> bool:
        return self.prompt_ids.tolist() == list(prompt_ids)

    def restore(self, full: FullCache, answer: bool = False) -> None:
        """Put the prompt into a full cache as if it had just been prefilled (FullCache.assign: a ValueError where
        it cannot hold what this state holds).

        answer: also the answer's positions, for a longer prompt that goes on from it (the queries of the prompt's
        last position are then not the last forward's: that prompt's prefill computes its own).
        """
        held = self.keys.shape[2] - (0 if answer else self.answer_ids.shape[0])
        full.assign(self.first_position, self.keys[:, :, :held], self.values[:, :, :held])
        if not answer:
            full.queries = [q[:, None, :] for q in self.last_queries]  # (Hq, 1, D) per layer
            full.query_start = full.length - 1

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in TENSOR_NAMES}

    def checksum(self) -> str:
        """SHA-256 of every saved tensor's dtype, shape and bytes."""
        digest = hashlib.sha256()
        for name, tensor in self.tensors.items():
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        return digest.hexdigest()


def check_writable(folder: Path) -> None:
    """A ConfigError now, before minutes of prefill, where nothing can be saved in folder."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=PARTIAL_SUFFIX):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(f"`prompt_cache` {folder} is not a folder that can be written to: {reason}") from None


class StaleEntry(Exception):
    """A saved prefill that cannot serve this run; the message says why."""


@dataclass
class PromptCache:
    """Saved prefills of one target in a folder, each checked against its key and checksum before use.

    status: where the one-line notes go (a replaced entry, a save that failed).
    new_tokens: the run's max_new_tokens, which with the prompt's length choose a LongRoPE model's frequencies.
    """

    folder: Path
    target: LoadedModel
    status: StatusCallback | None = None
    prefill_chunk: int | None = None  # tokens per prefill forward (the rounding of the state depends on it)
    new_tokens: int = 0

    def _settings(self, prompt_tokens: int) -> dict:
        """Everything but the prompt's ids that shapes a prefilled state for a run after prompt_tokens tokens: its
        LongRoPE set (Transformer.fit_rope) among them, so a state rotated with one never serves a run of the other."""
        target = self.target
        config = target.hf_config
        rope_factors = target.model.rope_factors_for(prompt_tokens + self.new_tokens)
        return {
            "model": target.fingerprint,
            "dtype": str(target.dtype),
            "kv_dtype": str(kv_dtype(target.device, target.dtype)),
            "weights": target.weights,
            "rotary": [getattr(config, "rope_parameters", None), config.max_position_embeddings, rope_factors],
            "attention": target.model.attention_backend,
            "kernels": kernel_build() if target.device.type == "cpu" else None,
            "prefill_chunk": self.prefill_chunk,
        }

    def key(self, prompt_ids: list[int], run_tokens: int | None = None) -> str:
        """Everything that shapes the prefilled state of prompt_ids, as one JSON string; run_tokens: the prompt
        length of the run it serves (a longer prompt starting with prompt_ids), None: prompt_ids' own."""
        prompt = hashlib.sha256(_id_bytes(prompt_ids)).hexdigest()
        settings = self._settings(len(prompt_ids) if run_tokens is None else run_tokens)
        return json.dumps({**settings, "prompt": prompt}, sort_keys=True, default=str)

    def block_hashes(self, prompt_ids: list[int], limit: int) -> list[tuple[int, str]]:
        """(end, hash) of each whole prefill chunk of prompt_ids ending at or before limit, in order: the hash of the
        chunk ending at `end` covers the settings of a run after prompt_ids and ids [0, end), so two prompts share it
        exactly where they share those ids under the same settings. None without a known prefill chunk."""
        chunk = self.prefill_chunk
        if not chunk:
            return []
        settings = self._settings(len(prompt_ids))
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        found = []
        for end in range(chunk, min(limit, len(prompt_ids)) + 1, chunk):
            digest.update(_id_bytes(prompt_ids[end - chunk : end]))
            found.append((end, digest.copy().hexdigest()[:32]))
        return found

    def path_for(self, prompt_ids: list[int]) -> Path:
        return self._path(self.key(prompt_ids))

    def _path(self, key: str) -> Path:
        return self.folder / PROMPT_ENTRIES.replace("*", hashlib.sha256(key.encode()).hexdigest()[:24])

    def load(self, prompt_ids: list[int]) -> PromptState | None:
        """The saved prefill of prompt_ids, or None; an entry that does not match is removed with a note."""
        key = self.key(prompt_ids)
        path = self._path(key)
        if not path.is_file():
            return None
        return self._checked(path, key, prompt_ids, "prefilling again and replacing it")

    def load_longest_prefix(self, prompt_ids: list[int]) -> PromptState | None:
        """The saved prefill sharing the most whole prefill chunks with prompt_ids short of its last token (whose
        logits a prefill computes), found through the block hash index; None where none shares a chunk. It may share
        more than those chunks: the engine keeps the ids' whole common prefix where it computes under the numeric
        contract (Engine.restore, then generate). A file that does not pass the checks of load is removed with a
        note, and the prompt is prefilled whole."""
        index = self._read_index()
        for end, digest in reversed(self.block_hashes(prompt_ids, len(prompt_ids) - 1)):
            name = index.get(digest)
            path = self.folder / name if isinstance(name, str) and "/" not in name else None
            if path is not None and path.is_file():
                return self._checked(path, None, prompt_ids[:end], "prefilling the prompt whole", len(prompt_ids))
        return None

    def _checked(
        self, path: Path, key: str | None, prompt_ids: list[int], instead: str, run_tokens: int | None = None
    ) -> PromptState | None:
        """The state saved in path where it passes _read's checks, marked used; else None, the file removed and a
        note saying why and what happens instead."""
        try:
            state = self._read(path, key, prompt_ids, run_tokens)
        except StaleEntry as reason:
            self._note(f"prompt cache entry {path.name} {reason}: {instead}")
            path.unlink(missing_ok=True)
            return None
        mark_used(path)
        return state

    def _read_index(self) -> dict[str, str]:
        try:
            index = json.loads((self.folder / PREFIX_INDEX).read_text())
        except (OSError, ValueError):
            return {}
        return index if isinstance(index, dict) else {}

    def _index(self, path: Path, prompt_ids: list[int]) -> None:
        """Enter every whole chunk of prompt_ids (the ids a state holds) in the block hash index as held by path;
        entries of files that are gone are dropped. Two saves at once may lose one's entries: a lost entry only
        loses reuse."""
        index = {digest: name for digest, name in self._read_index().items() if (self.folder / str(name)).is_file()}
        index.update({digest: path.name for _, digest in self.block_hashes(prompt_ids, len(prompt_ids))})
        write_atomically(self.folder / PREFIX_INDEX, lambda partial: partial.write_text(json.dumps(index)))

    def _read(self, path: Path, key: str | None, prompt_ids: list[int], run_tokens: int | None = None) -> PromptState:
        """The state saved in path, checked against key (None: the key of the ids it holds for a run after
        run_tokens, see key) and its checksum; it must hold prompt_ids or (key None) start with them."""
        state, metadata = _read_file(path)
        saved_ids = state.prompt_ids.tolist()
        if metadata.get("key") != (self.key(saved_ids, run_tokens) if key is None else key):
            raise StaleEntry("was saved for another model, setting or prompt")
        if metadata.get("checksum") != state.checksum():
            raise StaleEntry("was changed after it was saved (its checksum does not match)")
        self._check_shapes(state)
        kv = kv_dtype(self.target.device, self.target.dtype)
        if state.keys.dtype != kv or state.values.dtype != kv:
            raise StaleEntry(f"holds keys and values in {state.keys.dtype}, where the cache holds {kv}")
        held = state.held_ids if key is None else saved_ids  # a prefix may go on into the answer
        if held[: len(prompt_ids)] != list(prompt_ids) or (key is not None and len(saved_ids) != len(prompt_ids)):
            raise StaleEntry("holds another prompt than its index says")
        return state

    def save(self, state: PromptState, prompt_ids: list[int]) -> bool:
        """Save state for prompt_ids (replacing the entry of the same prompt: its prefill, saved again with the
        answer after the generation), then evict the least recently used entries over the cache limit; every whole
        chunk of the ids it holds, the answer's included, enters the index. A save that fails is a note, never an
        error: the generation it belongs to goes on. Returns whether it was saved."""
        key = self.key(prompt_ids)
        path = self._path(key)
        tensors = {name: t.contiguous() for name, t in state.tensors.items()}
        metadata = {"key": key, "checksum": state.checksum()}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda partial: save_file(tensors, partial, metadata=metadata))
            self._index(path, state.held_ids)
        except (OSError, SafetensorError) as err:
            self._note(f"could not save the prefill to `prompt_cache` {self.folder} ({err}); generating on")
            return False
        evict(self.folder, keep=path, names=PROMPT_ENTRIES)
        return True

    def write_file(self, path: Path, state: PromptState, extra: dict[str, str]) -> None:
        """Write state to path, outside the folder's entries, keyed as save keys an entry (key: the ids it holds)
        and with extra metadata beside the key and checksum; an OSError or SafetensorError where it cannot."""
        metadata = {**extra, "key": self.key(state.prompt_ids.tolist()), "checksum": state.checksum()}
        tensors = {name: t.contiguous() for name, t in state.tensors.items()}
        write_atomically(path, lambda partial: save_file(tensors, partial, metadata=metadata))

    def read_file(self, path: Path) -> tuple[PromptState, dict[str, str]]:
        """The state write_file wrote to path and its metadata, checked against the key of the ids it holds under
        this cache's settings and against its checksum; a StaleEntry saying why it cannot serve this run."""
        state, metadata = _read_file(path)
        if metadata.get("key") != self.key(state.prompt_ids.tolist()):
            raise StaleEntry("was saved for another model or setting")
        if metadata.get("checksum") != state.checksum():
            raise StaleEntry("was changed after it was saved (its checksum does not match)")
        self._check_shapes(state, outputs_kept=False)
        return state, metadata

    def _check_shapes(self, state: PromptState, outputs_kept: bool = True) -> None:
        """A StaleEntry where the tensors are not of the shapes this target's forward makes (a file written by hand
        with a checksum of its own): the layers, the head size, the held positions, the logits' width.
        outputs_kept False: the last queries and logits may also be empty (a conversation's state, write_file)."""
        config = self.target.model.config
        keys, queries, logits = state.keys, state.last_queries, state.last_logits
        outputs = (
            queries.dim() == 3
            and (queries.shape[0], queries.shape[2]) == (config.num_layers, config.head_dim)
            and tuple(logits.shape) == (1, config.vocab_size)
        ) or (not outputs_kept and queries.numel() == logits.numel() == 0)
        if (
            not outputs
            or state.prompt_ids.dim() != 1
            or state.answer_ids.dim() != 1
            or keys.dim() != 4
            or keys.shape != state.values.shape
            or (keys.shape[0], keys.shape[3]) != (config.num_layers, config.head_dim)
            or not 1 <= keys.shape[2] <= len(state.held_ids)
        ):
            raise StaleEntry("holds tensors of other shapes than this model's forward makes")

    def _note(self, message: str) -> None:
        if self.status is not None:
            self.status(message)


def _read_file(path: Path) -> tuple[PromptState, dict[str, str]]:
    """The state saved in path and its metadata, unchecked; a StaleEntry where it cannot be read or lacks a tensor."""
    try:
        # read and checked in host memory: restore copies the keys and values to wherever the run's cache lives
        # (the GPU, or host memory when it is offloaded), so nothing crosses to the device only to come back
        with safe_open(path, framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (OSError, SafetensorError, ValueError, RuntimeError) as err:
        raise StaleEntry(f"cannot be read ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    if set(tensors) != set(TENSOR_NAMES):
        raise StaleEntry("lacks some of its tensors")
    return PromptState(**tensors), metadata


def _id_bytes(ids: list[int]) -> bytes:
    return torch.tensor(ids, dtype=torch.long).numpy().tobytes()
