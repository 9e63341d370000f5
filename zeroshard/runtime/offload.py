"""Offload: which model states live in host memory, and the one layer that moves bytes between the
host and the device.

Device, host, placement, d2h/h2d: docs/vocabulary.md. The config sets one placement for every
chunk; the planner (planning/planner.py) chooses chunk by chunk.

ZeRO-Offload's data path through this module: a chunk's reduced gradient goes d2h as soon as its
reduction is done (during backward); the optimizer step runs on the host chunk by chunk, and each
updated shard goes h2d while the next chunk steps. With offloaded parameters (stage 3), a shard goes
h2d each time its chunk is gathered. Activation offload (ZeRO-R's P_a+cpu) sends tensors saved for
backward d2h in forward and brings them back in backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.weak import WeakTensorKeyDictionary


@dataclass(frozen=True)
class Placement:
    """Where one chunk's model states live."""

    optimizer_on_host: bool = False  # fp32 master, optimizer states and the step on the host
    optimizer_on_disk: bool = False  # ... and the master and states kept in the disk tier between steps
    params_on_host: bool = False  # stage 3: the 16-bit parameter shard lives on the host
    params_on_disk: bool = False  # ... and in the parameter tier between uses (offload_params='disk')


class Transfer:
    """Copies between host and device, counted in bytes since the last `reset_counters`.

    With CUDA every copy is issued on one side stream, ordered after the work already queued on the
    compute stream, and returns a `Pending` whose `wait()` orders later compute after it. Host
    buffers are pinned so those copies are truly asynchronous.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def reset_counters(self) -> None:
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of `numel` elements (pinned when CUDA is present)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def host_copy_of(self, t: torch.Tensor) -> torch.Tensor:
        """Set-up only (uncounted): a host buffer holding `t`'s values."""
        out = self.host_empty(t.numel(), t.dtype).view(t.shape)
        out.copy_(t)
        return out

    @contextlib.contextmanager
    def _side(self, device_tensor: torch.Tensor):
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        # The device tensor (a d2h source, an h2d destination) was allocated on the compute stream:
        # its memory must not be handed out again before the side stream is done with it.
        device_tensor.record_stream(self.stream)

    def to_host(self, src: torch.Tensor, out: torch.Tensor | None = None) -> "Pending":
        """Copy device tensor `src` into a host tensor (`out`, or a new one)."""
        out = self.host_empty(src.numel(), src.dtype).view(src.shape) if out is None else out
        with self._side(src):
            out.copy_(src, non_blocking=self.cuda)
        self.d2h_bytes += src.numel() * src.element_size()
        return Pending(self, out)

    def to_device(self, src: torch.Tensor, out: torch.Tensor | None = None) -> "Pending":
        """Copy host tensor `src` into a device tensor (`out`, or a new one)."""
        if out is None:
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        with self._side(out):
            out.copy_(src, non_blocking=self.cuda)
        self.h2d_bytes += src.numel() * src.element_size()
        return Pending(self, out)


class Pending:
    """A copy in flight: `tensor` is its destination. `wait()` makes it safe to use: the host waits
    for a d2h copy; the compute stream waits for an h2d copy (the host does not block). `sync()`
    blocks the host until the copy is done, also after `wait()` (before its source is reused)."""

    def __init__(self, transfer: Transfer, tensor: torch.Tensor):
        self.tensor = tensor
        self.event = None
        if transfer.cuda:
            self.event = torch.cuda.Event()
            self.event.record(transfer.stream)
        self._on_host = tensor.device.type == "cpu"
        self._device = transfer.device
        self._waited = False

    def sync(self) -> None:
        """Block the host until the copy is done (before reusing its source buffer)."""
        if self.event is not None:
            self.event.synchronize()

    def fence(self) -> None:
        """Order later work on the compute stream after this copy, without blocking the host (before
        the compute stream overwrites the source of a download still in flight)."""
        if self.event is not None:
            torch.cuda.current_stream(self._device).wait_event(self.event)

    def wait(self) -> torch.Tensor:
        if self.event is not None and not self._waited:
            # The event is kept: an upload waited for only by the compute stream may still be
            # reading its host source, and sync() must still see that.
            if self._on_host:
                self.event.synchronize()
            else:
                self.fence()
            self._waited = True
        return self.tensor


class Offloaded:
    """A tensor saved for backward, waiting in host memory: `pending`, its copy there (made once,
    however many operations saved the tensor) and, after the first unpack, `device`: the copy back,
    which every later unpack of the same tensor returns (autograd drops it with the last of them)."""

    __slots__ = ("pending", "device")

    def __init__(self, pending: Pending):
        self.pending, self.device = pending, None


class ActivationOffload:
    """Keeps tensors saved for backward in host memory between forward and backward.

    The engine calls pack/unpack from its saved-tensor hooks around the model's forward. With
    activation checkpointing, the tensors saved outside checkpointed regions are the checkpoints
    (the regions' inputs) and what the layers outside any region save (the embedding's output, the
    final norm, the head and the loss), so this is ZeRO-R's P_a+cpu plus those; without
    checkpointing every saved activation is offloaded. A tensor several operations save (the
    log-probabilities that both log_softmax and nll_loss keep, a block's input kept by its norm and
    its residual add) is copied once each way (`Offloaded`). Parameters (and views of chunk
    storage) are never offloaded: they are model states, not activations.
    """

    def __init__(self, transfer: Transfer, is_model_state):
        self.transfer = transfer
        self.is_model_state = is_model_state
        # tensor -> (its version when copied, Offloaded), for the forward running now. Weak keys:
        # holding the tensors would keep on the device what this class moves off it.
        self._copied = WeakTensorKeyDictionary()

    def begin_forward(self) -> None:
        self._copied = WeakTensorKeyDictionary()

    def pack(self, t: torch.Tensor):
        """`t` itself (model states, tensors not on the device), or its Offloaded copy."""
        if isinstance(t, nn.Parameter) or t.device != self.transfer.device or self.is_model_state(t):
            return t
        seen = self._copied.get(t)
        if seen is not None and seen[0] == t._version:
            return seen[1]
        out = Offloaded(self.transfer.to_host(t))
        self._copied[t] = (t._version, out)
        return out

    def unpack(self, packed):
        if not isinstance(packed, Offloaded):
            return packed
        if packed.device is None:
            # The upload reads the host copy on the same side stream that wrote it, so stream order
            # already puts it after the download: the host need not wait (a sync per saved tensor
            # in backward would stall the queueing of the next kernels).
            packed.device = self.transfer.to_device(packed.pending.tensor).wait()
        return packed.device


def fold_host_grad(host: torch.Tensor | None, in_flight: Pending | None) -> torch.Tensor | None:
    """A chunk's host gradient with the copy still in flight added in (waited for first)."""
    if in_flight is None:
        return host
    arrived = in_flight.wait()
    return arrived if host is None else host.add_(arrived)
