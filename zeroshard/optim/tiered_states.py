"""The optimizer's side of the disk tier (runtime/disk_tier.py): its states of a disk-tier chunk are
views of the chunk's record while the chunk is open, and meta tensors (shape and dtype, no
values) while it is not, so anything that reads them without opening the chunk fails instead of
reading stale values.

A state is *elementwise* when it is a tensor of its parameter's shape (exp_avg, exp_avg_sq,
momentum_buffer): those are tiered, one record field per state name. Scalars (Adam's step) stay
in host memory. torch creates a parameter's state in its first step, as new tensors: closing the
chunk copies them into the record, so no optimizer needs to know about the tier.
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError, TierFileError


class TieredStates:
    """Binds and unbinds the states of `optimizer()` (the user's torch optimizer, built later) for
    the disk tier's open and close."""

    def __init__(self, tier, optimizer):
        self.optimizer = optimizer  # () -> the torch optimizer
        tier.set_binder(self.bind, self.unbind)

    def guard(self, optimizer) -> None:
        """optimizer.state_dict() would hand out meta tensors for the tiered states (torch.save
        writes them without a word, and they load as nothing): it raises instead."""
        def refuse(opt):
            if any(torch.is_tensor(v) and v.is_meta for st in opt.state.values() for v in st.values()):
                raise CheckpointError("zeroshard: the optimizer's states are in the disk tier "
                                      "(offload_optimizer='disk'), not in optimizer.state_dict(): save them with "
                                      "engine.save_checkpoint")
        optimizer.register_state_dict_pre_hook(refuse)

    def bind(self, c, view) -> None:
        """Chunk c opened: each tiered state of its pieces becomes a view of its record."""
        lo = c.owned_range[0]
        for pc in c.pieces:
            st = self.optimizer().state.get(pc.param)
            for k, v in (st or {}).items():
                if torch.is_tensor(v) and v.is_meta:
                    st[k] = view(k, v.dtype)[pc.lo - lo:pc.hi - lo].view(v.shape)

    def unbind(self, c, view) -> None:
        """Chunk c about to close: its pieces' elementwise states are copied into the record where
        the optimizer made new tensors (a first step), then replaced by meta tensors."""
        lo = c.owned_range[0]
        for pc in c.pieces:
            st = self.optimizer().state.get(pc.param)
            for k, v in list((st or {}).items()):
                if torch.is_tensor(v) and v.dim() > 0 and v.shape == pc.shape and not v.is_meta:
                    dst = view(k, v.dtype)[pc.lo - lo:pc.hi - lo].view(v.shape)
                    if dst.data_ptr() != v.data_ptr():
                        dst.copy_(v)
                    st[k] = torch.empty(v.shape, dtype=v.dtype, device="meta")


def agree_on_tier(comm, failure: Exception | None) -> None:
    """After a step's host loop: a rank whose step failed there (its disk tier's TierFileError, or
    anything else raised part way, as by the user's optimizer) raises its error and every other
    rank a TierFileError naming it, instead of leaving them waiting at their next collective."""
    if comm is None or comm.world == 1:
        if failure is not None:
            raise failure
        return
    said = None if failure is None else (
        str(failure) if isinstance(failure, TierFileError) else f"{type(failure).__name__}: {failure}")
    everyone = comm.all_gather_objects(said)
    if failure is not None:
        raise failure
    bad = [(r, m) for r, m in enumerate(everyone) if m is not None]
    if bad:
        r, m = bad[0]
        raise TierFileError(f"zeroshard: the optimizer step of rank {r} failed part way through the disk tier "
                            f"({m}); this rank's update is not consistent with it: resume from the last checkpoint")


def state_bytes_by_side(chunks, optimizer) -> dict[bool, int]:
    """Bytes of `optimizer`'s state tensors for the master pieces of `chunks`, by whether they live
    on the host (a disk-tier chunk's, meta tensors between steps, count on neither side)."""
    host_of = {id(pc.param): c.placement.optimizer_on_host for c in chunks for pc in c.pieces}
    out = {False: 0, True: 0}
    for p, st in optimizer.state.items():
        out[host_of.get(id(p), False)] += sum(v.numel() * v.element_size() for v in st.values()
                                              if isinstance(v, torch.Tensor) and v.dim() > 0 and not v.is_meta)
    return out
