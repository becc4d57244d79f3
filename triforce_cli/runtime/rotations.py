"""Rotary rotations read from a table of blocks of positions (RotationTable), for eager forwards.

A decode step's rotation computed afresh takes about ten small torch ops, and each costs tens of microseconds after
the step before has streamed the weights and the cache through the CPU's caches; reading it from a block computed
once costs one view. Each position's rotation is also the same bits whichever forward asks for it: an elementwise
torch op on the CPU runs the last elements of a row count that is not a multiple of its vector width in scalar
code, so that computing the rotations of T positions at once could give a position other bits than computing them
for another T (with head_dim / 2 not a multiple of 32). A block of BLOCK positions is always whole vectors.
"""

from collections import OrderedDict
from collections.abc import Callable

import torch

BLOCK = 256  # positions a block of the table holds
KEPT = 2  # blocks kept, the most recently read: a generation's steps read one block after another


class RotationTable:
    """The rotations (T, 2, 2, D/2) of runs of consecutive positions, from blocks of BLOCK positions each computed by
    rotate(positions (BLOCK,), dtype). A run within one block (a decode step, a verification, an aligned prefill
    chunk) is a view of that block, which is kept for the next steps while the frequencies rotate reads stay the same
    tensor, unchanged; a run over several blocks (a longer prefill chunk, a verification across a boundary) is put
    together from the kept blocks and others computed for it alone, so that the table never holds more than KEPT
    blocks.

    Args:
        rotate: the model's rotation of positions (Transformer.rotary).
    """

    def __init__(self, rotate: Callable[[torch.Tensor, torch.dtype], torch.Tensor]):
        self.rotate = rotate
        self.blocks: OrderedDict[int, torch.Tensor] = OrderedDict()  # block index -> (BLOCK, 2, 2, D/2)
        self.made_from: tuple | None = None

    def rotation(self, start: int, count: int, dtype: torch.dtype, frequencies: torch.Tensor) -> torch.Tensor:
        """The rotation (count, 2, 2, D/2) of positions [start, start + count), count >= 1: rotate's own values.

        Args:
            frequencies: the tensor rotate reads (the model's inv_freq): blocks made before it changed in place
                (LongRoPE's sets, Transformer.fit_rope) or moved are computed again.
        """
        made_from = (frequencies.data_ptr(), frequencies._version, frequencies.device, dtype)
        if made_from != self.made_from:
            self.blocks.clear()
            self.made_from = made_from
        stop = start + count
        first, last = start // BLOCK, (stop - 1) // BLOCK
        if first < last:  # each block (kept, or computed and dropped) written into the run's rows
            rotation = None
            for index in range(first, last + 1):
                block = self._block(index, dtype, frequencies.device)
                if rotation is None:
                    rotation = block.new_empty((count, *block.shape[1:]))
                low, high = max(start, index * BLOCK), min(stop, (index + 1) * BLOCK)
                rotation[low - start : high - start] = block[low - index * BLOCK : high - index * BLOCK]
            return rotation
        block = self._block(first, dtype, frequencies.device)
        self.blocks.pop(first, None)
        self.blocks[first] = block  # now the most recently read
        while len(self.blocks) > KEPT:
            self.blocks.popitem(last=False)
        offset = start - first * BLOCK
        return block[offset : offset + count]

    def _block(self, index: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Block index (BLOCK, 2, 2, D/2): the kept one, else computed."""
        kept = self.blocks.get(index)
        if kept is not None:
            return kept
        first = index * BLOCK
        return self.rotate(torch.arange(first, first + BLOCK, device=device), dtype)
