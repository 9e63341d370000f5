"""Writes a user makes into parameters between steps (`with torch.no_grad(): p.fill_(...)`, a
clamp after each step, nn.init on a model already wrapped) or inside a forward, carried into the
fp32 masters before anything reads them, at stages 0-2 (stage 3 keeps them at once:
runtime/hooks.py's Note: writes into parameters).

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
`land` raises EngineCallError after landing it (`written_since_launch`).
"""
from __future__ import annotations

import torch

from ..distributed.tensor_parallel import local


class UserWrites:
    """The parameters' version counters as last seen, per chunk whose master is apart."""

    def __init__(self):
        self._seen: dict[int, tuple[object, list[int]]] = {}  # id(chunk) -> (chunk, versions per slot)

    def watch(self, chunks) -> None:
        """Start from the parameters' versions now (the optimizer was (re)bound to `chunks`)."""
        self._seen = {id(c): (c, _versions(c)) for c in chunks if _apart(c)}

    def written(self) -> list[str]:
        """Names of the watched parameters written since last seen."""
        return [s.name for c, seen in self._seen.values() for s, a, b in zip(c.slots, _versions(c), seen) if a != b]

    @torch.no_grad()
    def carry(self) -> None:
        """Take what was written into the watched chunks' parameters since last seen into their
        masters."""
        for key, (c, seen) in self._seen.items():
            now = _versions(c)
            if now == seen:
                continue
            for s, a, b in zip(c.slots, now, seen):
                if a != b:
                    c.keep_written(s, local(s.param))
            self._seen[key] = (c, now)

    def seen(self, param) -> None:
        """`param`'s version moved with no write (torch's parametrize set it to itself)."""
        for key, (c, versions) in self._seen.items():
            for i, s in enumerate(c.slots):
                if s.param is param:
                    versions[i] = param._version

    def forget(self) -> None:
        """What was written since last seen is not to be carried (the delayed update landed over it)."""
        self._seen = {key: (c, _versions(c)) for key, (c, _) in self._seen.items()}


def _apart(c) -> bool:
    return c.trainable and not c.master_is_shard and c.full is not None and c.stage < 3


def _versions(c) -> list[int]:
    return [s.param._version for s in c.slots]
