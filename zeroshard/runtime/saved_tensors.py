"""Tensors autograd saves for backward during zeroshard's forward: one pair of saved-tensor hooks
serves these features.
- Stage 3: a saved view of a gathered chunk (a parameter, or a view of one) is kept as a reference
  (hooks.ChunkView) and re-gathered in backward, so the chunk can be released in between.
- P_a, with tensor parallelism: a saved tensor every rank of the TP group holds alike is kept
  1/MP per rank and all-gathered in backward (tensor_parallel.py).
- Activation offload (ZeRO-R's P_a+cpu): other saved tensors (P_a's parts too) wait in host memory
  (offload.py).
- DTensors: a split weight whose local tensor views a gathered stage-3 chunk is kept by reference
  as above; others (activations inside a tensor-parallel region that is not checkpointed) are kept
  as they are, on the device.
- The memory timeline counts saved tensors while it records (timeline.py), and `saved_bytes` what
  the last forward kept (with P_a or activation offload on), for stats().
Model states (chunk storage) are never offloaded or counted as activations.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from .hooks import ChunkView
from .offload import ActivationOffload, Offloaded, Pending, Transfer
from ..distributed.tensor_parallel import as_dtensor, local
from .partitioned_activations import Partitioned, PartitionedActivations


class Saved:
    """A tensor saved for backward while zeroshard's saved-tensor hooks are on. `inner` is detached:
    a saved output holding its own graph would make a cycle the garbage collector keeps when no
    backward comes. `version` lets unpacking raise as autograd does on a later in-place change
    (None: an offloaded copy, which the change cannot reach)."""
    __slots__ = ("inner", "version", "__weakref__")

    def __init__(self, inner, version: int | None):
        self.inner, self.version = inner, version


class SplitChunkView:
    """A saved DTensor whose local tensor views a gathered stage-3 chunk: the reference, and a
    storage-less stand-in carrying the DTensor's layout (mesh, placements, shape, stride)."""
    __slots__ = ("view", "like")

    def __init__(self, view: ChunkView, t: DTensor):
        self.view = view
        self.like = as_dtensor(t, torch.empty(0, dtype=t.dtype, device="meta"))


