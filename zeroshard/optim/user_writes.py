"""Writes a user makes into parameters between steps (`with torch.no_grad(): p.fill_(...)`, a
clamp after each step, nn.init on a model already wrapped), carried into the fp32 masters before
the step reads them.

Where a chunk keeps its master apart from the parameters' storage (16-bit training, an optimizer
offloaded to the host), the parameters the forward reads are a copy that every step overwrites from
the master: a write into them would last until the next step and then vanish, where plain PyTorch
keeps it. Each parameter's version counter tells which were written: every in-place op on a
parameter bumps it, and nothing zeroshard does (the engine writes the chunk's buffer, and the
parameters are views of it with counters of their own). Of a written parameter, only the elements
that no longer equal their master's rounding are taken, so a write to one row leaves the fp32 values
of the others as they were.

Not carried: a write through `p.data` (torch gives `.data` a version counter of its own: such a
write is seen by no counter, and finding it would mean reading every parameter at every step); a
chunk whose master the disk tier holds between steps; the delayed update (whose master is a step
ahead in its thread). Stage 3 refuses such writes (ShardedParameterError).
"""
from __future__ import annotations

import torch


class UserWrites:
    """The parameters' version counters as last seen, per chunk whose master is apart."""

    def __init__(self):
        self._seen: dict[int, tuple[object, list[int]]] = {}  # id(chunk) -> (chunk, versions per piece)

    def watch(self, chunks) -> None:
        """Start from the parameters' versions now (the optimizer was (re)bound to `chunks`)."""
        self._seen = {id(c): (c, _versions(c)) for c in chunks if _apart(c)}

    @torch.no_grad()
    def carry(self) -> None:
        """Take what was written into the watched chunks' parameters since last seen into their
        masters."""
        for key, (c, seen) in self._seen.items():
            now = _versions(c)
            if now == seen:
                continue
            for pc, a, b in zip(c.pieces, now, seen):
                if a != b:
                    master = pc.param.detach().view(-1)
                    values = c.full[pc.lo:pc.hi].to(master.device)
                    master.copy_(torch.where(values != master.to(values.dtype), values.to(master.dtype), master))
            self._seen[key] = (c, now)


def _apart(c) -> bool:
    return c.trainable and not c.master_is_shard and c.full is not None and c.tier is None and c.stage < 3


def _versions(c) -> list[int]:
    return [pc.slot.param._version for pc in c.pieces]
