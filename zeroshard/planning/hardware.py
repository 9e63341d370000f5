"""The hardware the planner plans for: measured on this machine (and cached), or described.

Every figure the planner uses is measured here rather than assumed: host<->device bandwidth
(bytes/s, pinned memory with CUDA), Adam update speed on the host and on the device (elements/s),
and the device's matmul speed in the compute dtype (flop/s). A probe takes a few seconds and is
cached per machine in $ZEROSHARD_CACHE (default ~/.cache/zeroshard). On a machine without an
accelerator the "device" is the CPU itself, so its figures describe CPU-to-CPU copies; to plan for
another machine, describe it (`Hardware.described`, or `zeroshard plan --gpus ... --h2d ...`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("zeroshard")

GIB = 2**30
CUDA_RESERVE = 2 * GIB  # bytes per GPU the CUDA context, cuBLAS/NCCL workspaces and the allocator keep


@dataclass(frozen=True)
class Hardware:
    """One device (GPU, or the CPU standing in for it) and the host it hangs off.

    Bandwidths are bytes/s per device; speeds are elements/s (Adam) and flop/s (matmul) per device,
    except `host_adam`, which is the whole host's (ranks on one host share its cores).
    """

    name: str
    device_memory: int  # bytes per device
    host_memory: int  # bytes of the host
    h2d: float  # bytes/s
    d2h: float  # bytes/s
    host_adam: float  # elements/s, the whole host
    device_adam: float  # elements/s
    device_flops: float  # flop/s in the compute dtype
    link: float  # bytes/s of collective bus bandwidth per device (all-gather, reduce-scatter)
    reserve: int = 0  # bytes per device the driver and runtime keep (CUDA context, workspaces)
    gpus_per_host: int = 1
    disk_read: float = 0.0  # bytes/s of the disk tier's disk (shared by the host's ranks); 0: no disk tier
    disk_write: float = 0.0

    def with_(self, **changes) -> "Hardware":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @staticmethod
    def described(gpu_memory: float, h2d: float = 20e9, d2h: float = 20e9, host_adam: float = 2e9,
                  device_adam: float = 50e9, device_flops: float = 150e12, link: float | None = None,
                  host_memory: float = 512 * GIB, gpus_per_host: int = 1, reserve: float = CUDA_RESERVE,
                  name: str = "described") -> "Hardware":
        """A target machine described by its figures (defaults: a PCIe-attached data-centre GPU:
        20 GB/s each way, 150 TFLOP/s bf16, fused Adam at 50 G el/s, 2 GiB kept by the CUDA context
        and libraries; a host doing 2 G el/s of Adam)."""
        return Hardware(name=name, device_memory=int(gpu_memory), host_memory=int(host_memory), h2d=h2d, d2h=d2h,
                        host_adam=host_adam, device_adam=device_adam, device_flops=device_flops,
                        link=link if link is not None else h2d, reserve=int(reserve), gpus_per_host=gpus_per_host)


def cache_dir() -> str:
    return os.environ.get("ZEROSHARD_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "zeroshard"))


def _machine_key(device: torch.device, dtype: torch.dtype) -> str:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{platform.node()}|{dev}|{dtype}|torch {torch.__version__}|{os.cpu_count()} cpus"


def probe(device: torch.device | str | None = None, dtype: torch.dtype = torch.bfloat16,
          refresh: bool = False) -> Hardware:
    """Measure this machine (or read the cached measurement). `dtype`: the compute dtype whose
    matmul speed is measured."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = _machine_key(device, dtype)
    path = os.path.join(cache_dir(), "hardware.json")
    cached = _read_cache(path)
    if key in cached and not refresh:
        return Hardware(**cached[key])
    log.info("measuring this machine for the planner (a few seconds, cached in %s)", path)
    hw = _measure(device, dtype)
    cached[key] = dataclasses.asdict(hw)
    _write_cache(path, cached)
    return hw


def probe_disk(directory: str, refresh: bool = False, nbytes: int = 512 * 2**20) -> tuple[float, float]:
    """(read, write) bytes/s of the disk holding `directory`, as the disk tier uses it (TierFile:
    O_DIRECT, 2 threads, 64 MiB records, a file overwritten as every step after the first does);
    cached beside the machine's figures, per host and file system."""
    from ..files.tier_files import ALIGN, TierFile, aligned_buffer
    os.makedirs(directory, exist_ok=True)
    key = f"disk|{platform.node()}|{os.stat(directory).st_dev}"
    path = os.path.join(cache_dir(), "hardware.json")
    cached = _read_cache(path)
    if key in cached and not refresh:
        return tuple(cached[key])
    record = 64 * 2**20
    n = max(1, nbytes // record)
    f = TierFile(directory, f"probe-{os.getpid()}.tier", [record] * n)
    bufs = [aligned_buffer(record) for _ in range(4)]
    for b in bufs:
        b[:] = os.urandom(ALIGN) * (len(b) // ALIGN)

    def rate(io) -> float:
        t0 = time.perf_counter()
        for i in range(0, n, len(bufs)):
            for fut in [io(j, bufs[j - i]) for j in range(i, min(n, i + len(bufs)))]:
                fut.result()
        return n * record / (time.perf_counter() - t0)
    try:
        rate(f.write)  # allocates the file's blocks
        write, read = rate(f.write), rate(f.read)
    finally:
        f.close()
    cached[key] = [read, write]
    _write_cache(path, cached)
    return read, write


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, cached: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=1)
        os.replace(tmp, path)  # atomic: concurrent ranks never read a half-written file
    except OSError as e:
        log.warning("could not cache the hardware probe in %s (%s)", path, e)


def _best_time(fn, sync, reps: int = 3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _measure(device: torch.device, dtype: torch.dtype) -> Hardware:
    from ..optim.cpu_adam import CPUAdamW

    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    n_copy = (256 if cuda else 32) * 2**20  # bytes
    host = torch.empty(n_copy, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(n_copy, dtype=torch.uint8, device=device)
    h2d = n_copy / _best_time(lambda: dev.copy_(host, non_blocking=cuda), sync)
    d2h = n_copy / _best_time(lambda: host.copy_(dev, non_blocking=cuda), sync)
    del host, dev

    def adam_speed(on: torch.device, n: int) -> float:
        p = torch.zeros(n, device=on, requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        opt = CPUAdamW([p]) if on.type == "cpu" else torch.optim.AdamW([p], fused=True)
        s = on.type == "cuda" and sync or (lambda: None)
        return n / _best_time(opt.step, s)

    host_adam = adam_speed(torch.device("cpu"), 8 * 2**20)
    device_adam = adam_speed(device, 64 * 2**20) if cuda else host_adam
    m = 4096 if cuda else 512
    mm_dtype = dtype if cuda else torch.float32  # CPU matmuls are fastest (and the engine's) in fp32
    a = torch.randn(m, m, device=device, dtype=mm_dtype)
    flops = 2 * m**3 / _best_time(lambda: a @ a, sync)
    if cuda:
        props = torch.cuda.get_device_properties(device)
        mem, name, reserve = props.total_memory, props.name, CUDA_RESERVE
    else:
        mem, name, reserve = _host_memory(), "cpu", 0
    return Hardware(name=name, device_memory=mem, host_memory=_host_memory(), h2d=h2d, d2h=d2h,
                    host_adam=host_adam, device_adam=device_adam, device_flops=flops, link=h2d,
                    reserve=reserve, gpus_per_host=max(1, torch.cuda.device_count()) if cuda else 1)
