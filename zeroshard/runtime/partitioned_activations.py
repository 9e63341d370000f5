"""ZeRO-R's partitioned activation checkpoints (P_a, P_a+cpu) beside tensor parallelism.

An activation saved for backward that every rank of the TP group holds alike (with
activation checkpointing: the checkpoints, the blocks' inputs) is kept 1/MP per rank and
all-gathered over the TP group when backward needs it; with offload_activations the part waits
in host memory (P_a+cpu).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from ..distributed.collectives import Comm
from .offload import Pending, Transfer


class Partitioned:
    """A saved activation kept 1/MP on this rank: `fragment` (a host Pending with P_a+cpu) is this
    rank's 1/MP of the flattened tensor, zero-padded to equal parts. `full`: the tensor gathered
    again by the first unpack, kept for the other operations that saved the same tensor (autograd
    drops this object, and it, after the last of them)."""
    __slots__ = ("fragment", "shape", "numel", "full", "__weakref__")

    def __init__(self, fragment, shape: torch.Size, numel: int):
        self.fragment, self.shape, self.numel, self.full = fragment, shape, numel, None


_WEIGHTS = 61  # period of the position weights of the fingerprint


class PartitionedActivations:
    """ZeRO-R's P_a over the TP group of `comm`. Which saved tensors every TP rank holds alike is
    not something the model declares, so each floating one is compared by a fingerprint (its
    length, sum and position-weighted sum, all-gathered: 24 bytes per rank): the alike ones are
    partitioned, the others (a shard of a split activation) kept whole. Every TP rank packs the
    same tensors in the same order (they run the same model on the same batch), so the fingerprint
    collectives pair up. `min_numel`: alike tensors smaller than this (elements) are kept whole."""

    def __init__(self, comm: Comm, transfer: Transfer, to_host: bool, min_numel: int = 1024):
        self.comm, self.transfer, self.to_host, self.min_numel = comm, transfer, to_host, min_numel
        self.fingerprints = 0  # fingerprint collectives since the last reset_counters
        self.partitioned_elements = 0  # whole (padded) elements of the tensors partitioned since then
        self._weights: torch.Tensor | None = None
        # A tensor saved by several operations (a block's input: by the norm, the residual add and
        # the checkpoint) is partitioned once: tensor -> (its version then, Partitioned or None).
        # Weak keys: holding the tensors would keep the activations P_a means to free. Every TP
        # rank sees the same repeats, so the skipped fingerprint collectives stay paired.
        self._seen = WeakTensorKeyDictionary()

    def begin_forward(self) -> None:
        self._seen = WeakTensorKeyDictionary()

    def reset_counters(self) -> None:
        self.fingerprints = self.partitioned_elements = 0
        self.comm.reset_counters()

    @torch.no_grad()
    def _fingerprint(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1).double()
        n = flat.numel()
        if self._weights is None or self._weights.device != t.device:
            self._weights = torch.arange(1, _WEIGHTS + 1, dtype=torch.float64, device=t.device)
        rows = F.pad(flat, (0, -n % _WEIGHTS)).view(-1, _WEIGHTS)
        return torch.stack([torch.tensor(float(n), dtype=torch.float64, device=t.device), flat.sum(),
                            (rows @ self._weights).sum()])

    def alike(self, t: torch.Tensor) -> bool:
        """Collective over the TP group: whether every TP rank saved the same values."""
        mine = self._fingerprint(t).to(self.comm.control_device)
        every = torch.empty(mine.numel() * self.comm.world, dtype=mine.dtype, device=mine.device)
        with self.comm.uncounted():
            self.comm.all_gather(every, mine)
        self.fingerprints += 1
        every = every.view(self.comm.world, -1)
        return bool((every == every[0]).all())

    @torch.no_grad()
    def pack(self, t: torch.Tensor) -> Partitioned | None:
        """Partitioned, or None: keep `t` as it is. Only plain floating tensors on the device
        reach here (the caller leaves model states, DTensors and others alone)."""
        seen = self._seen.get(t)
        if seen is not None and seen[0] == t._version:
            return seen[1]
        part = self._partition(t) if self.alike(t) and t.numel() >= self.min_numel else None
        self._seen[t] = (t._version, part)
        return part

    def _partition(self, t: torch.Tensor) -> Partitioned:
        n, world = t.numel(), self.comm.world
        part = math.ceil(n / world)
        lo, hi = min(n, self.comm.rank * part), min(n, (self.comm.rank + 1) * part)
        fragment = torch.zeros(part, dtype=t.dtype, device=t.device)
        fragment[:hi - lo].copy_(t.detach().reshape(-1)[lo:hi])
        self.partitioned_elements += part * world
        return Partitioned(self.transfer.to_host(fragment) if self.to_host else fragment, t.shape, n)

    @torch.no_grad()
    def unpack(self, p: Partitioned) -> torch.Tensor:
        """Collective over the TP group (at the first unpack of `p`): the whole tensor again. Every
        TP rank unpacks the same tensors in the same order, so the gathers pair up."""
        if p.full is None:
            fragment = self.transfer.to_device(p.fragment.tensor).wait() if isinstance(p.fragment, Pending) else p.fragment
            full = torch.empty(fragment.numel() * self.comm.world, dtype=fragment.dtype, device=fragment.device)
            self.comm.all_gather(full, fragment)
            p.full = full[:p.numel].view(p.shape)
        return p.full
