"""Scenarios of tests/test_disk_tier.py: offload_optimizer='disk' trains bit for bit what
offload_optimizer=True trains (the same operations on the same values, only read from and written
to files between steps), its checkpoints go to and come from the host tier and the device, and its
failures (a tier file truncated, removed or changed, a full disk, an unusable directory) raise
TierFileError on every rank."""
from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile

import torch

import zeroshard
from distributed import WorldResults, error_on_every_rank, every_rank, record, shared_temp_dir
from models import batches, digest, make_adamw, make_sgd, max_diff, reference, tiny_gpt2, train

CASES = {  # name: (precision, optimizer, extra config)
    "fp32_sgd_clip": ("fp32", make_sgd, {"clip_grad_norm": 0.5}),
    "fp32_adamw": ("fp32", make_adamw, {}),
    "bf16_cpuadamw": ("bf16", zeroshard.CPUAdamW, {}),
    "fp16_cpuadamw": ("fp16", zeroshard.CPUAdamW, {}),
}
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def tier_dir() -> str:
    return tempfile.mkdtemp(prefix="zeroshard-tier-")


def disk(cfg: dict, directory: str | None = None) -> dict:
    return {**cfg, "offload_optimizer": "disk", "offload_dir": directory or tier_dir()}


def tier_figures(engine) -> dict:
    """What the last step moved through the tier, and where the model states are."""
    s = engine.stats()
    return {"disk_tier": s["disk_tier"], "by_device": s["model_state_bytes_by_device"],
            "by_kind": s["model_state_bytes_by_kind"], "files": sorted(os.listdir(engine.optim.tier.directory))}


def _add_grid():
    for case, (prec, opt, extra) in CASES.items():
        for stage in (1, 2, 3):
            def fn(rank, world, prec=prec, opt=opt, extra=extra, stage=stage):
                data = batches(3, world, 2, accumulation=2)
                cfg = {"stage": stage, "precision": prec, "chunk_size": 20000, "gradient_accumulation_steps": 2,
                       "offload_optimizer": True, **extra}
                host = zeroshard.initialize(tiny_gpt2(), opt, cfg)
                train(host, data, rank)
                tiered = zeroshard.initialize(tiny_gpt2(), opt, disk(cfg))
                train(tiered, data, rank)
                out = {"diff": max_diff(host.full_state_dict(), tiered.full_state_dict()), **tier_figures(tiered),
                       "host_bytes": host.stats()["model_state_bytes_by_device"],
                       "digests": every_rank(digest(tiered.full_state_dict()))}
                if prec == "fp32" and stage == 2:  # the model plain PyTorch trains, as test_offload checks
                    ref, _, _ = reference(tiny_gpt2(), data, opt, extra.get("clip_grad_norm"))
                    out["vs_ref"] = max_diff(tiered.full_state_dict(), ref)
                return out
            SCENARIOS[f"disk_{case}_stage{stage}"] = fn


_add_grid()


@scenario
def disk_delayed_update(rank, world):
    """The delayed update's background step streams through the tier as the plain one does."""
    data = batches(4, world, 1)
    cfg = {"stage": 2, "chunk_size": 20000, "offload_optimizer": True, "delay_update_after": 1}
    host = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
    train(host, data, rank)
    tiered = zeroshard.initialize(tiny_gpt2(), make_adamw, disk(cfg))
    train(tiered, data, rank)
    return {"diff": max_diff(host.full_state_dict(), tiered.full_state_dict()), **tier_figures(tiered)}


@scenario
def disk_nonfinite_skip(rank, world):
    """A NaN gradient on one rank (config nonfinite='skip') skips the step on every rank: the tier's
    records are not touched, and training goes on as with the host tier."""
    data = batches(4, world, 1)
    data[1, 0, world - 1, 0] = -1  # marks the last rank's batch of step 1: its loss is made NaN
    cfg = {"stage": 2, "chunk_size": 20000, "offload_optimizer": True, "nonfinite": "skip"}

    def run(c):
        e = zeroshard.initialize(tiny_gpt2(), make_sgd, c)
        train(e, data, rank, loss_fn=_nan_on_negative)
        return e
    host, tiered = run(cfg), run(disk(cfg))
    return {"diff": max_diff(host.full_state_dict(), tiered.full_state_dict()),
            "skipped": [host.stats()["skipped_steps"], tiered.stats()["skipped_steps"]]}


