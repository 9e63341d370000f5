"""hpZ's secondary shard of one stage-3 chunk (config hpz_group_size; distributed/shard_groups.py).

A chunk's primary shards split it over every data-parallel rank; its secondary shards split it
over the G' ranks of a secondary group (a node). A gather of the chunk from the primary shards
leaves this rank its secondary shard when the chunk is released; from then until the parameters
change (the step, a write: `forget`), the chunk is gathered from the secondary shards, over the
secondary group only. The buffer is allocated once and kept (its bytes are a model state,
'secondary' in stats()), as ZeRO++ keeps its secondary partition.
"""
from __future__ import annotations

import torch

from ..distributed.ordering import GATHER


class SecondaryShard:
    """Elements [lo, hi) of a chunk of `padded_numel` elements: this rank's 1/`size` of it, at
    place `rank` of its secondary group."""

    def __init__(self, padded_numel: int, rank: int, size: int, dtype: torch.dtype, device: torch.device):
        n = padded_numel // size
        self.lo, self.hi = rank * n, (rank + 1) * n
        self.values = torch.empty(n, dtype=dtype, device=device)
        self.current = False  # holds the chunk's values as they are now

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def keep(self, full: torch.Tensor) -> None:
        """The chunk is released after a gather: keep this rank's part of it, unless already kept."""
        if not self.current:
            self.values.copy_(full[self.lo:self.hi])
            self.current = True

    def forget(self) -> None:
        """The parameters change: the next gather reads the primary shards."""
        self.current = False

    def start_gather(self, full: torch.Tensor, shards, index: int):
        """Start gathering chunk `index` into `full` from the secondary shards (`shards`: the
        ShardGroups); returns the collective's work."""
        piece = full[self.lo:self.hi]
        piece.copy_(self.values)
        return shards.all_gather_secondary(full, piece, async_op=True, tag=(GATHER, index))
