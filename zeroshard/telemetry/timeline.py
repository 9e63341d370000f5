"""Memory timeline: what one rank holds, sampled while training steps run, and a plot of it.

    timeline = engine.record_memory(steps=2)     # the next two optimizer steps
    ... train ...
    timeline.plot("memory.png")                  # or zeroshard.telemetry.timeline.plot({"stage 0": a, "stage 3": b}, path)

The fields of a `Sample`, all in bytes of this rank (model states, gradient buffers, activations:
docs/vocabulary.md):
- model states: parameters (with hpZ, the secondary shards too), gradients and optimizer states
  kept from step to step (what `engine.stats()` calls model_state_bytes), split into device and
  host memory. At stages 0-1 the
  full gradient is kept for the whole step, so it is a model state there.
- rCache: stage-3 chunks gathered in full at that moment (gathering ones included).
- gradient buffers: full-chunk gradients being accumulated or reduced at stages 2-3, freed once
  this rank's shard is kept. Kept buffers: on the CPU, up to three freed ones of each chunk size
  are kept for the next backward (distributed/buffers.py).
- activations: tensors autograd saved for backward that are not model states, each storage
  counted once, from the moment it is saved until autograd lets go of it (after the backward of the
  operation that saved it). Offloaded activations (offload_activations) count as host bytes. A
  saved view counts its whole storage, as that is what stays alive (a batch sliced from a larger
  tensor counts the larger tensor). With activation checkpointing, what a region saves when it is
  recomputed in backward is not seen, nor what non-reentrant regions save.

Samples are taken after each module's forward (modules that own parameters), when each parameter's
gradient arrives, and at the end of the forward, the backward and the optimizer step. On CUDA each
sample also reads `torch.cuda.memory_allocated`, the allocator's view, for comparison.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
import weakref

import torch

from .stats import model_state_bytes

MiB = 2**20


@dataclasses.dataclass
class Sample:
    """One reading. Sizes in bytes; `time_s` in seconds since recording started."""
    step: int              # optimizer steps applied before this sample
    phase: str             # "forward", "backward" or "step"
    where: str             # the module (forward) or parameter (backward) just done; "end" at a phase's end
    time_s: float
    device_states: int
    host_states: int
    cache: int
    grad_buffers: int
    kept_buffers: int      # freed gradient buffers kept for reuse (distributed/buffers.py)
    activations: int       # on the device
    host_activations: int
    allocated: int | None  # torch.cuda.memory_allocated; None off CUDA


class MemoryTimeline:
    """Samples of one rank's memory over the steps recorded. Build it with `engine.record_memory`."""

    def __init__(self, module, chunks, optim, cache, device, rank: int, step: int, steps: int | None, kept=None):
        """`chunks`: a callable giving the chunks now (the layout may re-pack them); `optim`: the
        ShardedOptimizer; `cache`: the ChunkCache; `step`: optimizer steps applied so far (then told
        by step_done); `steps`: how many to record (None: until stop()); `kept`: the BufferPool of
        gradient buffers kept for reuse, or None."""
        self._chunks, self._optim, self._cache, self._device, self.rank = chunks, optim, cache, device, rank
        self._kept = kept
        self.samples: list[Sample] = []
        self.first_step = self.step = step
        self.steps = steps
        self.recording = True
        self._t0 = time.perf_counter()
        self._live: dict[tuple[bool, str, int], list[int]] = {}  # (on host, device, ptr) -> [refs, bytes]
        self._activations = {False: 0, True: 0}
        self._lock = threading.Lock()
        names = {m: n or type(m).__name__ for n, m in module.named_modules()}
        self._handles = [m.register_forward_hook(lambda mod, a, o, n=n: self._module_done(n))
                         for m, n in names.items() if any(p is not None for p in m._parameters.values())]

    def _module_done(self, name: str) -> None:
        if torch._C._current_graph_task_id() != -1:  # a checkpointed region recomputed in backward
            self.sample("backward", name + " (recomputed)")
        else:
            self.sample("forward", name)

    # -- recording ------------------------------------------------------------------------------
    def sample(self, phase: str, where: str = "end") -> None:
        if not self.recording:
            return
        chunks = self._chunks()
        _, by_device = model_state_bytes(chunks, self._optim)
        # Stages 2-3 (at stages 0-1 the full gradient is a model state, counted above).
        grad_buffers = sum(t.numel() * t.element_size() for c in chunks if c.stage >= 2
                           for t in (c.grad_full, (c.stash or (None,))[0]) if t is not None)
        dev = self._device
        self.samples.append(Sample(
            step=self.step, phase=phase, where=where, time_s=time.perf_counter() - self._t0,
            device_states=by_device["device"], host_states=by_device["host"], cache=self._cache.gathered_bytes,
            grad_buffers=grad_buffers, kept_buffers=self._kept.held_bytes if self._kept is not None else 0,
            activations=self._activations[False],
            host_activations=self._activations[True],
            allocated=torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None))

    def step_done(self, step: int) -> None:
        """Called by the engine after each optimizer step (`step`: steps applied so far): stop when
        the requested steps are in."""
        self.step = step
        self.sample("step")
        if self.steps is not None and step - self.first_step >= self.steps:
            self.stop()

    def stop(self) -> None:
        self.recording = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def track(self, saved, t: torch.Tensor, on_host: bool):
        """Count `t`'s storage from now until autograd drops `saved` (what it keeps for `t`)."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or storage-less subclass: not counted
            return saved
        key = (on_host, str(t.device), storage.data_ptr())
        with self._lock:  # on CUDA, autograd's device threads drop saved tensors too
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [0, storage.nbytes()]
                self._activations[on_host] += entry[1]
            entry[0] += 1
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key) -> None:
        with self._lock:
            entry = self._live[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._live[key]
                self._activations[key[0]] -= entry[1]

    # -- reading --------------------------------------------------------------------------------
    def peak(self, field: str) -> int:
        """The largest value of a Sample field over the recording (bytes)."""
        return max((getattr(s, field) or 0 for s in self.samples), default=0)

    def summary(self) -> str:
        return (f"model states {self.peak('device_states') / MiB:.2f} MiB device + "
                f"{self.peak('host_states') / MiB:.2f} MiB host, peak rCache {self.peak('cache') / MiB:.2f} MiB, "
                f"peak gradient buffers {self.peak('grad_buffers') / MiB:.2f} MiB, "
                f"peak activations {self.peak('activations') / MiB:.2f} MiB ({len(self.samples)} samples)")

    def to_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump([dataclasses.asdict(s) for s in self.samples], f)

    def plot(self, path, title: str | None = None) -> None:
        """Save a PNG of this timeline (needs matplotlib: pip install matplotlib)."""
        plot({title or f"rank {self.rank}": self}, path)


_LAYERS = [  # stacked bottom to top: what stays, then what comes and goes
    ("device_states", "model states (device)", "#4c72b0"),
    ("cache", "rCache (gathered chunks)", "#55a868"),
    ("grad_buffers", "gradient buffers", "#c44e52"),
    ("kept_buffers", "gradient buffers kept for reuse", "#e8a6a8"),
    ("activations", "activations", "#dd8452"),
]
_PHASE_COLOURS = {"forward": "#eaf2fb", "backward": "#fdf0e6", "step": "#eef7ee"}


def plot(timelines: dict[str, MemoryTimeline], path, suptitle: str | None = None) -> None:
    """Save one PNG with a panel per timeline, side by side on one MiB scale, so configurations
    (say stage 0 and stage 3) compare at a glance. Each panel stacks device model states, rCache,
    gradient buffers and activations over the samples, with host model states as a dashed line and,
    on CUDA, the allocator's figure as a dotted one; the background marks forward, backward and step."""
    try:  # a Figure of its own, not pyplot: the process's backend and open figures stay as they are
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("zeroshard: plotting a memory timeline needs matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=(6.5 * len(timelines), 4.2))
    axes = fig.subplots(1, len(timelines), sharey=True, squeeze=False)
    for ax, (label, tl) in zip(axes[0], timelines.items()):
        s = tl.samples
        x = range(len(s))
        start = 0
        for i in range(1, len(s) + 1):  # shade runs of one phase
            if i == len(s) or s[i].phase != s[start].phase:
                ax.axvspan(start - 0.5, i - 0.5, color=_PHASE_COLOURS.get(s[start].phase, "white"), lw=0)
                start = i
        ax.stackplot(x, *[[getattr(v, f) / MiB for v in s] for f, _, _ in _LAYERS],
                     labels=[name for _, name, _ in _LAYERS], colors=[c for _, _, c in _LAYERS], alpha=0.9)
        if any(v.host_states or v.host_activations for v in s):
            ax.plot(x, [(v.host_states + v.host_activations) / MiB for v in s], "k--", lw=1.2,
                    label="host: model states + activations")
        if any(v.allocated is not None for v in s):
            ax.plot(x, [(v.allocated or 0) / MiB for v in s], "k:", lw=1.2, label="CUDA memory_allocated")
        states = max((v.device_states + v.host_states for v in s), default=0) / MiB
        ax.set_title(f"{label}: model states {states:.2f} MiB")
        ax.set_xlabel("sample (after each module's forward / each gradient / each step)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("bytes held by this rank (MiB)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    handles += [Patch(color=c, label=p) for p, c in _PHASE_COLOURS.items()]
    labels += list(_PHASE_COLOURS)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
