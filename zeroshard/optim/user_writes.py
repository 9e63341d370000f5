"""Writes a user makes into parameters between steps (`with torch.no_grad(): p.fill_(...)`, a
clamp after each step, nn.init on a model already wrapped) or inside a forward, carried into the
fp32 masters before anything reads them, at stages 0-2 (stage 3 keeps them at once:
runtime/param_writes.py's Note: writes into parameters).

Where a chunk keeps its master apart from the parameters' storage (16-bit training, an optimizer
offloaded to the host or to disk), the parameters the forward reads are a copy that every step
overwrites from the master: a write into them would last until the next step and then vanish, where
plain PyTorch keeps it. Each parameter's version counter tells which were written: every in-place op
on a parameter bumps it, and nothing zeroshard does (the engine writes the chunk's buffer, and the
parameters are views of it with counters of their own). The step takes them (`carry`), and so does
every reader of the masters before it reads (a state dict, a checkpoint, full_parameters: the
engine's quiesce), so a write is in `full_state_dict()` right after it is made. Of a written
parameter, only the elements that no longer equal their master's rounding are taken
(Chunk.keep_written).

Not carried: a write through `p.data` (torch gives `.data` a version counter of its own: such a
write is seen by no counter, and finding it would mean reading every parameter at every step). With
the delayed update a write while the update is in flight cannot be kept (the update lands over it):
`land` raises EngineCallError after landing it (`written`).
"""
from __future__ import annotations

import torch

from ..distributed.tensor_parallel import local
from ..runtime.param_writes import WrittenParameters


class UserWrites:
    """The version counters of the parameters in chunks whose master is apart (runtime/
    param_writes.py's WrittenParameters), and where each parameter lives."""

    def __init__(self):
        self.watch([])

    def watch(self, chunks) -> None:
        """Start from the parameters' versions now (the optimizer was (re)bound to `chunks`)."""
        self._slots = {id(s.param): (c, s) for c in chunks if _apart(c) for s in c.slots}
        self._versions = WrittenParameters([s.param for _, s in self._slots.values()], self._keep)

    def written(self) -> list[str]:
        """Names of the watched parameters written since last seen."""
        return [self._slots[id(p)][1].name for p in self._versions.changed()]

    def carry(self) -> None:
        """Take what was written into the watched parameters since last seen into their masters."""
        self._versions.check()

    @torch.no_grad()
    def _keep(self, params) -> None:
        for p in params:
            c, s = self._slots[id(p)]
            c.keep_written(s, local(p))

    def seen(self, param) -> None:
        """`param`'s version moved with no write (torch's parametrize set it to itself)."""
        self._versions.seen(param)

    def forget(self) -> None:
        """What was written since last seen is not to be carried (the delayed update landed over it)."""
        self._versions.rebase()


def _apart(c) -> bool:
    return c.trainable and not c.master_is_shard and c.full is not None and c.stage < 3
