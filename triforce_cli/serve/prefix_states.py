"""Several prefix states kept by `triforce serve`, so that requests from several clients, or a chat client's title,
tag and follow-up requests between a user's questions, do not make the next question read its document again.

The engine's full cache holds one state: what the last generation left (prefix reuse, the cache pool's `Held`). After each
generation the worker copies it to host memory (Engine.held_state: every held position under the numeric contract,
else only those a prefill computed, the engine's rules for what a later prompt may keep). Before the next one, the
state sharing the longest prefix with the prompt is put back in the full cache (Engine.restore) where it shares more
than the cache holds now; the engine's prefix reuse then keeps that prefix, so every kept position holds what a
fresh prefill writes, and the answer is a reuse-free server's. The states are kept least recently used first out
within a budget of bytes; a state whose ids start another's is dropped (the longer one serves both). Where
`--prompt-cache` is given every prefill is saved there as well (Pipeline.generate_ids), so a state dropped here is
found there again.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from triforce_cli.decoding.engine import Engine
from triforce_cli.decoding.prompt_state import PromptState
from triforce_cli.errors import TriforceError

DEFAULT_BUDGET = 2 * 2**30  # bytes of keys and values kept in host memory


@dataclass(frozen=True)
class _Entry:
    """A kept state and the settings its positions were computed with, which a prompt must share to keep them:
    the LongRoPE set (Transformer.fit_rope) and whether it was computed under the numeric contract."""

    state: PromptState
    rope_factors: str | None
    exact: bool

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.tensors.values())


def shared_prefix(held: list[int], prompt_ids: list[int]) -> int:
    """How many first ids held and prompt_ids share, short of the prompt's last id (whose logits are computed)."""
    limit = min(len(held), len(prompt_ids) - 1)
    return next((i for i in range(limit) if held[i] != prompt_ids[i]), max(limit, 0))


@dataclass
class PrefixStates:
    """Prefix states in host memory, least recently used first out past budget bytes (0: none kept).

    current: the entry the engine's full cache holds now (the last put or restored), None where unknown."""

    budget: int = DEFAULT_BUDGET
    _entries: "OrderedDict[int, _Entry]" = field(default_factory=OrderedDict)  # by id(), least recently used first
    current: _Entry | None = None

    @property
    def held_bytes(self) -> int:
        return sum(entry.bytes for entry in self._entries.values())

    @property
    def held_ids(self) -> list[list[int]]:
        """The ids each kept state holds, least recently used first."""
        return [entry.state.prompt_ids.tolist() for entry in self._entries.values()]

    def prepare(self, engine: Engine, prompt_ids: list[int]) -> int:
        """Put the kept state sharing the longest prefix with prompt_ids back in engine's full cache, where it shares
        more than the state the cache holds now, and mark it used. Returns the prefix it shares (0: none restored).

        A state computed with other settings than a generation after prompt_ids takes (its LongRoPE set, or outside
        the numeric contract where it was computed under it) is passed over."""
        rope = engine.target.model.rope_factors_for(len(prompt_ids) + engine.config.max_new_tokens)
        exact = engine.exact_positions
        best, best_shared = None, 0
        if self.current is not None:  # what the full cache holds serves as far as it goes without a copy
            best_shared = shared_prefix(self.current.state.prompt_ids.tolist(), prompt_ids)
        for entry in self._entries.values():
            if entry.rope_factors != rope or entry.exact != exact:
                continue
            shared = shared_prefix(entry.state.prompt_ids.tolist(), prompt_ids)
            if shared > best_shared:
                best, best_shared = entry, shared
        if best is None:
            return 0
        self._entries.move_to_end(id(best))
        self.current = None  # a restore that fails leaves the cache holding nothing known
        try:
            engine.restore(best.state, next_prompt_tokens=len(prompt_ids))
        except (TriforceError, ValueError):  # a state this generation's caches cannot hold: the prompt prefills
            return 0
        self.current = best
        return best_shared

    def keep(self, engine: Engine) -> None:
        """Copy what engine's full cache holds after a generation (Engine.held_state) and keep it as the most recently
        used state; the states its ids start with are dropped, then the least recently used past the budget."""
        self.current = None
        if self.budget <= 0:
            return
        state = engine.held_state(max_bytes=self.budget)
        if state is None:
            return
        entry = _Entry(state, engine.target.model.rope_factors, engine.exact_positions)
        ids = state.prompt_ids.tolist()
        for key, kept in list(self._entries.items()):
            held = kept.state.prompt_ids.tolist()
            if kept.rope_factors == entry.rope_factors and kept.exact == entry.exact and ids[: len(held)] == held:
                del self._entries[key]
        self._entries[id(entry)] = entry
        while self.held_bytes > self.budget:
            self._entries.popitem(last=False)
        self.current = entry
