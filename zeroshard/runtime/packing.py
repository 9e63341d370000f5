"""How parameters are placed into chunks: the packing rule (next-fit in order, trainable apart from
frozen), chunk lengths padded to equal aligned shards, the default chunk size, `Slot`, a
parameter's place in its chunk, `MasterPiece`, its part of an owned range, and a new chunk's
initial values (`fill_chunk`; words: docs/vocabulary.md). The engine's layout (layout.py) and the
planner's (planning/planner.py) both pack with this, so the plan describes the chunks that run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

ALIGN = 16  # elements: parameter offsets and shard lengths are multiples, for vectorised kernels


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def pack(numels: list[int], chunk_size: int) -> list[list[tuple[int, int]]]:
    """Assign parameters (given by size, in order of first use) to chunks.

    Next-fit in order: a parameter joins the current chunk if it fits in `chunk_size` elements
    (offsets aligned to ALIGN), else opens a new one; a parameter never straddles two chunks, and one
    larger than `chunk_size` gets a chunk of its own. Returns, per chunk, (index into `numels`, offset
    in elements) of each parameter in it.
    """
    chunks: list[list[tuple[int, int]]] = []
    used = 0
    for i, n in enumerate(numels):
        start = _round_up(used, ALIGN)
        if not chunks or start + n > chunk_size:
            chunks.append([(i, 0)])
            used = n
        else:
            chunks[-1].append((i, start))
            used = start + n
    return chunks


def pack_groups(numels: list[int], trainable: list[bool], chunk_size: int) -> list[tuple[bool, list[tuple[int, int]]]]:
    """The one packing rule (the engine's layout and the planner's both use it): trainable
    parameters first, then frozen ones (no gradient, no optimizer state: their chunks need neither),
    each group next-fit in the given order. Returns, per chunk, (trainable, [(index into `numels`,
    offset)])."""
    out = []
    for group in (True, False):
        members = [i for i, t in enumerate(trainable) if t == group]
        for placed in pack([numels[i] for i in members], chunk_size):
            out.append((group, [(members[j], off) for j, off in placed]))
    return out


def padded_numel(numel: int, world: int) -> int:
    """A chunk's length once padded so that it splits into `world` equal, aligned shards."""
    return _round_up(numel, world * ALIGN)


# Every collective costs a fixed time besides its bytes. Measured here (gloo, 2 ranks on one 2-core
# host): about 1.5 ms per collective at about 1 GB/s, so a 4M-element fp32 chunk (16 MiB) spends a
# tenth of its all-gather on that fixed cost; NCCL's (tens of microseconds at ~100 GB/s) breaks even
# at sizes of the same order. Smaller chunks than this add fixed costs, per-chunk hooks and order
# checks, and save little memory.
EFFICIENT_CHUNK = 1 << 22  # elements


def auto_chunk_size(numels: list[int]) -> int:
    """Default chunk size (elements) until the Elixir search picks one: about an eighth of the
    model but at least EFFICIENT_CHUNK (a model smaller than that is one chunk), at most 64M
    elements, and never smaller than the largest parameter."""
    if not numels:
        return ALIGN
    return max(max(numels), min(1 << 26, max(EFFICIENT_CHUNK, math.ceil(sum(numels) / 8))))


@dataclass
class Slot:
    """Where one parameter lives inside its chunk."""

    param: nn.Parameter
    name: str  # its first fully qualified name in the model
    offset: int  # elements from the start of the chunk
    numel: int
    shape: torch.Size


# Where a chunk's initial values come from: fill(slot, lo, hi) returns elements [lo, hi) of the
# slot's parameter, flattened, in any floating dtype (read as fp32), as one tensor or as an iterable of
# consecutive blocks (a file read a block at a time). A chunk asks only for what its
# rank stores, each range once (layout.py builds the sources: the model's own tensors, a meta-device
# initialiser, pretrained weights, or the chunks of a re-pack).
Fill = Callable[[Slot, int, int], torch.Tensor]


@dataclass
class MasterPiece:
    """One parameter's master piece: chunk elements [lo, hi) of the owned range, and `param`, an
    nn.Parameter aliasing those master elements (shaped as the parameter when it holds all of it,
    1-D otherwise), which is what the user's optimizer steps."""

    slot: Slot
    index: int  # the slot's position in its chunk
    lo: int
    hi: int
    param: nn.Parameter

    @property
    def shape(self) -> torch.Size:
        """The shape of `param` (also while the disk tier holds its values elsewhere)."""
        return self.slot.shape if self.hi - self.lo == self.slot.numel else torch.Size([self.hi - self.lo])


@torch.no_grad()
def fill_chunk(chunk, fill: Fill, comm=None) -> None:
    """Write a new chunk's initial values (chunks.Chunk calls it as it is built). With `comm` (the
    ShardGroups), every rank takes rank 0's values (as DDP does): rank 0 fills the whole chunk in
    fp32 and broadcasts it (other ranks ask `fill` for nothing). Otherwise each rank asks `fill`
    only for the elements it stores (at stage 3, its shard), so no rank holds more of the model
    than its own states plus one parameter."""
    def blocks(got):
        return [got.reshape(-1)] if torch.is_tensor(got) else got

    if comm is not None:
        full32 = torch.zeros(chunk.padded_numel, dtype=torch.float32, device=chunk.device)
        if comm.leader:  # the data-parallel group's rank 0 (hybrid: not every group's shard rank 0)
            for s in chunk.slots:
                full32[s.offset:s.offset + s.numel].copy_(torch.cat(list(blocks(fill(s, 0, s.numel)))))
        comm.broadcast(full32)
        chunk.write_elements(0, chunk.padded_numel, full32)
        return
    lo, hi = chunk.held_range()
    for s in chunk.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            chunk.write_blocks(s, a - s.offset, blocks(fill(s, a - s.offset, b - s.offset)))
