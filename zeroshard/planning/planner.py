"""The planner (Elixir section 5): from a profile and the hardware, the chunk size, the number of
rCache size (cache_chunks) and, chunk by chunk, whether the optimizer states live on the device, the host
or, where host memory does not hold them and a disk tier is given (offload_dir), the disk.

The terms (budget, loads, plan, cache_chunks: docs/vocabulary.md) as this planner computes them
(formulas in ../shared/notes/elixir-search.md, reworked for this runtime's data path):
- e_p: bytes per element in the compute dtype; Psi: parameter elements; N: ranks (world).
- budget C: device bytes left for model states and the cache once the driver reserve, buffers and
  1.25x the profiled peak activations are set aside, times 0.95 (fragmentation).
- layout: the chunks one chunk size gives, packed exactly as the engine packs them (trainable first,
  each group in order of first use, next-fit); waste = padding / padded size.
- chunk sequence: the chunks that stage 3 gathers, in order, over one step (from the profile trace).
- loads: gathers over a step with a cache of cache_chunks chunks evicting by Belady's rule (farthest next use).
- device-optimizer chunk: its shard, gradient shard, fp32 master and optimizer states on the device
  (16 bytes per shard element with Adam). A host chunk keeps them all in host memory (stage 3: its
  16-bit shard too, uploaded on each gather), and steps on the CPU. A disk chunk steps on the CPU too,
  but its fp32 master and optimizer states live in the disk tier (runtime/disk_tier.py): the host
  keeps its gradient shard (stage 3: and its 16-bit shard) plus the tier's frames (FRAMES records of
  the largest disk chunk), and each step reads and writes its record once (the host's ranks share
  the disk); what the CPU step does not hide of that I/O is exposed.

The search: (1) chunk size: over candidate sizes, the one that moves the fewest bytes through a cache
filling the budget (loads x size; within 1% of the least, the smallest size); (2) for each cache size (all chunks cached
is ZeRO-2; fewer is ZeRO-3 with an rCache of cache_chunks chunks), put as many chunks' optimizer states on the
device as the memory left allows, the chunks that save the most time per byte first; (3) if host
memory does not hold the rest and a disk tier is given, move the fewest of them (the largest first) to
disk; predict the step time of each and keep the fastest that fits. Growing the cache and keeping optimizer states on the
device compete for the same bytes; the comparison is made by predicted time, and reported as seconds
saved per GiB of either at the chosen point.
"""
from __future__ import annotations

from ..runtime.disk_tier import FRAMES
from ..runtime.packing import padded_numel
from .hardware import GIB
from .plans import FRAGMENTATION, Plan, StepTime, Target, fmt_bytes
from .profiler import Profile
from .schedule import belady_loads, chunk_sequence, layout, min_cache_chunks

MASTER_BYTES = 4  # fp32 master copy, per element
ACTIVATION_MARGIN = 1.25