def _nan_on_negative(m, x):
    """The GPT-2 loss, made NaN for a batch holding a negative token id (then replaced by 0)."""
    bad = bool((x < 0).any())
    loss = m(input_ids=x.clamp(min=0), labels=x.clamp(min=0)).loss
    return loss * float("nan") if bad else loss


class _UsedBackwards(torch.nn.Module):
    """Layers listed in the reverse of their use: the engine re-packs its chunks in order of first
    use after the first micro-batch (the masters come back from the tier into new chunks)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c, self.b, self.a = (torch.nn.Linear(24, 24) for _ in range(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


def repacked_and_thawed(rank, world, stage: int, cases, plain: dict, tiered: dict) -> dict:
    """_UsedBackwards trained 4 steps under the `plain` config and under the `tiered` one, per case:
    "repack" (re-packed after the first micro-batch), "frozen" (b frozen throughout), "thaw" (b
    frozen at initialize and unfrozen after the first step). Per case: the largest difference of
    the two runs' weights, and the first parameter packed (the tiered run's)."""
    x = torch.randn(4, world, 6, 24, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in cases:
        sds = []
        for cfg in (plain, tiered):
            m = _UsedBackwards()
            if name in ("frozen", "thaw"):
                m.b.requires_grad_(False)
            e = zeroshard.initialize(m, make_sgd, {"stage": stage, "chunk_size": 600, **cfg})
            for k in range(4):
                if name == "thaw" and k == 1:
                    m.b.requires_grad_(True)
                e.backward(e(x[k, rank]))
                e.step()
            sds.append(e.full_state_dict())
            first = e.chunks[0].slots[0].name
        out[name] = max_diff(*sds)
        out[f"{name}_first_packed"] = first
    return out


@scenario
def disk_repacked_and_thawed(rank, world):
    """A re-pack after the first micro-batch, and a layer frozen at initialize and unfrozen after
    the first step: the disk tier trains what the host tier trains."""
    return repacked_and_thawed(rank, world, 2, ("repack", "thaw"), {"offload_optimizer": True}, disk({}))


@scenario
def disk_auto_plan(rank, world):
    """offload='auto' with offload_dir and a host_memory cap below what the host tier needs: the
    plan puts some chunks in the disk tier, and the engine trains the model plain PyTorch trains."""
    from zeroshard.distributed.collectives import default_device
    from zeroshard.planning.auto_plan import optimizer_state_bytes
    from zeroshard.planning.hardware import probe, probe_disk
    from zeroshard.planning.planner import FRAGMENTATION, Planner, Target
    data = batches(3, world, 1)
    ref, _, _ = reference(tiny_gpt2(), data, make_adamw)
    x = data[0, 0, rank]
    example = {"input_ids": x, "labels": x}
    d = tier_dir()
    read, write = probe_disk(d)
    hw = probe(default_device(), torch.float32).with_(disk_read=read, disk_write=write)
    prof = zeroshard.profile(tiny_gpt2(), example, dtype="fp32")

    def planner(device, host):
        return Planner(prof, Target(hw.with_(device_memory=device, host_memory=host), world=world,
                                    optimizer_state_bytes=optimizer_state_bytes(make_adamw), disk=True), chunk_size=6000)
    big = planner(1 << 40, 1 << 40)
    offloaded = {b.name: b for b in big.baselines()}["ZeRO-3 offload"]
    device = int(offloaded.device_bytes / FRAGMENTATION) + 1  # only (nearly) everything offloaded fits
    n = len(offloaded.optimizer_on_host)
    all_disk = big.evaluate("", 3, offloaded.cache_chunks, [True] * n, [True] * n).host_model_bytes
    host = int((offloaded.host_model_bytes + all_disk) / 2 / FRAGMENTATION)  # between all on the host and all on disk
    cfg = {"stage": 3, "offload": "auto", "device_memory": device, "host_memory": host, "offload_dir": d,
           "chunk_size": 6000}
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg, example_inputs=example)
    train(engine, data, rank)
    plan = engine.plan
    return {"diff": max_diff(engine.full_state_dict(), ref), "disk_chunks": plan.disk_chunks,
            "offloaded_chunks": plan.offloaded_chunks, "fits": plan.fits, "plan": plan.describe(),
            "by_device": engine.stats()["model_state_bytes_by_device"], "predicted_disk": plan.disk_model_bytes}


@scenario
def disk_load_state_dict_midway(rank, world):
    """model.load_state_dict after two steps writes the masters alone (the records' optimizer
    states stay as they are on disk); the next steps equal the host tier's doing the same, and
    full_state_dict reads the masters alone."""
    data = batches(4, world, 1)
    values = {k: v * 0.5 for k, v in tiny_gpt2(seed=3).state_dict().items()}
    out = {}
    for name, cfg in (("host", {"offload_optimizer": True}), ("disk", disk({}))):
        e = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "chunk_size": 20000, **cfg})
        train(e, data[:2], rank)
        e.module.load_state_dict(values)
        train(e, data[2:], rank)
        out[name] = e.full_state_dict()
        if name == "disk":
            read = e.optim.tier.read_bytes  # since the last step: what full_state_dict read
            out["read_by_state_dict"], out["masters"] = read, sum(4 * n for n in e.optim.tier.numels)
    return {"diff": max_diff(out["host"], out["disk"]), "read_by_state_dict": out["read_by_state_dict"],
            "masters": out["masters"]}


@scenario
def disk_checkpoint_round_trips(rank, world):
    """Saved by a disk-tier run after 2 of 4 steps, loaded by a disk-tier, a host-tier and a
    device-only run at another stage, each finishing the 4 steps: all equal the uninterrupted
    run. And back: a host-tier checkpoint loaded by a disk-tier run."""
    data = batches(4, world, 1)
    cfg = {"stage": 2, "chunk_size": 20000}
    root = shared_temp_dir("zeroshard-ckpt-")
    whole = zeroshard.initialize(tiny_gpt2(), make_adamw, disk(cfg))
    train(whole, data[:2], rank)
    whole.save_checkpoint(root, tag="from_disk")
    train(whole, data[2:], rank)
    want = whole.full_state_dict()
    out = {}
    for name, c in (("disk", disk({**cfg, "stage": 3})), ("host", {**cfg, "stage": 3, "offload_optimizer": True}),
                    ("device", {**cfg, "stage": 1})):
        e = zeroshard.initialize(tiny_gpt2(), make_adamw, c)
        e.load_checkpoint(root, tag="from_disk")
        train(e, data[2:], rank)
        out[name] = max_diff(want, e.full_state_dict())
        if name == "host":
            h = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "offload_optimizer": True})
            train(h, data[:2], rank)
            h.save_checkpoint(root, tag="from_host")
    e = zeroshard.initialize(tiny_gpt2(), make_adamw, disk(cfg))
    e.load_checkpoint(root, tag="from_host")
    train(e, data[2:], rank)
    out["host_to_disk"] = max_diff(want, e.full_state_dict())
    # a second load into the same disk-tier run (its records already hold states) also lands exactly
    e.load_checkpoint(root, tag="from_disk")
    train(e, data[2:], rank)
    out["reload"] = max_diff(want, e.full_state_dict())
    out["optimizer_state_dict"] = error_on_every_rank(lambda: e.optimizer.state_dict())[rank]
    out["optimizer_load_state_dict"] = error_on_every_rank(
        lambda: e.optimizer.load_state_dict({"state": {}, "param_groups": e.optimizer.param_groups}))[rank]
    out["full_optimizer_state_dict"] = error_on_every_rank(lambda: e.full_optimizer_state_dict())[rank]
    every_rank(None)
    if rank == 0:
        shutil.rmtree(root)
    return out


def _fault(rank, world, harm, cfg=None, tiered=disk, again=lambda engine, x: engine.full_state_dict()) -> dict:
    """One step and a checkpoint of a `tiered(cfg)` run, then `harm(engine)` on the last rank, then
    a second step: what each rank raised, what `again(engine, tokens)` raises after it, and whether
    the checkpoint still loads as it was saved (into a `cfg` run, without the tier)."""
    data = batches(2, world, 1)
    root = shared_temp_dir("zeroshard-ckpt-")
    cfg = cfg or {"stage": 2, "chunk_size": 20000}
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, tiered(cfg))
    train(engine, data[:1], rank)
    engine.save_checkpoint(root, tag="before")
    saved = engine.full_state_dict()
    if rank == world - 1:
        harm(engine)
    out = {"raised": error_on_every_rank(lambda: train(engine, data[1:], rank)),
           "again": error_on_every_rank(lambda: again(engine, data[1, 0, rank]))}
    fresh = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
    fresh.load_checkpoint(root)
    out["checkpoint_intact"] = max_diff(saved, fresh.full_state_dict())
    every_rank(None)
    if rank == 0:
        shutil.rmtree(root)
    return out


@scenario
def disk_full_during_save(rank, world):
    """A save that fails for a full disk (every rank unable to grow a file past 4 KiB) while the
    disk tier streams its states into it: CheckpointError on every rank; the tier is intact (the
    next step trains what the host tier trains), and the checkpoint before loads as it was saved."""
    import resource
    import signal
    data = batches(3, world, 1)
    root = shared_temp_dir("zeroshard-ckpt-")
    cfg = {"stage": 2, "chunk_size": 20000}
    host = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "offload_optimizer": True})
    train(host, data, rank)
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, disk(cfg))
    train(engine, data[:1], rank)
    engine.save_checkpoint(root, tag="A")
    saved = engine.full_state_dict()
    train(engine, data[1:2], rank)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        raised = error_on_every_rank(lambda: engine.save_checkpoint(root, tag="B"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    train(engine, data[2:], rank)
    fresh = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
    fresh.load_checkpoint(root)
    out = {"raised": raised, "after": max_diff(host.full_state_dict(), engine.full_state_dict()),
           "checkpoint_intact": max_diff(saved, fresh.full_state_dict())}
    every_rank(None)
    if rank == 0:
        shutil.rmtree(root)
    return out


def _tier_file(engine, field="exp_avg") -> str:
    return engine.optim.tier.files[field].path


@scenario
def disk_fault_truncated(rank, world):
    return _fault(rank, world, lambda e: os.truncate(_tier_file(e), 4096))


@scenario
def disk_fault_removed(rank, world):
    return _fault(rank, world, lambda e: os.remove(_tier_file(e, "master")))


@scenario
def disk_fault_changed(rank, world):
    def flip(e):  # one byte of the first record's payload, past its 4 KiB header
        with open(_tier_file(e), "r+b") as f:
            f.seek(4096 + 10)
            b = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([b[0] ^ 0xFF]))
    return _fault(rank, world, flip)


@scenario
def disk_fault_full(rank, world):
    import zeroshard.files.tier_files as tf

    def fill(e):
        def full(fd, buffers, offset):
            raise OSError(errno.ENOSPC, "No space left on device")
        tf.os = _OsWith(pwritev=full)
    try:
        return _fault(rank, world, fill)
    finally:
        tf.os = os


@scenario
def disk_fault_optimizer_raises(rank, world):
    """The user's optimizer raising part way through the tier's host loop on one rank: its error
    there, TierFileError naming it on the others (who waited for its word, not for a timeout)."""
    def raising(e):
        def step(*args, **kwargs):
            raise RuntimeError("the optimizer broke")
        e.optim.optimizer.step = step
    return _fault(rank, world, raising)


class _OsWith:
    """`os` with some functions replaced (a full disk, for the tier's writes only)."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


@scenario
def disk_unusable_directory(rank, world):
    """offload_dir that is a file on one rank: TierFileError at initialize on every rank."""
    blocker = os.path.join(tier_dir(), "not-a-directory")
    with open(blocker, "w") as f:
        f.write("x")
    d = os.path.join(blocker, "tier") if rank == world - 1 else tier_dir()
    return {"raised": error_on_every_rank(lambda: zeroshard.initialize(
        tiny_gpt2(), make_adamw, disk({"stage": 2, "chunk_size": 20000}, d)))}


@scenario
def disk_files_removed_with_the_engine(rank, world, tiered=disk):
    """The tier's files while a `tiered` run trains, and after the engine is dropped."""
    d = tier_dir()
    e = zeroshard.initialize(tiny_gpt2(), make_adamw, tiered({"stage": 3, "chunk_size": 20000}, d))
    train(e, batches(1, world, 1), rank)
    during = sorted(os.listdir(d))
    del e
    import gc
    gc.collect()
    return {"during": during, "after": sorted(os.listdir(d))}


def run(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in SCENARIOS.items()],
           traceback_limit=-3)


DISK = WorldResults(run, "disk")
