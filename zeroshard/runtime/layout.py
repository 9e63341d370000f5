"""The chunk layout: which chunk each parameter lives in, and whether that may still change.

The layout is the list of chunks in packing order, with each parameter's slot (docs/vocabulary.md).
Chunks are first packed in module order; the first training forward records the order of
first use (first_use.FirstUseRecorder), and the engine re-packs once if it differs, so that stage 3
gathers chunks in the order the model needs them. After that (or from the start, when a profile or a
checkpoint gave the order) the layout is *final*: chunks never move again.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn as nn

from .chunks import Chunk, ChunkState
from .packing import Fill, Slot, pack_groups
from ..distributed.collectives import Comm
from .first_use import FirstUseRecorder
from ..units import direct_params
from .offload import Placement, Transfer
from ..errors import UnsupportedModelError

log = logging.getLogger("zeroshard")


def list_parameters(module: nn.Module) -> tuple[list[nn.Parameter], dict[int, str]]:
    """The module's parameters, deduplicated (tied weights are one parameter), with their first name."""
    params, names = [], {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        params.append(p)
    if not params:
        raise UnsupportedModelError("zeroshard: the model has no parameters")
    return params, names


def resolve_state(module: nn.Module, device: torch.device) -> list[tuple[str, object]]:
    """The keys of the module's own state_dict with their objects, resolved now, before stage 3
    swaps the modules' parameter entries (checkpoints name things by them); buffers are moved onto `device`."""
    for name, b in module.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = b.to(device)
    return list(module.state_dict(keep_vars=True).items())


class ChunkLayout:
    """`placement_of(index)`: where chunk `index`'s model states live. `real_params(module)`: a
    module's direct parameters even while stage 3 has placeholders in their place."""

    def __init__(self, names: dict[int, str], shapes: dict[int, torch.Size], *, stage: int,
                 comm: Comm, dtype: torch.dtype, device: torch.device, transfer: Transfer, chunk_size: int,
                 placement_of: Callable[[int], Placement], grad_dtype: torch.dtype | None = None,
                 shard_tier=None):
        self.names, self.shapes = names, shapes
        self.stage, self.comm, self.dtype, self.device, self.transfer = stage, comm, dtype, device, transfer
        self.chunk_size = chunk_size  # elements per chunk (raised to the largest parameter)
        self.grad_dtype = grad_dtype or dtype
        self.placement_of = placement_of
        self.shard_tier = shard_tier  # offload_params='disk': the parameter tier (disk_tier.py)
        self.built_hooks: list[Callable[[Chunk], None]] = []  # called with each chunk as it is built
        self.real_params: Callable[[nn.Module], list] = direct_params  # see read_params_with
        self.chunks: list[Chunk] = []
        self.slot_of: dict[int, tuple[Chunk, Slot]] = {}  # id(param) -> its chunk and slot
        self._module_chunks: dict[nn.Module, list[Chunk]] = {}
        self.recorder: FirstUseRecorder | None = None
        self.final = False
        # id(param) -> whether its chunk is trainable: a re-pack keeps each parameter's chunk kind (a
        # parameter frozen later still gets no gradient, so it is not stepped; one unfrozen later
        # makes its chunk trainable: thaw).
        self.trainable: dict[int, bool] = {}

    def build(self, order: list[nn.Parameter], fill: Fill, broadcast: bool,
              prepare: Callable[[list[Slot]], None] = lambda slots: None) -> None:
        """Pack `order` into chunks (trainable and frozen parameters apart: frozen ones have no
        gradients and no optimizer state), one chunk at a time, taking initial values from `fill`
        (chunks.Fill). `broadcast`: ranks take rank 0's values. `prepare(slots)`: called on every
        rank before each chunk is built (a collective may run in it)."""
        chunks, self.slot_of, self._module_chunks = [], {}, {}
        for p in order:
            self.trainable.setdefault(id(p), p.requires_grad)
        numels, trainable = [self.shapes[id(p)].numel() for p in order], [self.trainable[id(p)] for p in order]
        for group, placed in pack_groups(numels, trainable, self.chunk_size):
            slots = [Slot(order[i], self.names[id(order[i])], off, numels[i], self.shapes[id(order[i])])
                     for i, off in placed]
            prepare(slots)
            c = Chunk(len(chunks), slots, stage=self.stage, rank=self.comm.rank, world=self.comm.world,
                      dtype=self.dtype, device=self.device, trainable=group, fill=fill,
                      comm=self.comm if broadcast else None, placement=self.placement_of(len(chunks)),
                      transfer=self.transfer, grad_dtype=self.grad_dtype,
                      secondary=(self.comm.secondary_rank, self.comm.secondary_size),
                      split=self.comm.optimizer_split)
            self._to_tier(c)
            for hook in self.built_hooks:
                hook(c)
            chunks.append(c)
            for s in slots:
                self.slot_of[id(s.param)] = (c, s)
        self.chunks = chunks

    def when_built(self, hook: Callable[[Chunk], None]) -> None:
        """Call hook(chunk) as each chunk is built, before the next (the optimizer's disk tier takes
        its master then)."""
        self.built_hooks.append(hook)

    def _to_tier(self, c: Chunk) -> None:
        """offload_params='disk': a chunk just built puts its shard in the parameter tier, so host
        memory never holds every shard while the model is packed."""
        if self.shard_tier is not None and c.placement.params_on_disk:
            self.shard_tier.extend(c)
            c.keep_shard_in(self.shard_tier)
            self.shard_tier.adopt(c)

    def repack(self, order: list[nn.Parameter]) -> None:
        """Collective: pack the parameters anew in `order`, values kept. The chunks are new objects:
        whoever holds the old ones (the rCache, the optimizer) must have let them go and be given
        these. Streams: each new chunk is built from the old chunks it draws on, gathered (fp32) one
        new chunk at a time, and an old chunk lets go of its storage once every parameter in it has
        moved, so no rank ever holds the whole model: at most its model states twice over (the old
        masters stay alive while the optimizer holds their pieces) plus the chunks in transit."""
        log.info("re-packing %d chunks in order of first use", len(self.chunks))
        self.release_gathered()
        old_of = {id(s.param): (c, s) for c in self.chunks for s in c.slots}
        left = {c: len(c.slots) for c in self.chunks}
        gathered: dict[Chunk, torch.Tensor] = {}

        def prepare(slots: list[Slot]) -> None:  # the same old chunks, in the same order, on every rank
            need = list(dict.fromkeys(old_of[id(s.param)][0] for s in slots))
            for c in [c for c in gathered if c not in need]:
                del gathered[c]
            for c in need:
                if c not in gathered:
                    gathered[c] = self.full_fp32(c)
            for s in slots:
                c = old_of[id(s.param)][0]
                left[c] -= 1
                if not left[c]:
                    c.discard()  # its values live on in `gathered` until this chunk is built

        def fill(slot: Slot, lo: int, hi: int) -> torch.Tensor:
            c, s = old_of[id(slot.param)]
            return gathered[c][s.offset + lo:s.offset + hi]

        with self.comm.uncounted():
            self.build(order, fill, broadcast=False, prepare=prepare)

    def adopt_shards(self) -> None:
        """offload_params='disk': the parameter tier holds these chunks' shards from now on (taken
        as each was built: _to_tier); a re-pack's old chunks' records are forgotten."""
        if self.shard_tier is not None:
            self.shard_tier.attach([c for c in self.chunks if c.placement.params_on_disk])

    def read_params_with(self, real_params: Callable[[nn.Module], list]) -> None:
        """How to list a module's direct parameters (stage 3: past its placeholders)."""
        self.real_params = real_params

    def differs(self, order: list[nn.Parameter]) -> bool:
        """Whether packing `order` would change the layout (trainable parameters pack first)."""
        current = [s.param for c in self.chunks for s in c.slots]
        want = [p for t in (True, False) for p in order if self.trainable[id(p)] == t]
        return [id(p) for p in want] != [id(p) for p in current]

    def release_gathered(self) -> None:
        """Stage 3, before a re-pack: give back every gathered chunk."""
        for c in self.chunks:
            if self.stage == 3 and c.state is not ChunkState.SHARDED:
                c.release(stale=True)

    def record_first_use(self, module: nn.Module, leaves=()) -> None:
        """Record the order of first use in the next training forward (a leaf unit's parameters as
        one, units.py). Its hooks must run after stage 3's, which put the real parameters in place:
        install them after those."""
        self.recorder = FirstUseRecorder(module, leaves)

    def first_use_order(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """Collective: `params` in the order the recorded forward first used them (unused ones last),
        as rank 0 recorded it. Ranks whose first forward differed (data-dependent control flow)
        would otherwise pack different chunks and pair collectives of different parameters (stage
        0: silently wrong sums; stages 1-2: a hang in the re-pack's all-gather)."""
        index = {id(p): i for i, p in enumerate(params)}
        # not a tensor torch.func.functional_call put in an entry for its call
        recorded = [p for p in self.recorder.order if id(p) in index]
        seen = {id(p) for p in recorded}
        order = recorded + [p for p in params if id(p) not in seen]
        if self.comm.world == 1:
            return order
        orders = self.comm.all_gather_objects([index[id(p)] for p in order])
        if any(o != orders[0] for o in orders) and self.comm.rank == 0:
            log.warning("ranks used the parameters in different orders in their first forward; "
                        "every rank packs chunks in rank 0's order")
        return [params[i] for i in orders[0]]

    def unfrozen(self, names=frozenset()) -> list[Chunk]:
        """The frozen chunks holding a parameter that now requires a gradient (frozen at
        initialize, unfrozen since), or one named in `names`."""
        return [c for c in self.chunks if not c.trainable
                and any(s.param.requires_grad or s.name in names for s in c.slots)]

    def thaw(self, chunks: list[Chunk]) -> None:
        """Make frozen `chunks` trainable (Chunk.make_trainable)."""
        for c in chunks:
            c.make_trainable()
            for s in c.slots:  # a later re-pack keeps them in trainable chunks
                self.trainable[id(s.param)] = True

    def finalize(self) -> None:
        """No re-pack from now on: stop recording first use."""
        if self.recorder is not None:
            self.recorder.remove()
            self.recorder = None
        self.final = True

    def forget(self, module: nn.Module) -> None:
        """`module`'s parameters changed (stage 3 borrowing): find its chunks again when asked."""
        self._module_chunks.pop(module, None)

    def chunks_of(self, module: nn.Module) -> list[Chunk]:
        """The chunks holding `module`'s direct parameters, in order of first appearance."""
        got = self._module_chunks.get(module)
        if got is None:
            got, foreign = [], False
            for _, p in self.real_params(module):
                if id(p) not in self.slot_of:  # a tensor torch.func.functional_call put there for its call
                    foreign = True
                    continue
                c = self.slot_of[id(p)][0]
                if c not in got:
                    got.append(c)
            if not foreign:
                self._module_chunks[module] = got
        return got

    @torch.no_grad()
    def full_fp32(self, c: Chunk) -> torch.Tensor:
        """Collective: chunk c's whole value in fp32 on the device, from the masters (a frozen chunk:
        from its 16-bit copies)."""
        with c.master_values():
            if c.master is not None:
                src, (lo, hi) = c.master.detach(), c.owned_range
                if c.tier is not None:  # a frame of the disk tier, reused once the block ends
                    src = src.clone()
            else:
                with c.shard_values():
                    src, (lo, hi) = c.shard.clone() if c.shard_tier is not None else c.shard, c.owned_range
        src = src.to(self.device)  # an offloaded shard: the collective runs on the device
        if (lo, hi) == (0, c.padded_numel):
            return src.float()
        full = torch.empty(c.padded_numel, dtype=src.dtype, device=self.device)
        full[lo:hi].copy_(src)
        self.comm.all_gather_owned(full)
        return full.float()

    @torch.no_grad()
    def full_values(self) -> dict[int, torch.Tensor]:
        """Full fp32 value of every parameter, by id (a collective; not counted as step traffic)."""
        out = {}
        with self.comm.uncounted():
            for c in self.chunks:
                full = self.full_fp32(c)
                for s in c.slots:
                    out[id(s.param)] = full[s.offset:s.offset + s.numel].view(s.shape)
        return out
