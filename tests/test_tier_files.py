"""The disk tier's file (files/tier_files.py): records written behind and read ahead by threads,
each read verified (the generation written last, the length, a crc32), and every way the file can
be lost or changed under a job raising TierFileError instead of returning other bytes."""
import errno
import os
import socket
import subprocess
import sys

import pytest
import torch

from zeroshard import TierFileError, ZeroShardError
from zeroshard.files.tier_files import ALIGN, TierFile, aligned_buffer

SIZES = [3 * ALIGN, 5000, 1, 2 * ALIGN + 12]  # aligned and not: the last block is padded on disk


def payload(i: int, n: int, seed: int = 0) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed * 97 + i)) \
        .numpy().tobytes()


def filled(n: int, data: bytes) -> memoryview:
    buf = aligned_buffer(n)
    buf[:len(data)] = data
    return buf


@pytest.fixture
def tier(tmp_path):
    t = TierFile(str(tmp_path / "tier"), "rank0.tier", SIZES, threads=3)
    yield t
    t.close()


def test_records_round_trip_through_the_threads_and_overwrite(tier):
    for seed in (1, 2):  # the second round overwrites: reads see the last write
        writes = [tier.write(i, filled(n, payload(i, n, seed))) for i, n in enumerate(SIZES)]
        for w in writes:
            assert w.result() is None
        reads = [tier.read(i, aligned_buffer(n)) for i, n in enumerate(SIZES)]
        for i, (r, n) in enumerate(zip(reads, SIZES)):
            assert bytes(r.result()[:n]) == payload(i, n, seed)
    assert tier.generations == [2, 2, 2, 2]
    # a plain bytes object and an unaligned buffer work too (copied through an aligned one)
    tier.write(2, b"\x07").result()
    assert bytes(tier.read(2, bytearray(1)).result()) == b"\x07"
    assert os.path.getsize(tier.path) <= tier.nbytes


def test_a_record_never_written_or_the_wrong_size_is_refused(tier):
    with pytest.raises(TierFileError, match="record 1 .* was never written"):
        tier.read(1, aligned_buffer(SIZES[1])).result()
    with pytest.raises(TierFileError, match="is 5000 bytes; given 10"):
        tier.write(1, b"x" * 10).result()


def test_changed_truncated_or_removed_files_raise_instead_of_returning_other_bytes(tier):
    for i, n in enumerate(SIZES):
        tier.write(i, filled(n, payload(i, n))).result()
    # a payload byte flipped: the checksum
    with open(tier.path, "r+b") as f:
        f.seek(tier.offsets[0] + ALIGN + 5)
        b = f.read(1)
        f.seek(tier.offsets[0] + ALIGN + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(TierFileError, match="record 0 .* fails its checksum"):
        tier.read(0, aligned_buffer(SIZES[0])).result()
    # a stale record: this process's generation moved on, the file's did not
    tier.generations[1] += 1
    with pytest.raises(TierFileError, match="record 1 .* not the one written last"):
        tier.read(1, aligned_buffer(SIZES[1])).result()
    # truncated under the job: a short read
    os.truncate(tier.path, tier.offsets[3] + 100)
    with pytest.raises(TierFileError, match="short read of record 3"):
        tier.read(3, aligned_buffer(SIZES[3])).result()
    # removed under the job
    os.remove(tier.path)
    with pytest.raises(TierFileError, match="was removed under this job"):
        tier.read(2, aligned_buffer(SIZES[2])).result()


def test_a_full_disk_is_named(tier, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(TierFileError, match="write of record 0 .* the disk is full") as e:
        tier.write(0, filled(SIZES[0], payload(0, SIZES[0]))).result()
    assert isinstance(e.value, ZeroShardError) and isinstance(e.value.__cause__, OSError)


def test_an_unusable_directory_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(TierFileError, match="cannot use the disk tier's directory .*offload_dir"):
        TierFile(str(blocker / "tier"), "rank0.tier", SIZES)


def test_leases_refuse_a_live_job_and_reclaim_a_dead_ones(tmp_path, caplog):
    d = str(tmp_path / "tier")
    live = TierFile(d, "rank0.tier", SIZES)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # a lease held by another live process on this host
        with open(live.lease, "w") as f:
            f.write(f"{socket.gethostname()} {other.pid}")
        with pytest.raises(TierFileError, match=f"in use by process {other.pid}"):
            TierFile(d, "rank0.tier", SIZES)
    finally:
        other.kill()
        other.wait()
    # that process is gone (a killed run): its file is reclaimed
    with open(live.path, "ab") as f:
        f.write(b"left over")
    with caplog.at_level("WARNING", logger="zeroshard"):
        again = TierFile(d, "rank0.tier", SIZES)
    assert f"left by process {other.pid} (gone)" in caplog.text
    assert os.path.getsize(again.path) == 0
    again.close()
    assert not os.path.exists(again.path) and not os.path.exists(again.lease)
    live.close()  # the first one's file and lease were taken over, and are gone: nothing to remove
