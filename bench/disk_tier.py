"""The disk tier (issue 33) on a model whose states exceed this machine's RAM.

    python bench/disk_tier.py --dir DIR                 # GPT-2 2.0B: 24 layers x 2560, bf16, AdamW
    python bench/disk_tier.py --dir DIR --n-layer 2 --n-embd 256 --steps 2   # a smoke run

Model: GPT-2 (transformers, vocab 50257, n_head = n_embd / 128, tied embedding, no dropout) built
on the meta device: zeroshard materialises it tensor by tensor
into its chunks, so no whole copy of the model is ever made. Training: world 1 on the CPU, stage 2,
bf16, zeroshard.CPUAdamW(lr 1e-4), offload_optimizer='disk' with offload_dir=DIR; --batch
sequences of --seq random tokens per step (default 1 x 8: bf16 matmuls run at well under a
GFLOP/s on this machine's CPU, and the figures wanted are the optimizer step's).

--params-disk: stage 3 with offload_params='disk' (the shards in the tier too, read at each
gather; the rCache holds --cache-chunks), so the host keeps only the gradient shards and buffers.

Printed: the machine's RAM and the model's state bytes (16 per parameter: bf16 parameters and
gradients, fp32 master and two moments); the raw bandwidth of DIR's disk, measured here with the
tier's own files (TierFile: O_DIRECT, the same threads and record size) writing and reading
--raw-gib GiB, before the model is built and again after training (a shared virtual disk varies:
the steps are compared with the better of the two); then per step: forward+backward, the optimizer step split into its waits for disk
reads and for frames being written, and the rest (the CPU Adam and the copies), the bytes read and
written, the bandwidth the disk gave the step (bytes over the seconds a read, or a write, was in
flight) next to the raw bandwidth, and the share of the step spent waiting on I/O. The peak
resident memory from the set-up on (VmHWM, reset after the first raw measurement) ends the report.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402
from zeroshard.files.tier_files import TierFile, aligned_buffer  # noqa: E402

VOCAB = 50257


def gpt2_params(n_layer: int, d: int, seq: int) -> int:
    return n_layer * (12 * d * d + 13 * d) + VOCAB * d + seq * d + 2 * d


def raw_bandwidth(directory: str, total: int, record: int) -> tuple[float, float, float, float]:
    """GB/s writing a new file, overwriting it (what every step after the first does), then reading
    it: `total` bytes in records of `record` bytes through TierFiles, as the tier does (O_DIRECT,
    each record checksummed and verified, no fsync: the tier's files are scratch; the bytes are fp32
    values drawn as initial weights are, not random bytes, since a virtual disk may compress), with 2 and with
    4 threads, twice as many records in flight as threads (a sliding window); the best of the two
    each way (the tier runs 2 read and 2 write threads at once); and mixed_bandwidth's figure."""
    n = max(1, total // record)
    best = [0.0, 0.0, 0.0]
    for threads in (2, 4):
        f = TierFile(directory, "raw-bandwidth.tier", [record] * n, threads=threads)
        bufs = [aligned_buffer(record) for _ in range(2 * threads)]
        for b in bufs:  # fp32 values like the records' (a virtual disk may compress; random bytes would not)
            torch.frombuffer(b, dtype=torch.float32).normal_(0, 0.02)

        def timed(io) -> float:
            t0, window = time.perf_counter(), []
            for j in range(n):
                if len(window) == len(bufs):
                    window.pop(0).result()
                window.append(io(j, bufs[j % len(bufs)]))
            for fut in window:
                fut.result()
            return n * record / (time.perf_counter() - t0) / 1e9
        try:
            got = (timed(lambda j, b: f.write(j, b[:record])), timed(lambda j, b: f.write(j, b[:record])),
                   timed(f.read))
        finally:
            f.close()
        best = [max(a, b) for a, b in zip(best, got)]
    return tuple(best) + (mixed_bandwidth(directory, total, record),)


def mixed_bandwidth(directory: str, total: int, record: int) -> float:
    """GB/s of reads and writes together, as a step moves them: half of `total` read from one file
    while the other half is written to another, each through 2 threads with 4 records in flight
    (the tier's pools); bytes both ways over the wall time."""
    n = max(1, total // 2 // record)
    src = TierFile(directory, "raw-read.tier", [record] * n, threads=2)
    dst = TierFile(directory, "raw-write.tier", [record] * n, threads=2)
    bufs = [aligned_buffer(record) for _ in range(8)]
    for b in bufs:
        torch.frombuffer(b, dtype=torch.float32).normal_(0, 0.02)
    try:
        for fut in [src.write(j, bufs[0][:record]) for j in range(n)] + \
                [dst.write(j, bufs[1][:record]) for j in range(n)]:  # both files allocated first
            fut.result()
        t0, reads, writes = time.perf_counter(), [], []
        for j in range(n):
            for window, io, k in ((reads, src.read, 0), (writes, lambda i, b: dst.write(i, b[:record]), 4)):
                if len(window) == 4:
                    window.pop(0).result()
                window.append(io(j, bufs[k + j % 4]))
        for fut in reads + writes:
            fut.result()
        return 2 * n * record / (time.perf_counter() - t0) / 1e9
    finally:
        src.close()
        dst.close()


def build(n_layer: int, d: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=d, n_head=max(1, d // 128), vocab_size=VOCAB, n_positions=seq,
                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    return model


def peak_rss() -> int:
    """Peak resident bytes since the last reset_peak_rss (Linux: VmHWM), else since the start."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_peak_rss() -> None:
    """Start the peak afresh (Linux: writing 5 to clear_refs resets VmHWM), so the raw bandwidth
    measurement's buffers do not count as the set-up's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="offload_dir: a directory on the disk to measure")
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-embd", type=int, default=2560)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--raw-gib", type=float, default=4.0)
    ap.add_argument("--params-disk", action="store_true", help="stage 3 with offload_params='disk': the 16-bit "
                    "parameter shards in the tier too (read at each gather), the rCache at --cache-chunks")
    ap.add_argument("--cache-chunks", type=int, default=4)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    torch.manual_seed(0)
    psi = gpt2_params(args.n_layer, args.n_embd, args.seq)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = {"params": psi, "ram_bytes": ram, "model_state_bytes": 16 * psi}
    print(f"GPT-2 {args.n_layer} x {args.n_embd}: {psi / 1e9:.2f} B parameters; model states 16 x params = "
          f"{16 * psi / 2**30:.1f} GiB against {ram / 2**30:.1f} GiB of RAM", flush=True)

    record = (max(12 * args.n_embd * args.n_embd, VOCAB * args.n_embd)) * 4  # the largest chunk's master, roughly
    before = raw_bandwidth(args.dir, int(args.raw_gib * 2**30), record)
    print(f"raw disk bandwidth of {args.dir} before (TierFile, O_DIRECT, best of 2 and 4 threads, {record / 2**20:.0f} MiB records, "
          f"{args.raw_gib:g} GiB): write {before[0]:.2f} GB/s into a new file, {before[1]:.2f} overwriting it, read "
          f"{before[2]:.2f}; reading and writing at once {before[3]:.2f} (both ways)", flush=True)

    reset_peak_rss()
    t0 = time.perf_counter()
    model = build(args.n_layer, args.n_embd, args.seq)
    cfg = {"stage": 2, "precision": "bf16", "offload_optimizer": "disk", "offload_dir": args.dir}
    if args.params_disk:
        cfg.update(stage=3, offload_params="disk", cache_chunks=args.cache_chunks)
    out["config"] = cfg
    print(f"config {cfg}", flush=True)
    engine = zeroshard.initialize(model, lambda ps: zeroshard.CPUAdamW(ps, lr=1e-4), cfg)
    tier = engine.optim.tier
    out["setup_s"] = time.perf_counter() - t0
    out["peak_rss_after_setup"] = peak_rss()
    print(f"set-up {out['setup_s']:.0f} s ({len(tier.numels)} disk-tier chunks, largest record "
          f"{max(tier.numels) * 4 / 2**20:.0f} MiB of master); set-up's peak RSS "
          f"{out['peak_rss_after_setup'] / 2**30:.1f} GiB", flush=True)

    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.steps):
        x = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        t_fb = time.perf_counter() - t
        t = time.perf_counter()
        engine.step()
        t_step = time.perf_counter() - t
        s = engine.stats()["disk_tier"]
        waits = s["read_wait_s"] + s["write_wait_s"]
        row = {"step": i, "loss": loss.item(), "forward_backward_s": t_fb, "optimizer_step_s": t_step,
               "read_wait_s": s["read_wait_s"], "write_wait_s": s["write_wait_s"], "compute_s": t_step - waits,
               "read_bytes": s["read_bytes"], "written_bytes": s["written_bytes"],
               "read_gbs": s["read_bytes"] / s["read_busy_s"] / 1e9 if s["read_busy_s"] else None,
               "write_gbs": s["written_bytes"] / s["write_busy_s"] / 1e9 if s["write_busy_s"] else None,
               "io_gbs": (s["read_bytes"] + s["written_bytes"]) / s["io_busy_s"] / 1e9 if s["io_busy_s"] else None,
               "io_wait_share": waits / t_step}
        p = engine.stats()["param_tier"]
        if p is not None:  # the shards' reads (each gather) and writes (the step)
            row["param_tier"] = p
            print(f"step {i}: parameter tier: read {p['read_bytes'] / 1e9:.1f} GB (gathers waited "
                  f"{p['read_wait_s']:.1f} s of forward+backward), wrote {p['written_bytes'] / 1e9:.1f} GB", flush=True)
        rows.append(row)
        print(f"step {i}: loss {row['loss']:.3f}; forward+backward {t_fb:.1f} s; optimizer step {t_step:.1f} s = "
              f"read waits {s['read_wait_s']:.1f} + write waits {s['write_wait_s']:.1f} + compute {row['compute_s']:.1f}"
              f"; read {s['read_bytes'] / 1e9:.1f} GB at "
              + (f"{row['read_gbs']:.2f}" if row["read_gbs"] else "-")
              + f" GB/s, wrote {s['written_bytes'] / 1e9:.1f} GB at "
              + (f"{row['write_gbs']:.2f}" if row["write_gbs"] else "-")
              + f" GB/s; I/O wait {row['io_wait_share']:.0%} of the step",
              flush=True)
    out["steps"] = rows
    out["peak_rss"] = peak_rss()
    out["frame_bytes"] = tier.buffer_bytes()
    del engine, tier  # the tier's files go with the engine: the disk is measured alone again
    import gc
    gc.collect()
    after = raw_bandwidth(args.dir, int(args.raw_gib * 2**30), record)
    print(f"raw disk bandwidth after: write {after[0]:.2f} GB/s into a new file, {after[1]:.2f} overwriting it, "
          f"read {after[2]:.2f}; reading and writing at once {after[3]:.2f}", flush=True)
    out["raw_before"], out["raw_after"] = before, after
    w, r, m = max(before[1], after[1]), max(before[2], after[2]), max(before[3], after[3])
    out["raw_write_gbs"], out["raw_read_gbs"], out["raw_new_file_write_gbs"] = w, r, max(before[0], after[0])
    out["raw_mixed_gbs"] = m
    for row in rows:
        row["read_of_raw"] = (row["read_gbs"] or 0) / r
        row["write_of_raw"] = (row["write_gbs"] or 0) / w
        row["mixed_of_raw"] = (row["io_gbs"] or 0) / m
        print(f"step {row['step']}: the disk moved {row['io_gbs'] or 0:.2f} GB/s both ways while busy, "
              f"{row['mixed_of_raw']:.0%} of the better raw figure reading and writing at once ({m:.2f}); reads alone "
              f"{row['read_of_raw']:.0%} of raw reading ({r:.2f}), writes {row['write_of_raw']:.0%} of raw "
              f"overwriting ({w:.2f})", flush=True)
    print(f"peak resident memory {out['peak_rss'] / 2**30:.1f} GiB of {ram / 2**30:.1f} GiB RAM; model states "
          f"{16 * psi / 2**30:.1f} GiB; tier frames {out['frame_bytes'] / 2**30:.1f} GiB", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
