"""CUDA graphs of a model's fixed-shape decode steps, captured without a compiler.

A decode step on a cache made static (KVCache.make_static) runs at a padded length P with nothing in it that
depends on a host-side value: the tokens and positions are (P,) device tensors, the cache's write slot is on the
device, and attention reads the cache's whole buffers with a mask. One recording of it per (cache, P) therefore
serves every position, and StepGraphs keeps that recording: on CUDA a ``torch.cuda.CUDAGraph`` captured from the
step (Transformer.fixed_step: the eager compute_logits, or its inductor compilation), its inputs copied into
static buffers before each replay, the graphs of one cache in one memory pool. On the CPU the same object runs the
step eagerly on the same buffers, and counts the graphs it would have captured.

Capture records the addresses of everything the step reads and writes: the cache's buffers (which make_static
keeps in place), the model's weights and rotary frequencies (Transformer.fit_rope writes in place), and the static
buffers here. A cache released takes its graphs and their pool with it (they are kept per cache, weakly): the
caching allocator retires a pool whose graphs are all gone, and a capture into a retired pool's handle fails
(an internal assertion of torch's), so each cache asks for a pool of its own rather than the model keeping one.

A cache whose steps read a number of slots that follows its length (KVCache.step_slots: an offloaded full cache
streams its length bucket) keeps one recording per (P, slots): a step whose length passes into the next bucket
records another. A step over an offloaded cache is recorded from the eager step even where the model's steps are
compiled (Transformer.forward): its copies and cross-stream events stay out of the compiler, and a CUDA graph's
capture takes them as they run (the copy stream forked from the capture stream and joined back by events).
"""

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from triforce_cli.cache import KVCache

StepFunction = Callable[[torch.Tensor, torch.Tensor, KVCache], torch.Tensor]  # (tokens, positions, cache) -> logits


@dataclass
class StepGraph:
    """One recorded step of padded length P on one cache.

    Attributes:
        tokens: (P,) int64 token ids the step reads, copied in before each replay.
        positions: (P,) int64 positions the step reads.
        logits: (P, V) float32 logits the step writes; overwritten by the next replay.
        graph: the captured CUDA graph; None on the CPU, where replay runs the step.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    """A model's recorded decode steps, per cache and padded length (module docstring).

    Attributes:
        captured: graphs recorded so far, over every cache (on the CPU: those that would have been captured).
    """

    def __init__(self) -> None:
        self.captured = 0
        # per cache: the memory pool its graphs share (torch.cuda.graph_pool_handle), asked for at its first capture
        self._pools: weakref.WeakKeyDictionary[KVCache, tuple[int, int]] = weakref.WeakKeyDictionary()
        # per cache: (padded length, slots read: KVCache.step_slots) -> its recording
        self._graphs: weakref.WeakKeyDictionary[KVCache, dict[tuple[int, int], StepGraph]] = weakref.WeakKeyDictionary()
        self._longest: weakref.WeakKeyDictionary[KVCache, int] = weakref.WeakKeyDictionary()

    def holds(self, cache: KVCache, length: int, slots: int = 0) -> bool:
        """Whether the step of padded length on cache, reading slots (KVCache.step_slots), is recorded."""
        return (length, slots) in self._graphs.get(cache, {})

    def lengths(self, cache: KVCache) -> list[int]:
        """The padded lengths recorded on cache, shortest first (each once, whatever slots it was recorded for)."""
        return sorted({length for length, _ in self._graphs.get(cache, {})})

    def recorded(self, cache: KVCache) -> list[tuple[int, int]]:
        """The (padded length, slots) recorded on cache, in order."""
        return sorted(self._graphs.get(cache, {}))

    def limit(self, cache: KVCache, longest: int) -> None:
        """Record steps on cache of up to longest padded tokens only; a longer one runs eager (a drafter catching up
        on committed tokens, which a recording per length would serve once)."""
        self._longest[cache] = longest

    def longest(self, cache: KVCache, default: int) -> int:
        """The longest padded step recorded on cache (limit), default where none was set."""
        return self._longest.get(cache, default)

    def run(
        self, step: StepFunction, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: int = 0
    ) -> torch.Tensor:
        """Logits (P, V) of step over tokens (P,) at positions (P,) on cache, prepared for them with padding and
        reading slots (KVCache.step_slots): the recorded step replayed, recorded first where it is not yet. The
        result is the step's static output, which the next replay of the same step overwrites: the caller copies
        the rows it keeps.

        Replaying copies the inputs on the device and launches the graph: no host synchronization.
        """
        recorded = self._graphs.setdefault(cache, {}).get((tokens.shape[0], slots))
        if recorded is None:
            recorded = self._record(step, tokens, positions, cache, slots)
        recorded.tokens.copy_(tokens, non_blocking=True)
        recorded.positions.copy_(positions, non_blocking=True)
        if recorded.graph is None:
            with torch.no_grad():  # inductor compiles no code that runs in inference mode
                recorded.logits = step(recorded.tokens, recorded.positions, cache)
        else:
            recorded.graph.replay()
        return recorded.logits

    def _record(
        self, step: StepFunction, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: int
    ) -> StepGraph:
        """A StepGraph of tokens' length on cache: on CUDA, the step run once on a side stream (which compiles it
        and lets the libraries it calls allocate their workspaces), then captured into the cache's pool; on the CPU,
        its static buffers alone. The capture writes nothing: run() replays it next."""
        recorded = StepGraph(tokens.clone(), positions.clone())
        device = tokens.device
        if device.type == "cuda":
            pool = self._pools.get(cache)
            if pool is None:
                pool = self._pools[cache] = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.no_grad(), torch.cuda.stream(side):
                step(recorded.tokens, recorded.positions, cache)
            torch.cuda.current_stream(device).wait_stream(side)
            recorded.graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(recorded.graph, pool=pool):
                recorded.logits = step(recorded.tokens, recorded.positions, cache)
        self._graphs[cache][tokens.shape[0], slots] = recorded
        self.captured += 1
        return recorded