class SavedTensorHooks:
    """`stage3`: the stage-3 hooks (None below stage 3); `chunks`: the engine's current chunks (they
    change when it re-packs); `offload_activations`: keep saved activations on the host;
    `partition`: P_a over the TP group (None: off)."""

    def __init__(self, device: torch.device, transfer: Transfer, stage3, chunks: Callable[[], list],
                 offload_activations: bool, partition: PartitionedActivations | None = None):
        self.device = device
        self.stage3 = stage3
        self.chunks = chunks
        self.offload = ActivationOffload(transfer, self.is_model_state) if offload_activations else None
        self.partition = partition
        self._by_reference = False  # this forward saves stage-3 chunk views by reference
        self._timeline = None  # the memory timeline recording this forward, if any
        # with P_a or activation offload: bytes of activations the last forward saved for backward,
        # by where they wait ("device", "host"), each storage once; None before the first forward
        self.saved_bytes: dict[str, int] | None = None
        self._storages: set = set()

    def needed(self, timeline) -> bool:
        """Whether a forward needs the hooks (with the engine's timeline, recording or not)."""
        recording = timeline is not None and timeline.recording
        return self.stage3 is not None or self.offload is not None or self.partition is not None or recording

    def features(self) -> list[str]:
        """What these hooks do beyond stage 3's references, by the config's words."""
        return ["offload_activations"] * (self.offload is not None) + ["P_a (partition_activations)"] * (
            self.partition is not None)

    def begin_forward(self, timeline, by_reference: bool) -> None:
        """The hooks on, innermost, for one forward, until end_forward. `by_reference`: stage-3
        chunk views may be saved as references (not in the forward that may re-pack chunks:
        references would name old chunks). Hooks of this object still on the stack are stale (a
        forward a BaseException interrupted): taken off first."""
        while self._ours_on_top():
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self._by_reference = by_reference
        self._timeline = timeline if timeline is not None and timeline.recording else None
        if self.partition is not None or self.offload is not None:
            self.saved_bytes, self._storages = {"device": 0, "host": 0}, set()
        if self.partition is not None:
            self.partition.begin_forward()
        if self.offload is not None:
            self.offload.begin_forward()
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)

    def end_forward(self) -> bool:
        """The hooks off, where they are still the innermost; False where they are not (hooks
        pushed over them since a forward a BaseException interrupted: they stay, under those, and
        the next begin_forward finds them stale)."""
        self._timeline = None
        self._storages = set()
        if not self._ours_on_top():
            return False
        torch._C._autograd._pop_saved_tensors_default_hooks()
        return True

    def _ours_on_top(self) -> bool:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] == self.pack

    def _count(self, t: torch.Tensor, on_host: bool) -> None:
        if self.saved_bytes is None:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less subclass
            return
        if storage.data_ptr() not in self._storages:
            self._storages.add(storage.data_ptr())
            self.saved_bytes["host" if on_host else "device"] += storage.nbytes()

    def pack(self, t: torch.Tensor):
        if isinstance(t, DTensor):  # see the module docstring
            if self.stage3 is not None and self._by_reference:  # a split weight: its local tensor views a chunk
                ref = self.stage3.pack_chunk_view(local(t))
                if ref is not None:
                    return SplitChunkView(ref, t)
            return Saved(t.detach(), t._version)
        if self.stage3 is not None and self._by_reference:
            ref = self.stage3.pack_chunk_view(t)
            if ref is not None:
                return ref
        tl = self._timeline
        if self.partition is not None and t.is_floating_point() and t.device == self.device \
                and not isinstance(t, torch.nn.Parameter) and not self.is_model_state(t):
            part = self.partition.pack(t)
            if part is not None:
                piece = part.fragment.tensor if isinstance(part.fragment, Pending) else part.fragment
                on_host = isinstance(part.fragment, Pending)
                self._count(piece, on_host)
                return tl.track(part, piece, on_host) if tl is not None else part
        packed = self.offload.pack(t) if self.offload is not None else t
        if isinstance(packed, Offloaded):
            host = packed.pending.tensor
            self._count(host, True)
            return tl.track(Saved(packed, None), host, on_host=True) if tl is not None else packed
        saved = Saved(t.detach(), t._version)
        if (tl is not None or self.saved_bytes is not None) and not self.is_model_state(t):
            on_host = t.device.type == "cpu" and self.device.type != "cpu"
            self._count(t, on_host)
            if tl is not None:
                tl.track(saved, t, on_host)
        return saved

    def unpack(self, packed):
        if isinstance(packed, Saved):
            if packed.version is not None and packed.inner._version != packed.version:
                raise RuntimeError(
                    "zeroshard: a tensor saved for backward was modified by an inplace operation after it "
                    f"was saved (version {packed.inner._version}, saved at {packed.version}; shape "
                    f"{tuple(packed.inner.shape)}): autograd would compute a wrong gradient")
            packed = packed.inner
        if isinstance(packed, ChunkView):
            return self.stage3.unpack_chunk_view(packed)
        if isinstance(packed, SplitChunkView):
            return as_dtensor(packed.like, self.stage3.unpack_chunk_view(packed.view))
        if isinstance(packed, Partitioned):
            return self.partition.unpack(packed)
        if isinstance(packed, Offloaded):
            return self.offload.unpack(packed)
        return packed

    def is_model_state(self, t: torch.Tensor) -> bool:
        """Whether `t` is (a view of) model state: a chunk's storage."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less subclass: not a chunk
            return False
        return any(x is not None and x.untyped_storage().data_ptr() == ptr
                   for c in self.chunks() for x in (c.full, c.shard, c.master))
