"""Which I/O mechanism the disk tier (issue 33) should use, measured on this machine's disk.

    python bench/disk_io.py [--dir DIR] [--gib 2] [--block-mib 64]

Writes and reads one file of --gib GiB in blocks of --block-mib MiB, each way with:
- buffered os.pwritev / os.preadv (the page cache in between; the file is fsync'ed after writing
  and dropped from the cache with posix_fadvise before reading, so the read comes from the disk),
- O_DIRECT os.pwritev / os.preadv from page-aligned buffers, with 1, 2 and 4 threads each doing
  its own blocks (the calls release the GIL),
- torch's file-backed storage (UntypedStorage.from_file, shared: an mmap), written by copy_ and
  read by cloning, after the same fsync / fadvise,
and zlib.crc32 over the same bytes (what a per-record checksum would cost). Prints GB/s (1e9).
"""
from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch


def aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # anonymous maps are page-aligned: what O_DIRECT needs


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_blocks(path: str, flags: int, total: int, block: int, threads: int, write: bool) -> float:
    fd = os.open(path, flags | os.O_RDWR | os.O_CREAT, 0o600)
    bufs = [aligned(block) for _ in range(threads)]
    for b in bufs:
        b.write(os.urandom(1024) * (block // 1024))
        b.seek(0)
    offsets = list(range(0, total, block))

    def worker(t: int) -> None:
        buf = memoryview(bufs[t])
        for off in offsets[t::threads]:
            n = os.pwritev(fd, [buf], off) if write else os.preadv(fd, [buf], off)
            if n != block:
                raise OSError(f"short {'write' if write else 'read'}: {n} of {block} bytes at {off}")

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    if write:
        os.fsync(fd)
    dt = time.perf_counter() - t0
    os.close(fd)
    return total / dt / 1e9


def run_storage(path: str, total: int, write: bool) -> float:
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    t0 = time.perf_counter()
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=total)
    t = torch.tensor([], dtype=torch.uint8).set_(storage)
    if write:
        t.copy_(src)
        del t, storage
        drop_cache(path)  # fsync: the mmap's pages reach the disk
    else:
        src.copy_(t)
    return total / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--block-mib", type=int, default=64)
    args = ap.parse_args()
    block = args.block_mib << 20
    total = int(args.gib * (1 << 30)) // block * block
    path = os.path.join(args.dir, f"zeroshard-disk-io-{os.getpid()}.bin")
    rows = []
    try:
        for name, flags, threads in (("buffered pwritev/preadv", 0, 1), ("O_DIRECT, 1 thread", os.O_DIRECT, 1),
                                     ("O_DIRECT, 2 threads", os.O_DIRECT, 2), ("O_DIRECT, 4 threads", os.O_DIRECT, 4)):
            w = run_blocks(path, flags, total, block, threads, write=True)
            drop_cache(path)
            r = run_blocks(path, flags, total, block, threads, write=False)
            rows.append((name, w, r))
            os.remove(path)
        w = run_storage(path, total, write=True)
        r = run_storage(path, total, write=False)
        rows.append(("torch UntypedStorage.from_file (mmap)", w, r))
    finally:
        if os.path.exists(path):
            os.remove(path)
    data = os.urandom(block)
    t0 = time.perf_counter()
    for _ in range(8):
        zlib.crc32(data)
    crc = 8 * block / (time.perf_counter() - t0) / 1e9
    print(f"disk of {args.dir}: {total / 2**30:.1f} GiB in {args.block_mib} MiB blocks; GB/s (1e9 bytes)")
    print("| mechanism | write | read |\n|---|---:|---:|")
    for name, w, r in rows:
        print(f"| {name} | {w:.2f} | {r:.2f} |")
    print(f"zlib.crc32, one thread: {crc:.2f} GB/s")


if __name__ == "__main__":
    main()
