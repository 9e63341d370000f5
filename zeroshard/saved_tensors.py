"""Tensors autograd saves for backward during zeroshard's forward: one pair of saved-tensor hooks
serves three features.
- Stage 3: a saved view of a gathered chunk (a parameter, or a view of one) is kept as a reference
  (hooks.ChunkView) and re-gathered in backward, so the chunk can be released in between.
- Activation offload (ZeRO-R's P_a+cpu): other saved tensors wait in host memory (offload.py).
- The memory timeline counts saved tensors while it records (timeline.py).
Model states (chunk storage) are never offloaded or counted as activations.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .hooks import ChunkView
from .offload import ActivationOffload, Pending, Transfer


class Saved:
    """A tensor saved for backward while zeroshard's saved-tensor hooks are on. `inner` is detached:
    a saved output holding its own graph would make a cycle the garbage collector keeps when no
    backward comes. `version` lets unpacking raise as autograd does on a later in-place change
    (None: an offloaded copy, which the change cannot reach)."""
    __slots__ = ("inner", "version", "__weakref__")

    def __init__(self, inner, version: int | None):
        self.inner, self.version = inner, version


class SavedTensorHooks:
    """`stage3`: the stage-3 hooks (None below stage 3); `chunks`: the engine's current chunks (they
    change when it re-packs); `offload_activations`: keep saved activations on the host."""

    def __init__(self, device: torch.device, transfer: Transfer, stage3, chunks: Callable[[], list],
                 offload_activations: bool):
        self.device = device
        self.stage3 = stage3
        self.chunks = chunks
        self.offload = ActivationOffload(transfer, self.is_model_state) if offload_activations else None
        self._by_reference = False  # this forward saves stage-3 chunk views by reference
        self._timeline = None  # the memory timeline recording this forward, if any

    def needed(self, timeline) -> bool:
        """Whether a forward needs the hooks (with the engine's timeline, recording or not)."""
        recording = timeline is not None and timeline.recording
        return self.stage3 is not None or self.offload is not None or recording

    @contextlib.contextmanager
    def around_forward(self, timeline, by_reference: bool):
        """The hooks, for one forward. `by_reference`: stage-3 chunk views may be saved as
        references (not in the forward that may re-pack chunks: references would name old chunks)."""
        self._by_reference = by_reference
        self._timeline = timeline if timeline is not None and timeline.recording else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._timeline = None

    def pack(self, t: torch.Tensor):
        if self.stage3 is not None and self._by_reference:
            ref = self.stage3.pack_chunk_view(t)
            if ref is not None:
                return ref
        packed = self.offload.pack(t) if self.offload is not None else t
        tl = self._timeline
        if isinstance(packed, Pending):
            return tl.track(Saved(packed, None), packed.tensor, on_host=True) if tl is not None else packed
        saved = Saved(t.detach(), t._version)
        if tl is not None and not self.is_model_state(t):
            tl.track(saved, t, t.device.type == "cpu" and self.device.type != "cpu")
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
        if isinstance(packed, Pending):
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
