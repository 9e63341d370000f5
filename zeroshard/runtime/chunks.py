"""Chunks: parameters packed into flat buffers, each sharded evenly over the ranks.

The words (chunk, chunk size, slot, shard, owned range, full, master, piece, arriving, placement,
order tag) are defined in docs/vocabulary.md.

Stage 3 chunk states: SHARDED -> GATHERING (an async all-gather in flight) -> GATHERED -> SHARDED.
Gradient states within one backward pass: ACCUMULATING -> REDUCING (a reduction in flight) ->
REDUCED (finished during backward), back to ACCUMULATING at the end of backward; gradients that
arrive late (reentrant checkpointing) set a REDUCING reduction aside (`stash`) or, once REDUCED, start
a new buffer that the end of backward reduces and folds in (reducer.py decides when).
"""
from __future__ import annotations

import enum

import torch

from ..errors import TierFileError, invariant
from .offload import Placement, Transfer
from ..distributed.ordering import GATHER
from ..distributed.tensor_parallel import set_local
from .chunk_grads import ChunkGrads, GradState
from .chunk_master import ChunkMaster
from .chunk_shard_tier import ShardInTier
from .packing import Fill, MasterPiece, Slot, fill_chunk, padded_numel
from .secondary import SecondaryShard

class ChunkState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Chunk(ChunkMaster, ChunkGrads, ShardInTier):
    """One chunk: its storage for a given stage, and the moves between its states.

    Holds no policy: when to gather, reduce or release is decided by the cache and the engine.
    No chunk buffer is ever autograd-tracked: autograd sees only the parameters' views.
    """

    @torch.no_grad()
    def __init__(self, index: int, slots: list[Slot], *, stage: int, rank: int, world: int,
                 dtype: torch.dtype, device: torch.device, trainable: bool, fill: "Fill",
                 comm=None, placement: Placement = Placement(), transfer: Transfer | None = None,
                 grad_dtype: torch.dtype | None = None, secondary: tuple[int, int] = (0, 1),
                 split: tuple[int, int] = (0, 1)):
        self.index = index
        self.slots = slots
        self.stage = stage
        self.trainable = trainable
        self.dtype = dtype
        self.grad_dtype = grad_dtype or dtype  # gradients accumulated and reduced in it (precision.py)
        self.device = device
        self.placement = placement
        self.transfer = transfer or Transfer(device)
        self.numel = slots[-1].offset + slots[-1].numel
        self.padded_numel = padded_numel(self.numel, world * split[1])
        self.shard_numel = self.padded_numel // world
        lo = rank * self.shard_numel
        self.shard_range = (lo, lo + self.shard_numel)
        self.reduced_range = (0, self.padded_numel) if stage == 0 else self.shard_range  # its gradient
        self.owned_range = self.reduced_range  # what this rank's optimizer steps
        if split[1] > 1:  # split = (this rank's replica, replicas): 1/R of the shard (shard_groups.py)
            m = self.shard_numel // split[1]
            self.owned_range = (lo + split[0] * m, lo + (split[0] + 1) * m)

        # Storage, zeroed (the padding stays zero), then filled with the initial values.
        if stage == 3:
            self.full = None
            self.shard = self.transfer.host_empty(self.shard_numel, dtype) if placement.params_on_host \
                else torch.empty(self.shard_numel, dtype=dtype, device=device)
            self.shard.zero_()
            self.state = ChunkState.SHARDED
        else:
            self.full = torch.zeros(self.padded_numel, dtype=dtype, device=device)
            self.shard = self.full[self.owned_range[0]:self.owned_range[1]]  # stage 0: the whole chunk
            self.state = ChunkState.GATHERED
        # hpZ: secondary = (this rank's place in its secondary group, the group's size)
        self.secondary = SecondaryShard(self.padded_numel, *secondary, dtype, device) \
            if stage == 3 and secondary[1] > 1 else None
        self.master = None
        self.tier = None  # the disk tier holding the master once adopted (keep_master_in)
        self.shard_tier = None  # stage 3, offload_params='disk': the tier holding the shard (keep_shard_in)
        self.gather_flags = None  # ... and the ranks' read failures, gathered beside the chunk
        # fp32 training with master and shard on the same side: the optimizer updates the compute
        # storage itself; otherwise the master is an fp32 copy on the optimizer's side (the disk
        # tier's always: the shard is not written behind).
        self.master_is_shard = dtype == torch.float32 and not placement.optimizer_on_disk and (
            placement.optimizer_on_host == (stage == 3 and placement.params_on_host))
        if trainable:
            if self.master_is_shard:
                self.master = self.shard
            else:
                self.master = self.new_master().zero_()
        fill_chunk(self, fill, comm)
        self.pieces: list[MasterPiece] = self._master_pieces() if trainable else []
        # In-flight async collectives. Gathers and reductions are independent and can overlap (a
        # chunk re-gathered in backward while its gradient is being reduced), so each has its own.
        self.gather_work = None
        self.reduce_work = None

        # Gradients (trainable chunks only). Stages 0-1 keep the full gradient for the whole step;
        # stages 2-3 keep only the reduced shard, and the full gradient lives from the first
        # gradient of a backward pass until this chunk's reduce-scatter completes.
        self.grad_full = None
        self.grad_shard = None
        # Stage 0 with peers: each slot's "got a gradient here" flag rides at the end of grad_full,
        # summed by the same all-reduce (ChunkGrads.presence): the step needs no collective.
        self.presence_tail = len(slots) if stage == 0 and world > 1 else 0
        self.presence: torch.Tensor | None = None
        if trainable and stage <= 1:
            self.grad_full = torch.zeros(self.grad_numel, dtype=self.grad_dtype, device=device)
        self.grads_seen = 0  # parameters whose gradient arrived in this backward pass
        self.grad_state = GradState.ACCUMULATING
        self.stash = None  # (reduced buffer, its work) set aside when a late gradient arrives
        self.expected_grads = len(slots) if trainable else 0
        # Slots (by index) that got a gradient on this rank since the last step: a parameter that got
        # none on any rank is not stepped (torch skips a parameter whose .grad is None).
        self.slots_with_grad: set[int] = set()
        self._slot_index = {id(s): i for i, s in enumerate(slots)}
        # Slots of grad_full holding no value of this step yet (None: all do): the step leaves a
        # stage 0-1 buffer as it was, and stages 2-3 take a new one per backward pass unzeroed
        # (zeroing is a pass over the chunk: on the step's path, or before each pass's first
        # gradient). A slot's first gradient overwrites it; the slots none reached are zeroed
        # before the buffer is reduced or read (_settle_grad). Gaps between slots stay zero.
        self._unwritten: set[int] | None = None
        self._gaps: list[tuple[int, int]] | None = None  # ranges of grad_full outside every slot
        # Optimizer on the host: the reduced gradient of the owned range, accumulated there over
        # micro-batches (compute dtype), and the copy on its way down (waited for before the next).
        self.host_grad = None
        self.grad_in_flight = None
        # An update on its way into this chunk, not yet waited for: the all-gather of an update
        # (stages 1-2), or the delayed update's upload into the shard. The chunk's first use (its
        # module's forward, its stage-3 gather) waits for it, so it overlaps the forward instead of
        # holding back its start.
        self.arriving = None  # anything with wait(): a collective's work, a Pending copy
        if not any(s.param.is_meta for s in slots):  # meta parameters: once every chunk is built
            self.attach_params()

    def attach_params(self) -> None:
        """Point the parameters at this chunk: at their views of the full chunk (stages 0-2), or at
        nothing (stage 3), which frees the storage they had as built at once, not at a first gather."""
        if self.stage != 3:
            self.bind_params()
        else:
            self.unbind_params()

    def held_range(self) -> tuple[int, int]:
        """The chunk elements whose value this rank stores: the whole chunk at stages 0-2, the shard
        at stage 3."""
        return self.shard_range if self.stage == 3 else (0, self.padded_numel)

    @torch.no_grad()
    def write_elements(self, lo: int, hi: int, values: torch.Tensor, written: bool = False) -> None:
        """Write chunk elements [lo, hi) (`values`, any floating dtype, read as fp32) into every copy
        of them this rank keeps: the full chunk or the shard in the compute dtype, and the fp32 master.
        `written`: `values` are the compute copy after a user's in-place write into it (keep_written),
        so the full chunk at stages 0-2 holds them already, and the master takes only the elements
        that no longer equal its rounding."""
        def put(dst: torch.Tensor, dst_lo: int, merge: bool = False) -> None:
            a, b = max(lo, dst_lo), min(hi, dst_lo + dst.numel())
            if a < b:
                dst, src = dst[a - dst_lo:b - dst_lo], values[a - lo:b - lo]
                dst.copy_(torch.where(src != dst.to(src.dtype), src.to(dst.dtype), dst) if merge else src)

        if self.full is not None and self.stage < 3:
            if not written:
                put(self.full, 0)
        else:
            with self.shard_values(write=True):
                put(self.shard, self.shard_range[0])
            self.forget_secondary()
        if self.master is not None and not self.master_is_shard:
            with self.master_values(write=True):
                put(self.master, self.owned_range[0], merge=written)

    @torch.no_grad()
    def holds_other_values(self, slot: Slot, value: torch.Tensor) -> bool:
        """Stage 3: whether the shard holds other values for parameter `slot`'s elements in it than
        `value` (the parameter's gathered copy, whole)."""
        lo, hi = self.shard_range
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            return False
        with self.shard_values():
            held = self.shard[a - lo:b - lo].to(value.device)
        return not torch.equal(held, value.detach().reshape(-1)[a - slot.offset:b - slot.offset])

    def keep_written(self, slot: Slot, value: torch.Tensor) -> None:
        """Keep a user's in-place write into parameter `slot` (`value`: the parameter's compute copy
        now, whole) in the copies this rank keeps. Of a 16-bit copy, only the elements that no longer
        equal their master's rounding reach the fp32 master: a write into one row leaves the fp32
        values of the others as they were (optim/user_writes.py)."""
        self.write_elements(slot.offset, slot.offset + slot.numel, value.detach().reshape(-1), written=True)

    def write(self, slot: Slot, lo: int, hi: int, values: torch.Tensor) -> None:
        """Write elements [lo, hi) of one parameter (flattened) into the copies this rank keeps."""
        self.write_elements(slot.offset + lo, slot.offset + hi, values.reshape(-1))

    def write_blocks(self, slot: Slot, lo: int, blocks) -> None:
        """Write consecutive blocks of one parameter's flattened elements, from element `lo` on."""
        for block in blocks:
            self.write(slot, lo, lo + block.numel(), block)
            lo += block.numel()

    def discard(self) -> None:
        """Drop this chunk's storage (a re-pack copied it into new chunks, which own it now)."""
        self.full = self.shard = self.master = None
        self.pieces = []
        self.grad_full = self.grad_shard = self.host_grad = None

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole chunk in the compute dtype (what one gathered copy occupies)."""
        return self.padded_numel * self.dtype.itemsize

    # -- parameters ---------------------------------------------------------------------------
    # Note: inference mode. A chunk gathered, or bound, inside torch.inference_mode() (an evaluation,
    # Lightning's validation loop) would be an inference tensor, and the parameters views of it;
    # kept in the rCache into training, autograd refuses to save them ("Inference tensors cannot be
    # saved for backward"). Its buffer and views are therefore made outside inference mode.
    @torch.inference_mode(False)
    def bind_params(self) -> None:
        """Point every parameter's data at its view of the full chunk."""
        for s in self.slots:
            set_local(s.param, self.full[s.offset:s.offset + s.numel].view(s.shape))

    @torch.inference_mode(False)
    def unbind_params(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for s in self.slots:
            set_local(s.param, empty)

    def expect_arrival(self, work) -> object:
        """An update is on its way into this chunk (anything with wait(): a collective's work, a
        Pending copy); await_arrival waits for it. Returns `work`."""
        self.arriving = work
        return work

    def count_grad(self) -> None:
        """One more parameter's gradient arrived in this backward pass."""
        self.grads_seen += 1

    def await_arrival(self) -> None:
        """Wait for the update arriving into this chunk, if any (on the device where it can)."""
        if self.arriving is not None:
            self.arriving.wait()
            self.arriving = None

    # -- stage 3 gather / release ---------------------------------------------------------------
    @property
    def shard_in_memory(self) -> bool:
        """This rank's shard lies on the device: a gather of it starts without a read first (not
        from the host, offload_params; not from the parameter tier, 'disk')."""
        return self.shard_tier is None and not self.placement.params_on_host

    def start_gather(self, comm, compare: bool = True) -> None:
        """SHARDED -> GATHERING: allocate the full chunk and start the all-gather (hpZ, with the
        secondary shards current: over the secondary group, from them). `compare`: False for a
        gather every rank issues at the same point of the step without an order comparison
        (ChunkCache.gather_after_step), from a shard in memory and no secondary."""
        invariant(self.state is ChunkState.SHARDED, lambda: f"chunk {self.index}: start_gather in {self.state}")
        invariant(compare or self.shard_in_memory and (self.secondary is None or not self.secondary.current),
                  lambda: f"chunk {self.index}: a gather with no comparison from a tier or secondary shards")
        self.await_arrival()
        with torch.inference_mode(False):  # Note: inference mode
            self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=self.device)
        self.state = ChunkState.GATHERING
        if self.secondary is not None and self.secondary.current:
            self.gather_work = self.secondary.start_gather(self.full, comm, self.index)
            return
        shard = self.shard
        if self.shard_tier is not None:  # read into this rank's own slot, then gather in place
            lo, hi = self.shard_range
            self._read_shard(self.full[lo:hi], comm)
            shard = self.full[lo:hi]
        elif self.placement.params_on_host:  # upload into this rank's own slot, then gather in place
            lo, hi = self.shard_range
            shard = self.transfer.to_device(self.shard, out=self.full[lo:hi]).wait()
        self.gather_work = comm.all_gather(self.full, shard, async_op=True,
                                           tag=(GATHER, self.index) if compare else None)

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gather, then point parameters at the data."""
        invariant(self.state is ChunkState.GATHERING,
                  lambda: f"chunk {self.index}: finish_gather in {self.state}")
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
        self.state = ChunkState.GATHERED
        if self.gather_flags is not None:
            self._check_flags()
        self.bind_params()

    def release(self, stale: bool = False) -> None:
        """GATHERED -> SHARDED: free the full chunk (stage 3 only). hpZ: its values become this
        rank's secondary shard, unless `stale` (the parameters are about to change: the step)."""
        if self.state is ChunkState.GATHERING:
            try:
                self.finish_gather()
            except TierFileError:
                if self.state is ChunkState.SHARDED:  # a prefetch whose shard every rank saw unread: the
                    return  # next gather of it raises (the tier failed); a release, a flush, goes on
                raise
        if self.state is ChunkState.SHARDED and self.shard_tier is not None and self.shard_tier.failed is not None:
            return  # its gather failed (finish_gather raised): nothing was gathered
        invariant(self.state is ChunkState.GATHERED, lambda: f"chunk {self.index}: release in {self.state}")
        if self.secondary is not None:
            self.secondary.forget() if stale else self.secondary.keep(self.full)
        self.unbind_params()
        self.full = None
        self.state = ChunkState.SHARDED

    def forget_secondary(self) -> None:
        """hpZ: the parameters change (a step, a load): the next gather reads the primary shards."""
        if self.secondary is not None:
            self.secondary.forget()