class Planner:
    """Searches configurations for one profile on one target. `plan()` gives the fastest that fits;
    `baselines()` the four classic ZeRO configurations on the same chunks, for comparison."""

    def __init__(self, profile: Profile, target: Target, chunk_size: int | None = None):
        self.profile = profile
        self.target = target
        hw = target.hardware
        self.e_p = profile.element_size
        self.activation_bytes = int(ACTIVATION_MARGIN * profile.peak_activation_bytes)
        self.other_bytes = hw.reserve + profile.buffer_bytes
        # C, bytes: the allocator's share of the device (fragmentation applies to it, not to the reserve)
        self.budget = FRAGMENTATION * (hw.device_memory - hw.reserve) - self.activation_bytes - profile.buffer_bytes
        staging = profile.largest_module_numel + profile.tied_numel
        self.cache_budget = max(0, int(self.budget / self.e_p) - staging)  # E, elements
        self.search_seconds = 0.0
        if chunk_size is None:
            import time
            t0 = time.perf_counter()
            chunk_size, self.candidates = self.search_chunk_size()
            self.search_seconds = time.perf_counter() - t0
        else:
            self.candidates = []
        self.layout = layout(profile, chunk_size, target.world)
        self.sequence = chunk_sequence(profile, self.layout)
        self.min_cache_chunks = min_cache_chunks(profile, self.layout)
        self._loads: dict[int, list[int]] = {}

    # -- chunk size -------------------------------------------------------------------------------
    def search_chunk_size(self, candidates: int = 96) -> tuple[int, list[tuple[int, int, float]]]:
        """The chunk size (elements) that moves the fewest bytes through a cache filling the budget.
        Returns it and every candidate as (chunk size, bytes moved in elements, waste)."""
        p, world = self.profile, self.target.world
        smallest = padded_numel(max(x.numel for x in p.params), world)
        sizes = sorted({padded_numel(int(smallest * (1 + j / 32)), world) for j in range(candidates)})
        results = []
        for size in _progress(sizes, "zeroshard: chunk sizes"):
            lay = layout(p, size, world)
            seq = chunk_sequence(p, lay)
            cache_chunks = self.cache_budget // max(lay.padded) - 2  # one chunk to prefetch into, one to reduce
            if cache_chunks < min_cache_chunks(p, lay):
                cache_chunks = min_cache_chunks(p, lay)  # does not fit: still rank the sizes by traffic
                over = True
            else:
                over = False
            moved = sum(n * lay.padded[c] for c, n in enumerate(belady_loads(seq, cache_chunks)[0]))
            results.append((size, moved, lay.waste, over))
        fitting = [r for r in results if not r[3]] or results
        least = min(r[1] for r in fitting)
        # Within 1% of the least traffic (often a tie: every size fits the whole model in the cache),
        # the smallest size: finer chunks let the planner place optimizer states more finely.
        best = min((r for r in fitting if r[1] <= 1.01 * least), key=lambda r: (r[0], r[2]))
        return best[0], [r[:3] for r in results]

    # -- one configuration ---------------------------------------------------------------------------
    def loads(self, cache_chunks: int) -> list[int]:
        return self._simulate(cache_chunks)[0]

    def _simulate(self, cache_chunks: int) -> tuple[list[int], int]:
        """(loads per chunk, most elements cached at once) with a cache of `cache_chunks` chunks."""
        if cache_chunks not in self._loads:
            self._loads[cache_chunks] = belady_loads(self.sequence, cache_chunks, self.layout.padded)
        return self._loads[cache_chunks]

    def evaluate(self, name: str, stage: int, cache_chunks: int | None, on_host: list[bool],
                 on_disk: list[bool] | None = None) -> Plan:
        """Predicted memory and time of one configuration. `cache_chunks`: the rCache size in chunks
        (stage 3); `on_disk`: of the chunks on the host, those whose states the disk tier keeps."""
        lay, t, hw, e_p = self.layout, self.target, self.target.hardware, self.e_p
        n = t.world
        on_disk = [bool(d) and bool(h) and lay.trainable[c] for c, (d, h) in
                   enumerate(zip(on_disk or [False] * len(on_host), on_host))]
        disk = record = disk_el = 0  # bytes in the tier, its largest record, elements it steps
        dev = host = 0
        moved_params = 0.0  # elements all-gathered per step
        uploads = grads_down = steps_up = 0.0  # bytes per step
        host_el = dev_el = 0
        loads = self.loads(cache_chunks) if stage == 3 else [1] * len(lay.padded)
        for c, size in enumerate(lay.padded):
            s = size // n
            off = on_host[c] and lay.trainable[c]
            if stage == 2:
                dev += size * e_p
            elif not off:
                dev += s * e_p
            if lay.trainable[c]:
                states = self._optimizer_side_bytes(stage, s, off)
                if off and on_disk[c]:  # the gradient shard stays; master and states go to disk
                    rec = (MASTER_BYTES + t.optimizer_state_bytes) * s
                    disk, record, disk_el = disk + rec, max(record, rec), disk_el + s
                    states = s * e_p
                if off:
                    host += states + (s * e_p if stage == 3 else 0)
                    host_el += s
                    grads_down += t.accumulation * s * e_p
                    if stage == 3:
                        uploads += loads[c] * s * e_p  # the shard goes up on each gather
                    else:
                        steps_up += s * e_p  # the updated shard goes up after the step
                else:
                    dev += states
                    dev_el += s
            moved_params += loads[c] * size
        largest = sorted(lay.padded, reverse=True)
        cache = self._simulate(cache_chunks)[1] * e_p if stage == 3 else 0
        transient = 2 * largest[0] * e_p  # full gradients of chunks whose reduce-scatter is in flight
        frac = (n - 1) / n
        grad_bytes = sum(lay.padded[c] for c in range(len(lay.padded)) if lay.trainable[c]) * e_p
        gather_bytes = moved_params * e_p * t.accumulation if stage == 3 else 0.0
        comm = (gather_bytes + grad_bytes * t.accumulation) * frac / hw.link
        compute = self.profile.flops * t.accumulation / hw.device_flops
        fb_transfers = comm + uploads * t.accumulation / hw.h2d + grads_down / hw.d2h
        first_gather = largest[0] * e_p * frac / hw.link + (largest[0] // n * e_p / hw.h2d if uploads else 0)
        exposed = max(0.0, fb_transfers - compute) + (first_gather if stage == 3 else 0.0)
        # After the step: host chunks go up one by one while the next one steps (the last one's
        # upload is exposed); stage 2 then all-gathers the updated parameters.
        host_chunks = [c for c in range(len(lay.padded)) if on_host[c] and lay.trainable[c]]
        post = max((lay.padded[c] // n * e_p for c in host_chunks), default=0) / hw.h2d if stage == 2 else 0.0
        if stage == 2:
            post += grad_bytes * frac / hw.link
        host += FRAMES * record
        # Each disk chunk's record is read and written once a step, on a disk the host's ranks share,
        # while the CPU steps the chunk before it: what the CPU step of disk chunks does not hide.
        io = disk * t.ranks_per_host * (1 / max(hw.disk_read, 1.0) + 1 / max(hw.disk_write, 1.0)) if disk else 0.0
        disk_io = max(0.0, io - disk_el * t.ranks_per_host / hw.host_adam)
        time = StepTime(compute=compute, exposed_transfers=exposed + post, device_step=dev_el / hw.device_adam,
                        cpu_step=host_el * t.ranks_per_host / hw.host_adam,
                        model_collectives=self.profile.collective_bytes * t.accumulation / hw.link, disk_io=disk_io)
        return Plan(name=name, stage=stage, chunk_size=lay.chunk_size, cache_chunks=cache_chunks if stage == 3 else None,
                    optimizer_on_host=tuple(bool(x) and lay.trainable[i] for i, x in enumerate(on_host)),
                    waste=lay.waste, device_model_bytes=int(dev + cache), host_model_bytes=int(host),
                    transient_bytes=int(transient), activation_bytes=self.activation_bytes,
                    other_bytes=self.other_bytes, device_memory=hw.device_memory,
                    host_memory=hw.host_memory // t.ranks_per_host if hw.host_memory else 1 << 62, time=time,
                    flops=self.profile.flops * t.accumulation, loads=sum(loads) if stage == 3 else 0,
                    reserve=hw.reserve, optimizer_on_disk=tuple(on_disk), disk_model_bytes=int(disk))

    # -- search -----------------------------------------------------------------------------------------
    def _gain_per_byte(self, stage: int, cache_chunks: int | None, c: int) -> float:
        """Seconds saved per device byte by keeping chunk c's optimizer states on the device."""
        t, hw, e_p = self.target, self.target.hardware, self.e_p
        s = self.layout.padded[c] // t.world
        saved = s * t.ranks_per_host / hw.host_adam - s / hw.device_adam + t.accumulation * s * e_p / hw.d2h
        saved += (self.loads(cache_chunks)[c] * t.accumulation if stage == 3 else 1) * s * e_p / hw.h2d
        cost = self._optimizer_side_bytes(stage, s, False) + (s * e_p if stage == 3 else 0)
        return saved / cost

    def _optimizer_side_bytes(self, stage: int, shard: int, on_host: bool) -> int:
        """Bytes a trainable chunk keeps beside its optimizer: the gradient shard, the fp32 master
        (none in fp32 when it can be the compute shard itself) and the optimizer states."""
        e_p = self.e_p
        master = 0 if e_p == 4 and (stage == 3 or not on_host) else MASTER_BYTES * shard
        return shard * e_p + master + self.target.optimizer_state_bytes * shard

    def _best_placement(self, name: str, stage: int, cache_chunks: int | None, allow_offload: bool) -> Plan:
        """With this cache, keep as many chunks' optimizer states on the device as fit, those that
        save the most time per byte first (device bytes grow with each, so bisect the count)."""
        n_chunks = len(self.layout.padded)
        everything = self.evaluate(name, stage, cache_chunks, [False] * n_chunks)
        if everything.fits_device or not allow_offload:
            return everything
        order = sorted((c for c in range(n_chunks) if self.layout.trainable[c]),
                       key=lambda c: -self._gain_per_byte(stage, cache_chunks, c))

        def with_first(m: int) -> Plan:
            on_host = [True] * n_chunks
            for c in order[:m]:
                on_host[c] = False
            return self.evaluate(name, stage, cache_chunks, on_host)

        # Device bytes grow and host bytes shrink with m: the most chunks that fit the device is
        # also the placement that needs the least host memory.
        lo, hi = 0, len(order)
        best = with_first(0)
        if not best.fits_device:
            return best
        while lo < hi:
            mid = (lo + hi + 1) // 2
            trial = with_first(mid)
            if trial.fits_device:
                lo, best = mid, trial
            else:
                hi = mid - 1
        return best if best.fits_host or not self.target.disk else self._to_disk(best)

    def _to_disk(self, p: Plan) -> Plan:
        """Host memory does not hold the offloaded chunks' states: the fewest of them, largest first,
        go to disk (host bytes shrink with each once the first paid for the frames: bisect)."""
        off = sorted((c for c, h in enumerate(p.optimizer_on_host) if h), key=lambda c: -self.layout.padded[c])

        def with_disk(m: int) -> Plan:
            chosen = set(off[:m])
            return self.evaluate(p.name, p.stage, p.cache_chunks, list(p.optimizer_on_host),
                                 [c in chosen for c in range(len(p.optimizer_on_host))])
        lo, hi = 1, len(off)
        if not off or not with_disk(hi).fits_host:  # nothing fits: the closest
            return with_disk(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if with_disk(mid).fits_host:
                hi = mid
            else:
                lo = mid + 1
        return with_disk(lo)

    def plan(self, stage: int | str = "auto", offload: bool = True) -> Plan:
        """The fastest configuration that fits (stage 2 or 3, or the one given), or, if none fits,
        the one that comes closest (check `.fits`)."""
        stages = (2, 3) if stage == "auto" else (stage,)
        n_chunks = len(self.layout.padded)
        options = []
        if 2 in stages:
            options.append(self._best_placement("plan", 2, None, offload))
        if 3 in stages:
            for cache_chunks in _progress(range(self.min_cache_chunks, max(self.min_cache_chunks, n_chunks - 1) + 1), "zeroshard: cache sizes"):
                options.append(self._best_placement("plan", 3, cache_chunks, offload))
        fitting = [p for p in options if p.fits]
        if fitting:
            best = min(fitting, key=lambda p: (p.time.total, p.device_bytes))
        else:
            best = min(options, key=lambda p: (not p.fits_host, p.device_bytes))
        best.notes.extend(self._tradeoff(best))
        return best

    def baselines(self) -> list[Plan]:
        n = len(self.layout.padded)
        cache_chunks = self.min_cache_chunks
        return [self.evaluate("ZeRO-2", 2, None, [False] * n), self.evaluate("ZeRO-3", 3, cache_chunks, [False] * n),
                self.evaluate("ZeRO-2 offload", 2, None, [True] * n),
                self.evaluate("ZeRO-3 offload", 3, cache_chunks, [True] * n)]

    def _tradeoff(self, p: Plan) -> list[str]:
        """Seconds saved per GiB: one more cache block versus one more chunk's optimizer on device."""
        notes = []
        if p.stage == 3 and p.cache_chunks is not None and p.cache_chunks < len(self.layout.padded):
            bigger = self.evaluate("", 3, p.cache_chunks + 1, list(p.optimizer_on_host))
            extra = bigger.device_model_bytes - p.device_model_bytes
            if extra > 0:
                notes.append(f"one more cache block: {(p.time.total - bigger.time.total) / extra * GIB * 1e3:.2f} "
                             "ms saved per GiB")
        if any(p.optimizer_on_host):
            c = p.optimizer_on_host.index(True)
            moved = list(p.optimizer_on_host)
            moved[c] = False
            trial = self.evaluate("", p.stage, p.cache_chunks, moved)
            extra = trial.device_model_bytes - p.device_model_bytes
            if extra > 0:
                notes.append(f"one more chunk's optimizer on the device: "
                             f"{(p.time.total - trial.time.total) / extra * GIB * 1e3:.2f} ms saved per GiB")
        return notes

    def why_nothing_fits(self, best: Plan) -> str:
        """What does not fit, and what would."""
        hw = self.target.hardware
        if best.fits_device and not best.fits_host:
            return (f"nothing fits: offloading enough to fit the device ({best.describe()}) needs "
                    f"{fmt_bytes(best.host_model_bytes)} of host memory per rank, and a rank has "
                    f"{fmt_bytes(best.host_memory)} ({self.target.ranks_per_host} rank(s) per host): more hosts, "
                    "or devices with more memory.")
        need = best.reserve + (best.device_bytes - best.reserve) / FRAGMENTATION
        lines = [f"nothing fits in {fmt_bytes(hw.device_memory)} per device: the smallest configuration "
                 f"({best.describe()}) needs {fmt_bytes(need)}."]
        if self.other_bytes > 0.25 * hw.device_memory:
            lines.append(f"The driver reserve and buffers alone take {fmt_bytes(self.other_bytes)}.")
        if self.activation_bytes > 0.5 * (best.device_bytes - best.reserve):
            lines.append(f"Activations take {fmt_bytes(self.activation_bytes)} (1.25 x the profiled peak): "
                         "use a smaller micro-batch (activations scale with it)"
                         + ("" if self.profile.checkpoint_regions else ", or enable activation checkpointing")
                         + ".")
        states = best.device_model_bytes - (best.cache_chunks or 0) * max(self.layout.padded) * self.e_p
        if states > 0:
            lines.append(f"Sharded model states take {fmt_bytes(states)} per device at {self.target.world} "
                         "device(s): more devices divide them.")
        return " ".join(lines)


def _progress(items, desc: str):
    """A progress bar over `items` on a terminal (tqdm hides it elsewhere), for large models' plans."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, leave=False, disable=None, mininterval=0.5)
