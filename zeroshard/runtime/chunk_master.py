"""A chunk's fp32 master (words: docs/vocabulary.md): made for trainable chunks and for ones
unfrozen later, cut into master pieces (what the user's optimizer steps), and bound to the disk
tier's frames while that holds it (disk_tier.py). Chunk (chunks.py) is the one class built on it.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..errors import invariant
from .packing import MasterPiece


class ChunkMaster:
    """The master's part of Chunk: its attributes (master, master_is_shard, pieces, tier,
    owned_range, placement, ...) are set by Chunk.__init__."""

    @property
    def owned_numel(self) -> int:
        """Elements of the owned range: the master's length (also while the disk tier holds it)."""
        return self.owned_range[1] - self.owned_range[0]

    def new_master(self) -> torch.Tensor:
        """An uninitialised fp32 master of the owned range, on the optimizer's side."""
        if self.placement.optimizer_on_host:
            return self.transfer.host_empty(self.owned_numel, torch.float32)
        return torch.empty(self.owned_numel, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def make_trainable(self) -> None:
        """A frozen chunk one of whose parameters was unfrozen after initialize (gradual
        unfreezing) gets what trainable chunks have: an fp32 master of its owned range, taken from
        the values it holds (in 16-bit training, the 16-bit copies: a frozen chunk keeps no fp32
        one), gradient buffers, and master pieces, whose optimizer state starts empty as torch's
        does for a parameter it has not stepped. Its parameters still frozen get no gradient and
        are not stepped."""
        if self.trainable:
            return
        self.trainable = True
        if self.master_is_shard:
            self.master = self.shard
        else:
            self.master = self.new_master()
            with self.shard_values():
                self.master.copy_(self.shard)  # the owned range at every stage (stage 0: the whole chunk)
        self.pieces = self._master_pieces()
        if self.stage <= 1:
            self.grad_full = torch.zeros(self.grad_numel, dtype=self.grad_dtype, device=self.device)
        self.expected_grads = len(self.slots)

    def _master_pieces(self) -> list[MasterPiece]:
        lo, hi = self.owned_range
        base = self.master.detach()
        out = []
        for i, s in enumerate(self.slots):
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                view = base[a - lo:b - lo]
                out.append(MasterPiece(s, i, a, b, nn.Parameter(view.view(s.shape) if b - a == s.numel else view)))
        return out

    # -- the master in the disk tier (disk_tier.py) ------------------------------------------------
    def keep_master_in(self, tier) -> None:
        self.tier = tier

    def bind_master(self, values: torch.Tensor | None) -> None:
        """Point the master and its pieces at `values` (fp32, the owned range), or at nothing (None:
        a 0-element tensor, so a reader that did not open the chunk fails on the size)."""
        invariant(values is None or values.numel() == self.owned_numel, lambda: f"chunk {self.index}: a master of {values.numel()}")
        self.master = values if values is not None else torch.empty(0, dtype=torch.float32)
        lo = self.owned_range[0]
        for pc in self.pieces:
            pc.param.data = self.master if values is None else \
                values[pc.lo - lo:pc.hi - lo].view(pc.shape)

    @contextlib.contextmanager
    def master_values(self, write: bool = False):
        """self.master holds the values for the block: a disk-tier chunk is opened, its master alone
        (written back after the block when `write`); any other one's master is where it always is."""
        if self.tier is None or not self.trainable:
            yield
        else:
            with self.tier.opened(self, write, states=False):
                yield
