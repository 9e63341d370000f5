"""The order in which a forward first uses the parameters, which stage 3's chunks are packed in
(layout.py re-packs once if it differs from the order the model registered them in).
"""
from __future__ import annotations

import torch.nn as nn

from .placeholder import ShardedPlaceholder
from ..units import direct_params, unit_members


class FirstUseRecorder:
    """Records parameters in order of first use during one forward pass. A leaf unit (units.py)
    uses its whole subtree at once, in module order, whichever of its submodules run: so its
    experts pack together, and alike on every rank."""

    def __init__(self, model: nn.Module, leaves=()):
        self.order: list[nn.Parameter] = []
        self._seen: set[int] = set()
        units = unit_members(model, list(leaves))
        self._handles = [m.register_forward_pre_hook(lambda m, args, members=members: self._use(members))
                         for m, members in units.items() if members]

    def _use(self, members):
        for module in members:
            for _, p in direct_params(module):
                if id(p) not in self._seen and not isinstance(p, ShardedPlaceholder):
                    self._seen.add(id(p))
                    self.order.append(p)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
