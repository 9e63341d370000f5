"""The disk tier's file (issue 33): one rank's records on disk, read ahead and written behind.

A `TierFile` holds numbered records of fixed sizes (a chunk's fp32 master and optimizer states,
as bytes) in one file under the tier directory (config offload_dir), each at a 4 KiB-aligned
offset: a 4 KiB header, then the payload. Reads and writes go through a few threads calling
os.preadv / os.pwritev with O_DIRECT (they release the GIL, and the page cache stays out of the
host memory the tier exists to spare). bench/disk_io.py measured the choice on this machine's
(virtual, shared) disk, three runs of 2-4 GiB: O_DIRECT with 2 threads wrote 0.77-1.00 GB/s and
read 2.3-3.8; buffered calls wrote 0.40-0.78 and read 3.5-4.1; torch's file-backed storage (an
mmap) wrote 0.52-0.70 and read 0.86-1.36; one O_DIRECT thread wrote 0.43-0.83. Where O_DIRECT is
refused (tmpfs, some network file systems), the file is opened without it.

Every record is verified when read: its header names the record, the generation this process
wrote last (a counter kept in memory: a record left from an earlier write, or never written,
does not match) and the payload's length and zlib.crc32 (2.5-3.7 GB/s on one core, computed in
the I/O threads, which it releases the GIL for). A mismatch, a short read, a file removed or
truncated under a running job, a full disk: TierFileError naming the file and the record, never
wrong values.

The directory is leased: `<file>.lease` holds the owner's host and pid. A lease of a live process
refuses a second job (TierFileError); one of a process that is gone (a killed run) is reclaimed,
its file removed, with a warning. `close()` removes the file and the lease (a normal exit).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import TierFileError

log = logging.getLogger("zeroshard")

ALIGN = 4096  # bytes: O_DIRECT's alignment of offsets, lengths and buffers
_MAGIC = b"ZSTIER01"
_HEADER = struct.Struct("<8sqqqI")  # magic, record, generation, payload bytes, crc32


def _round_up(n: int, m: int = ALIGN) -> int:
    return (n + m - 1) // m * m


def aligned_buffer(nbytes: int) -> memoryview:
    """A page-aligned host buffer of `nbytes` (rounded up to ALIGN), as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, _round_up(max(nbytes, 1))))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale(directory: str) -> list[str]:
    """Remove the tier files (and leases) in `directory` that a process of this host left when it
    died (a killed run), with a warning each; files of live processes or of other hosts are left
    alone. Returns the files removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:  # not there yet, or not a directory (TierFile names that)
        return removed
    for name in names:
        if not name.endswith(".lease"):
            continue
        lease = os.path.join(directory, name)
        try:
            with open(lease) as f:
                host, pid = f.read().split()
            pid = int(pid)
        except (OSError, ValueError):
            continue  # being written, or not ours to judge
        if host != socket.gethostname() or _alive(pid):
            continue
        path = lease[:-len(".lease")]
        log.warning("reclaiming the disk tier file %s left by process %s (gone)", path, pid)
        for p in (path, lease):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        removed.append(path)
    return removed


class IoMeter:
    """Seconds during which at least one read (write; either: 'any') was in flight, over every file
    that shares this meter: bytes moved over those seconds is the bandwidth the disk gave (threads
    overlapping count once)."""

    KINDS = ("read", "write", "any")

    def __init__(self):
        self.busy_s = dict.fromkeys(self.KINDS, 0.0)
        self._inflight = dict.fromkeys(self.KINDS, 0)
        self._since = dict.fromkeys(self.KINDS, 0.0)
        self._lock = threading.Lock()

    def begin(self, what: str) -> None:
        with self._lock:
            for k in (what, "any"):
                if not self._inflight[k]:
                    self._since[k] = time.perf_counter()
                self._inflight[k] += 1

    def end(self, what: str) -> None:
        with self._lock:
            for k in (what, "any"):
                self._inflight[k] -= 1
                if not self._inflight[k]:
                    self.busy_s[k] += time.perf_counter() - self._since[k]

    def reset(self) -> None:
        with self._lock:
            self.busy_s = dict.fromkeys(self.KINDS, 0.0)


class TierFile:
    """Records 0..len(sizes)-1 of `sizes[i]` bytes each, in `directory`/`name`.

    `write(i, data)` and `read(i, into)` return futures (`.result()` raises TierFileError); one
    record is never read and written at once (the caller orders its uses of a record)."""

    def __init__(self, directory: str, name: str, sizes: list[int], threads: int = 2, meter: IoMeter | None = None,
                 pool: ThreadPoolExecutor | None = None, read_pool: ThreadPoolExecutor | None = None):
        """threads: the I/O threads of its own pool, unless it shares `pool` (several files on one
        disk: the threads, not the files, set how many requests the disk sees at once); reads go
        to `read_pool` when given (so a read is never queued behind writes)."""
        self.path = os.path.join(directory, name)
        self.lease = self.path + ".lease"
        self.sizes = list(sizes)
        self.offsets, offset = [], 0
        for n in self.sizes:
            self.offsets.append(offset)
            offset += ALIGN + _round_up(n)
        self.nbytes = offset
        self.generations = [0] * len(self.sizes)  # of the last write of each record; 0: none yet
        self.meter = meter or IoMeter()
        self._lock = threading.Lock()
        try:
            os.makedirs(directory, exist_ok=True)
            self._take_lease()
            self.direct = True
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # a file system without O_DIRECT
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as e:
            raise TierFileError(f"zeroshard: cannot use the disk tier's directory {directory!r} "
                                f"({e.strerror or e}): set offload_dir to a writable directory") from e
        self._own_pool = pool is None
        self._pool = pool or ThreadPoolExecutor(threads, thread_name_prefix="zeroshard-tier")
        self._read_pool = read_pool or self._pool
        self.closed = False

    def _take_lease(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        try:
            with open(self.lease) as f:
                host, pid = f.read().split()
        except FileNotFoundError:
            host = pid = None
        except ValueError:
            host, pid = "?", "0"  # an unreadable lease: its writer died mid-write
        if pid is not None and f"{host} {pid}" != me:
            if host == socket.gethostname() and _alive(int(pid)):
                raise TierFileError(f"zeroshard: the disk tier file {self.path} is in use by process {pid} on "
                                    "this host: give each job its own offload_dir")
            if host != socket.gethostname() and host != "?":
                raise TierFileError(f"zeroshard: the disk tier file {self.path} is leased by {host} (pid {pid}): "
                                    "offload_dir must be local to each node; remove the lease if that job is gone")
            log.warning("reclaiming the disk tier file %s left by process %s (gone)", self.path, pid)
            if os.path.exists(self.path):
                os.remove(self.path)
        with open(self.lease, "w") as f:
            f.write(me)

    def add(self, size: int) -> int:
        """One more record, of `size` bytes, past the others (the file grows as it is written).
        Returns its index."""
        with self._lock:
            self.offsets.append(self.nbytes)
            self.sizes.append(size)
            self.generations.append(0)
            self.nbytes += ALIGN + _round_up(size)
            return len(self.sizes) - 1

    # -- I/O --------------------------------------------------------------------------------------
    def write(self, index: int, data) -> Future:
        """Write record `index` from `data` (a bytes-like object of its size; an aligned_buffer for
        O_DIRECT). The future's result is None once it is on disk (not fsync'ed)."""
        with self._lock:
            self.generations[index] += 1
            generation = self.generations[index]
        return self._pool.submit(self._write, index, generation, memoryview(data).cast("B"))

    def read(self, index: int, into) -> Future:
        """Read record `index` into `into` (writable, at least its size; an aligned_buffer for
        O_DIRECT), verified. The future's result is `into`."""
        return self._read_pool.submit(self._read, index, self.generations[index], memoryview(into).cast("B"))

    def _write(self, index: int, generation: int, data: memoryview) -> None:
        n = self.sizes[index]
        if len(data) < n:
            raise TierFileError(f"zeroshard: record {index} of {self.path} is {n} bytes; given {len(data)}")
        header = aligned_buffer(ALIGN)
        header[:_HEADER.size] = _HEADER.pack(_MAGIC, index, generation, n, zlib.crc32(data[:n]))
        body = data[:_round_up(n)] if len(data) >= _round_up(n) else self._padded(data[:n])
        self._io(os.pwritev, [header, body], self.offsets[index], ALIGN + len(body), index, "write")

    def _read(self, index: int, generation: int, into: memoryview) -> memoryview:
        n = self.sizes[index]
        if generation == 0:
            raise TierFileError(f"zeroshard: record {index} of {self.path} was never written")
        if os.fstat(self.fd).st_nlink == 0:  # unlinked: its bytes are still readable, the job's files are not
            raise TierFileError(f"zeroshard: the disk tier file {self.path} was removed under this job")
        header = aligned_buffer(ALIGN)
        whole = len(into) >= _round_up(n)
        body = into[:_round_up(n)] if whole else aligned_buffer(n)
        self._io(os.preadv, [header, body], self.offsets[index], ALIGN + len(body), index, "read")
        magic, got_index, got_generation, got_n, crc = _HEADER.unpack(bytes(header[:_HEADER.size]))
        if (magic, got_index, got_generation, got_n) != (_MAGIC, index, generation, n):
            raise TierFileError(f"zeroshard: record {index} of {self.path} is not the one written last "
                                f"(found record {got_index}, generation {got_generation} of {got_n} bytes; expected "
                                f"generation {generation} of {n} bytes): the file was changed under this job")
        if zlib.crc32(body[:n]) != crc:
            raise TierFileError(f"zeroshard: record {index} of {self.path} fails its checksum: the file was "
                                "changed under this job, or the disk returned other bytes")
        if not whole:
            into[:n] = body[:n]
        return into

    @staticmethod
    def _padded(data: memoryview) -> memoryview:
        buf = aligned_buffer(len(data))
        buf[:len(data)] = data
        return buf

    def _io(self, call, buffers, offset: int, expected: int, index: int, what: str) -> None:
        self.meter.begin(what)
        try:
            done = call(self.fd, buffers, offset)
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            raise TierFileError(f"zeroshard: {what} of record {index} of {self.path} failed: "
                                + ("the disk is full" if full else (e.strerror or str(e)))) from e
        finally:
            self.meter.end(what)
        if done != expected:
            raise TierFileError(f"zeroshard: short {what} of record {index} of {self.path} ({done} of {expected} "
                                f"bytes): the file was truncated or removed under this job, or the disk is full")

    def close(self) -> None:
        """Wait for the I/O in flight (a shared pool: its owner waits), then remove the file and the lease."""
        if self.closed:
            return
        self.closed = True
        if self._own_pool:
            self._pool.shutdown(wait=True)
        os.close(self.fd)
        for path in (self.path, self.lease):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
