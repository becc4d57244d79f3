"""The folders the tool writes to: converted checkpoints and saved prefills, kept under a size limit.

The cache root is ``$TRIFORCE_CACHE``, else ``$XDG_CACHE_HOME/triforce-cli``, else ``~/.cache/triforce-cli``. It
holds ``models/`` (GGUF files converted to safetensors) and, by convention, ``prompts/`` (``--prompt-cache`` may
name any other folder); ``inductor/`` holds torch's compiled decode steps, which torch manages, outside the limit,
and ``chat-history`` the lines typed at `triforce chat` in a terminal. Each entry of such a folder (a file or a
folder) counts its bytes; when a write takes a folder past the limit (``$TRIFORCE_CACHE_LIMIT``, e.g. ``4G``,
``500M``, ``0`` for none; default 4 GiB), the entries used least recently are removed until it fits again, never the
one just written. Using an entry sets its modification time, so that time is when it was last used.
"""

import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from triforce_cli.errors import ConfigError

LIMIT_VARIABLE = "TRIFORCE_CACHE_LIMIT"
INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"  # torch's folder of compiled artefacts
DEFAULT_LIMIT = 4 * 2**30
PARTIAL_SUFFIX = ".partial"  # an entry still being written: never listed, evicted only once stale
# the names of saved prefills: a --prompt-cache folder is the user's, so only these in it are listed, evicted or
# cleared, never the user's own files beside them
PROMPT_ENTRIES = "prompt-*.safetensors"
STALE_PARTIAL_SECONDS = 24 * 3600  # a partial untouched this long was left by a process killed while writing it
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
IDENTITIES_FILE = "file-identities.json"  # in the cache root: content_identity's memory
HASH_BLOCK = 1 << 24


