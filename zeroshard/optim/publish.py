"""Bringing an update into the compute parameters (item 4 of optimizer.py's docstring): the 16-bit
copy of each updated master, written on the master's side (the shard itself, or a buffer for an
upload or a download), and at stages 1-2 the all-gathers that give every rank the whole updated
chunk. Publishing is the part of ShardedOptimizer (optimizer.py, the one class built on it) that
does it; its attributes are set by ShardedOptimizer.__init__.
"""
from __future__ import annotations

import torch

from ..distributed.ordering import PUBLISH


class Publishing:
    """The 16-bit copy, its upload or download, and the all-gathers of an update (uses
    ShardedOptimizer's chunks, comm, shards and staging buffers)."""

    def _copy_target(self, c) -> torch.Tensor | None:
        """Where the 16-bit copy of an updated master goes when it can be written on the master's
        side: the shard itself when both live on the same side, a host staging buffer when the
        master is on the host and the shard on the device, a device buffer when it is the other way
        round (host chunks step one at a time, so two staging buffers take turns: _staging_for).
        None in fp32: the master itself is (or is copied into) the shard."""
        if c.master_is_shard:
            return None
        shard_on_host = c.stage == 3 and c.placement.params_on_host
        if c.placement.optimizer_on_host == shard_on_host:
            return c.shard
        if self.dtype == torch.float32:
            return None
        if c.placement.optimizer_on_host:
            return self._staging_for(c)
        # master on the device, shard on the host: convert on the device, then download
        return torch.empty(c.master.numel(), dtype=self.dtype, device=c.master.device)

    def _staging_for(self, c) -> torch.Tensor:
        """A host 16-bit buffer for uploading chunk c's update: a ring of two buffers (ZeRO-R's
        constant-size buffers), each reused only once the upload that last read it has finished."""
        slot = self._staging_turn
        self._staging_turn ^= 1
        buf, reader = self._staging[slot]
        if reader is not None:
            reader.sync()
        if buf is None:  # zeroed once: elements outside master pieces are uploaded as they are
            buf = c.transfer.host_empty(max(x.owned_numel for x in self.chunks), self.dtype).zero_()
        self._staging[slot] = (buf, None)
        self._staging_slot_of[id(c)] = slot
        return buf[:c.master.numel()]

    def _publish(self, c, target) -> None:
        """Bring chunk c's updated master into its compute shard."""
        if not c.master_is_shard:
            if target is not None and not self._all_copied(c, self.optimizer):
                target.copy_(c.master)
            if target is c.shard:
                pass
            elif c.placement.optimizer_on_host:  # master on the host, shard on the device: upload
                upload = c.transfer.to_device(c.master if target is None else target, out=c.shard)
                slot = self._staging_slot_of.pop(id(c), None)
                if slot is not None:
                    self._staging[slot] = (self._staging[slot][0], upload)
                upload.wait()
                if target is None and c.placement.optimizer_on_disk:  # it reads the tier's frame
                    upload.sync()
            else:  # master on the device, shard offloaded to the host: download
                c.transfer.to_host(c.master if target is None else target, out=c.shard).wait()

    @staticmethod
    def _all_copied(c, opt) -> bool:
        """Whether `opt` (CPUAdamW) wrote the 16-bit copy of every master piece of chunk c while
        stepping it (not a piece that got no gradient, nor without its compiled kernel). Elements
        outside the pieces (alignment gaps, padding) are never read as parameters."""
        copied = getattr(opt, "copied", ())
        return bool(c.pieces) and all(id(pc.param) in copied for pc in c.pieces)

    def _gather_updated(self, compare: bool = True) -> None:
        """Stages 1-2: start every updated chunk's all-gather, which gives every rank the whole
        updated chunk; step() does not wait: the chunk *arrives* (Chunk.arriving, arrival.ArrivalHooks).
        `compare`: first compare a tag (PUBLISH) so a rank whose update failed never pairs its
        next collectives with these (a delayed update, which lands a step later). step()'s own
        update issues them at once: a rank whose update raises issues them too
        (_gather_after_failure), saving the step a round trip."""
        if self.stage not in (1, 2) or self.shards.world == 1:
            return
        if compare:
            self.comm.agree(PUBLISH)
        for c in self.chunks:
            c.await_arrival()  # a delayed update's upload into the shard the gather reads
            c.expect_arrival(self.shards.all_gather_owned(c.full, async_op=True))

    def _gather_after_failure(self) -> None:
        """This rank's update raised after every rank agreed to apply it, and the other ranks issue
        their all-gathers without comparing first: issue the same ones (this rank's shards as they
        are), so no rank waits for a gather that never comes, and mark this rank's next order
        comparison (ordering.FAILED_STEP): every rank raises DivergedError there, before any of
        them steps on a model this rank's failure left half-updated. Stage 3: the rCache's
        gathers of the next forward's first chunks, which the engine issues after a step
        (gather_next; runtime/cache.py's Note: gathers at the step's end)."""
        try:
            self._gather_updated(compare=False)
            if self.gather_next is not None:  # stage 3: the peers' forwards wait for these, uncompared
                self.gather_next()
        finally:
            self.comm.mark_failed_step()

    def await_arrivals(self) -> None:
        """Wait for every chunk still arriving (uploads of a landed update, all-gathers of an update:
        on the device where it can) before parameters are read outside a forward."""
        for c in self.chunks:
            c.await_arrival()
