"""What a plan is (planner.py makes them): the target it is made for, its predicted step time, and
the configuration with its bytes per device, host and disk, and whether they fit."""
from __future__ import annotations

from dataclasses import dataclass, field

from .hardware import GIB, Hardware
from ..runtime.offload import Placement

FRAGMENTATION = 0.95  # of a memory's bytes, what a plan may count on filling


@dataclass(frozen=True)
class Target:
    """What to plan for: the hardware of one device and the job around it."""

    hardware: Hardware
    world: int = 1  # ranks ZeRO shards over (with tensor parallelism: one data-parallel group)
    accumulation: int = 1  # micro-batches per step (the profile is one micro-batch)
    optimizer_state_bytes: int = 8  # per element: Adam's m and v in fp32
    tensor_parallel: int = 1  # ranks per tensor-parallel group (the profile is one rank's part)
    disk: bool = False  # a disk tier is given (offload_dir): offloaded chunks may go there

    @property
    def ranks_per_host(self) -> int:
        """Ranks sharing one host's memory and CPU cores: every data-parallel group's."""
        return max(1, min(self.world * self.tensor_parallel, self.hardware.gpus_per_host))


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step on one rank."""

    compute: float = 0.0
    exposed_transfers: float = 0.0  # collectives and host<->device copies not hidden behind compute
    device_step: float = 0.0
    cpu_step: float = 0.0
    model_collectives: float = 0.0  # the model's own (tensor parallelism's): they wait on compute, unhidden
    disk_io: float = 0.0  # the disk tier's reads and writes the CPU step does not hide

    @property
    def total(self) -> float:
        return (self.compute + self.exposed_transfers + self.device_step + self.cpu_step + self.model_collectives
                + self.disk_io)


@dataclass
class Plan:
    """One configuration and its predicted cost. Bytes are per device (rank)."""

    name: str
    stage: int
    chunk_size: int  # elements
    cache_chunks: int | None  # None: every chunk stays gathered (stage 2)
    optimizer_on_host: tuple[bool, ...]  # per chunk, in packing order
    waste: float  # padding / padded elements
    device_model_bytes: int  # parameters, gradients, optimizer states and the rCache on the device
    host_model_bytes: int
    transient_bytes: int  # gradient buffers being reduced
    activation_bytes: int  # 1.25 x profiled peak, per micro-batch
    other_bytes: int  # driver reserve + buffers
    device_memory: int
    host_memory: int  # bytes of host memory this rank may use (the host's, shared by its ranks)
    time: StepTime
    flops: float  # per step and rank
    loads: int = 0  # chunk gathers per step
    notes: list[str] = field(default_factory=list)
    reserve: int = 0  # the driver's share of other_bytes: outside the caching allocator, not fragmented
    optimizer_on_disk: tuple[bool, ...] = ()  # per chunk: of those on the host, the disk tier's
    disk_model_bytes: int = 0  # masters and optimizer states in the disk tier

    def placement(self, index: int, stage: int) -> Placement:
        """Where chunk `index`'s optimizer (and at stage 3 its shard) lives; a chunk the plan did
        not foresee (after a re-pack) keeps everything on the device."""
        on_host = index < len(self.optimizer_on_host) and self.optimizer_on_host[index]
        on_disk = index < len(self.optimizer_on_disk) and self.optimizer_on_disk[index]
        return Placement(optimizer_on_host=on_host, params_on_host=on_host and stage == 3, optimizer_on_disk=on_disk)

    @property
    def device_bytes(self) -> int:
        """Everything predicted on the device at the peak."""
        return self.device_model_bytes + self.transient_bytes + self.activation_bytes + self.other_bytes

    @property
    def fits_device(self) -> bool:
        return self.device_bytes - self.reserve <= FRAGMENTATION * (self.device_memory - self.reserve)

    @property
    def fits_host(self) -> bool:
        return self.host_model_bytes <= FRAGMENTATION * self.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def offloaded_chunks(self) -> int:
        return sum(self.optimizer_on_host)

    @property
    def disk_chunks(self) -> int:
        return sum(self.optimizer_on_disk)

    @property
    def tflops(self) -> float:
        return self.flops / self.time.total / 1e12 if self.time.total > 0 else 0.0

    def config(self) -> dict:
        """The zeroshard config keys this plan sets (placement per chunk is applied by the engine)."""
        return {"stage": self.stage, "chunk_size": self.chunk_size, "cache_chunks": self.cache_chunks}

    def describe(self) -> str:
        t = self.time
        cache = "all chunks gathered" if self.cache_chunks is None else f"rCache of {self.cache_chunks} chunks"
        return (f"{self.name}: stage {self.stage}, chunk {self.chunk_size / 1e6:.2f} M elements "
                f"({len(self.optimizer_on_host)} chunks, {self.waste:.1%} padding), {cache}, optimizer "
                f"states on the host for {self.offloaded_chunks}/{len(self.optimizer_on_host)} chunks"
                + (f" ({self.disk_chunks} of them in the disk tier: {fmt_bytes(self.disk_model_bytes)})"
                   if self.disk_chunks else "")
                + f"; host {fmt_bytes(self.host_model_bytes)} of {fmt_bytes(self.host_memory)}; device "
                f"{fmt_bytes(self.device_bytes)} of {fmt_bytes(self.device_memory)} "
                f"(model states + cache {fmt_bytes(self.device_model_bytes)}, activations "
                f"{fmt_bytes(self.activation_bytes)}); step {t.total * 1e3:.1f} ms = compute {t.compute * 1e3:.1f} + "
                f"exposed transfers {t.exposed_transfers * 1e3:.1f} + device step {t.device_step * 1e3:.1f} + "
                f"CPU step {t.cpu_step * 1e3:.1f}"
                + (f" + disk I/O {t.disk_io * 1e3:.1f}" if t.disk_io else "")
                + (f" + tensor-parallel collectives {t.model_collectives * 1e3:.1f}" if t.model_collectives else ""))


def fmt_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