def cache_root() -> Path:
    """Where converted checkpoints (and, by default, saved prefills) live."""
    if os.environ.get("TRIFORCE_CACHE"):
        return Path(os.environ["TRIFORCE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "triforce-cli"


def models_folder() -> Path:
    return cache_root() / "models"


def prompts_folder() -> Path:
    return cache_root() / "prompts"


def chat_history_file() -> Path:
    """The questions and commands typed at `triforce chat` in a terminal, kept for the next session's history."""
    return cache_root() / "chat-history"


def compiled_folder() -> Path:
    """Where torch's inductor keeps compiled decode steps across processes (runtime.model.Transformer.compile_steps),
    instead of the system's temporary folder."""
    return cache_root() / "inductor"


def unusable_cache_root() -> str | None:
    """Why the cache root cannot hold the cache (something not a folder stands on its path, or it cannot be made),
    in one line; None where it can."""
    root = cache_root()
    if root.exists() and not root.is_dir():
        return f"the cache folder {root} is a file: set TRIFORCE_CACHE to a folder"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"the cache folder {root} cannot be made ({error.strerror}): set TRIFORCE_CACHE to a folder"
    return None


def keep_compiled_steps() -> None:
    """Have inductor's FX graph and AOT autograd caches (on by default) write to compiled_folder(), unless
    INDUCTOR_CACHE_VARIABLE names a folder already. Their folder is that variable, read when inductor first needs it
    (https://docs.pytorch.org/tutorials/recipes/torch_compile_caching_configuration_tutorial.html), which may be
    as transformers imports: the command calls this first thing."""
    os.environ.setdefault(INDUCTOR_CACHE_VARIABLE, str(compiled_folder()))


def content_identity(path: Path) -> str:
    """'<size>-<sha256 of the bytes>' of a file: the same for two copies of it wherever they are installed. Hashing
    takes about a second per GiB, so it is done once per file as it stands (resolved path, inode, size and
    modification time) and remembered in the cache root; a file changed in place is hashed again."""
    stat = path.stat()
    where = f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    memory = cache_root() / IDENTITIES_FILE
    try:
        known = json.loads(memory.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(where), str):
        return known[where]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
    identity = f"{stat.st_size}-{digest.hexdigest()}"
    live = {key: value for key, value in known.items() if Path(key.split("|", 1)[0]).exists()}
    try:
        memory.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(memory, lambda partial: partial.write_text(json.dumps({**live, where: identity}, indent=1)))
    except OSError:
        pass  # a read-only cache: hashed again next time
    return identity


def parse_size(text: str) -> int:
    """'4G' -> 4 GiB, '500M', '1.5G', '123' bytes; a ConfigError for anything else."""
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = cleaned[-1:] if cleaned[-1:] in UNITS else ""
    try:
        value = float(cleaned[: len(cleaned) - len(unit)])
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigError(f"cannot read '{text}' as a size (e.g. 4G, 500M or 0 for no limit)")
    return int(value * UNITS[unit])


def cache_limit() -> int:
    """Bytes each cache folder is kept under; 0 means no limit."""
    text = os.environ.get(LIMIT_VARIABLE)
    if text is None:
        return DEFAULT_LIMIT
    try:
        return parse_size(text)
    except ConfigError as err:
        raise ConfigError(f"{LIMIT_VARIABLE}: {err}") from None


def human_size(size: int) -> str:
    """'512 B', '1.5 KiB', ... up to GiB."""
    if size < 1024:
        return f"{size} B"
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int  # bytes, a folder's files added up
    last_used: float  # seconds since the epoch


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def entries(folder: Path, names: str = "*") -> list[Entry]:
    """The finished entries of folder whose names match the pattern names, least recently used first (none where
    the folder does not exist)."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob(names):
        if path.name.endswith(PARTIAL_SUFFIX) or path.name.startswith("."):
            continue
        try:
            found.append(Entry(path, _size(path), path.stat().st_mtime))
        except OSError:  # removed meanwhile
            continue
    return sorted(found, key=lambda e: e.last_used)


def mark_used(path: Path) -> None:
    """Record that an entry was just used (its modification time; an entry that cannot be touched stays as is)."""
    try:
        now = time.time()
        os.utime(path, (now, now))
    except OSError:
        pass


def partial_path(path: Path) -> Path:
    """A name beside path that only this call hands out, for writing path's content before it takes path's place."""
    return path.with_name(f"{path.name}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL_SUFFIX}")


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Give path its content whole or not at all: write(partial) fills a file or folder of this call's own, which
    then takes path's place in one rename. A reader never sees half of it; two processes writing the same path at
    once never share a partial; a process killed midway leaves only a partial, which nothing reads.

    A folder cannot replace a folder: where another process put path there first, its copy (of the same content)
    stays and this one is dropped. Errors of write (and OSError of the rename) propagate, with the partial removed.
    """
    partial = partial_path(path)
    try:
        write(partial)
        try:
            os.replace(partial, path)
        except OSError:
            if not (partial.is_dir() and path.is_dir()):
                raise
            remove(partial)  # another process's folder got there first: it holds the same content
    except BaseException:
        remove(partial)
        raise


def check_writable_file(path: Path | None, setting: str) -> None:
    """A ConfigError now where path (a file a command will write at its end: bench's --out, a --plot) is a folder
    or its folder is not one that can be written to, so that what the command computed is not lost to it."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"`{setting}` {path} is a folder: name a file")
    if not path.parent.is_dir() or not os.access(path.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"`{setting}` {path}: its folder {path.parent} does not exist or cannot be written to")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale_partials(folder: Path, names: str = "*") -> None:
    """Remove the partials of folder last written more than STALE_PARTIAL_SECONDS ago: a process killed while writing
    (SIGKILL, a power cut) leaves its partial behind, and nothing else ever removes it. A fresher one may still be
    another process's write in progress, so it stays."""
    for path in folder.glob(f"{names.rstrip('*')}*{PARTIAL_SUFFIX}"):  # the partials of those names
        try:
            if time.time() - path.stat().st_mtime > STALE_PARTIAL_SECONDS:
                remove(path)
        except OSError:  # renamed into place or removed meanwhile
            continue


def evict(folder: Path, keep: Path, limit: int | None = None, names: str = "*") -> list[Entry]:
    """Remove the stale partials of folder (remove_stale_partials), then its least recently used entries, never
    keep, until they hold at most limit bytes (cache_limit() when None; 0: no limit); only entries whose names match
    the pattern names count and go. Returns the entries removed."""
    remove_stale_partials(folder, names)
    limit = cache_limit() if limit is None else limit
    if limit <= 0:
        return []
    present = entries(folder, names)
    total = sum(e.size for e in present)
    removed = []
    for entry in present:
        if total <= limit:
            break
        if entry.path == keep:
            continue
        remove(entry.path)
        total -= entry.size
        removed.append(entry)
    return removed
