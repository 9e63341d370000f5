"""A stage-3 chunk's shard in the parameter tier (offload_params='disk'; runtime/disk_tier.py,
words: docs/vocabulary.md): between uses the shard is a 0-element placeholder and its values are a
record of the tier, opened for each gather (read into the rank's own slot of the full chunk), by
the optimizer's step (overwritten whole), and by every other reader or writer (shard_values). Chunk
(chunks.py) is the one class built on it.
"""
from __future__ import annotations

import contextlib

import torch

from ..distributed.ordering import SHARD_READ
from ..errors import TierFileError


class ShardInTier:
    """The parameter tier's part of Chunk: its attributes (shard, shard_tier, gather_flags, dtype,
    device, index) are set by Chunk.__init__."""

    def keep_shard_in(self, tier) -> None:
        self.shard_tier = tier

    def bind_shard(self, values: torch.Tensor | None) -> None:
        """Point the shard at `values` (the tier's frame), or at a 0-element tensor (None), so a
        reader that did not open it fails on the size rather than reading stale values."""
        self.shard = values if values is not None else torch.empty(0, dtype=self.dtype)

    @contextlib.contextmanager
    def shard_values(self, write: bool = False, fresh: bool = False):
        """self.shard holds the values for the block: opened from the parameter tier (written back
        after it when `write`; `fresh`: overwritten whole, so not read) if that holds it."""
        if self.shard_tier is None:
            yield
        else:
            with self.shard_tier.opened(self, write, fresh=fresh):
                yield

    def _read_shard(self, out: torch.Tensor, comm) -> None:
        """The parameter tier's shard into this rank's slot of the full chunk, and the ranks' read
        failures gathered beside it (finish_gather raises on every rank): a rank that raised here
        alone would leave the others waiting in this gather."""
        failed = 0
        try:
            with self.shard_values():
                out.copy_(self.shard)
        except TierFileError as e:
            self.shard_tier.fail(e)
            failed = 1
        flags = torch.zeros(comm.world, dtype=torch.int32, device=self.device)
        flags[comm.rank] = failed
        with comm.uncounted():  # tagged: with order checks on, issued in turn, not after a drain
            work = comm.all_gather(flags, flags[comm.rank:comm.rank + 1].clone(), async_op=True,
                                   tag=(SHARD_READ, self.index))
        self.gather_flags = (flags, work)

    def _check_flags(self) -> None:
        flags, work = self.gather_flags
        self.gather_flags = None
        if work is not None:
            work.wait()
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad:  # back to SHARDED: the next use gathers (and, the tier having failed, raises) again
            self.full = None
            self.state = type(self.state).SHARDED
            mine = self.shard_tier.failed
            e = TierFileError(f"zeroshard: rank {bad[0]} could not read chunk {self.index}'s parameter shard from "
                              f"its disk tier{f' ({mine})' if mine is not None else ''}; the model's parameters "
                              "are lost: resume from the last checkpoint in a new engine")
            # every rank's tier fails alike: each later read, on every rank, raises at the same place
            self.shard_tier.fail(e)
            raise e

