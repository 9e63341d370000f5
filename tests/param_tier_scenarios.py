"""Scenarios of tests/test_param_tier.py: offload_params='disk' (stage 3: the 16-bit parameter
shards in the disk tier's files, read at each gather, written by each step) trains bit for bit what
offload_params=True trains, with frozen chunks, a re-pack and a thaw; its checkpoints go to and come
from runs that keep the shards in host or device memory; a shard file harmed under a running job
raises TierFileError on every rank at the next gather (none waits in it)."""
from __future__ import annotations

import functools
import os
import shutil

import torch

import zeroshard
from disk_scenarios import _fault as disk_fault
from disk_scenarios import CASES, _OsWith, disk, disk_files_removed_with_the_engine, repacked_and_thawed
from distributed import WorldResults, every_rank, record, shared_temp_dir
from models import batches, digest, make_adamw, max_diff, tiny_gpt2, train

SCENARIOS = {}
HOST = {"offload_optimizer": True, "offload_params": True}  # what the parameter tier must equal


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def params_disk(cfg: dict, directory: str | None = None) -> dict:
    return {**disk(cfg, directory), "offload_params": "disk"}


def _add_grid():
    cases = {**CASES, "bf16_cpuadamw_cache1": ("bf16", zeroshard.CPUAdamW, {"cache_chunks": 1})}  # evictions,
    for case, (prec, opt, extra) in cases.items():  # prefetches let go, re-gathers in backward
        def fn(rank, world, prec=prec, opt=opt, extra=extra):
            data = batches(3, world, 2, accumulation=2)
            cfg = {"stage": 3, "precision": prec, "chunk_size": 20000, "gradient_accumulation_steps": 2, **extra}
            host = zeroshard.initialize(tiny_gpt2(), opt, {**cfg, **HOST})
            train(host, data, rank)
            tiered = zeroshard.initialize(tiny_gpt2(), opt, params_disk(cfg))
            train(tiered, data, rank)
            s = tiered.stats()
            return {"diff": max_diff(host.full_state_dict(), tiered.full_state_dict()),
                    "digests": every_rank(digest(tiered.full_state_dict())), "param_tier": s["param_tier"],
                    "by_device": s["model_state_bytes_by_device"], "by_kind": s["model_state_bytes_by_kind"],
                    "num_params": s["num_params"],
                    "host_by_kind": host.stats()["model_state_bytes_by_kind"],
                    "shards": [c.shard.numel() for c in tiered.chunks],  # between uses: placeholders
                    "shard_bytes": sum(c.shard_numel * c.full_bytes // c.padded_numel for c in tiered.chunks)}
        SCENARIOS[f"pdisk_{case}"] = fn


_add_grid()


@scenario
def pdisk_frozen_repacked_thawed(rank, world):
    """Stage 3 with the shards on disk: a re-pack after the first micro-batch, a layer frozen
    throughout (its shard's only copy is on disk), and a layer frozen at initialize and unfrozen
    after the first step: each trains what the host tier trains."""
    return repacked_and_thawed(rank, world, 3, ("repack", "frozen", "thaw"), HOST, params_disk({}))


@scenario
def pdisk_packed_a_chunk_at_a_time(rank, world):
    """While the model is packed, each chunk's master (optimizer tier) and shard (parameter tier)
    go to disk as soon as that chunk is built: at no moment does host memory hold two chunks'."""
    from zeroshard.optim.optimizer import ShardedOptimizer
    original, out = ShardedOptimizer.take_built, {}
    for name, cfg in (("stage2", disk({"stage": 2, "chunk_size": 20000})),
                      ("stage3", params_disk({"stage": 3, "chunk_size": 20000}))):
        seen, worst = [], [0, 0]

        def spy(self, c):
            original(self, c)
            seen.append(c)
            worst[0] = max(worst[0], sum(x.trainable and x.master.numel() > 0 for x in seen))
            worst[1] = max(worst[1], sum(x.stage == 3 and x.shard.numel() > 0 for x in seen))
        ShardedOptimizer.take_built = spy
        try:
            e = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
        finally:
            ShardedOptimizer.take_built = original
        train(e, batches(1, world, 1), rank)
        out[name] = {"chunks": len(seen), "host_masters": worst[0], "host_shards": worst[1]}
    return out


def _frozen_wpe() -> torch.nn.Module:
    m = tiny_gpt2()
    m.transformer.wpe.weight.requires_grad_(False)  # a frozen chunk: saved and loaded from its shard
    return m


@scenario
def pdisk_checkpoint_round_trips(rank, world):
    """Saved by a run with the shards on disk (one chunk frozen) after 2 of 4 steps, loaded by
    the same kind of run, a host-tier and a device-only one, each finishing the 4 steps: all equal
    the uninterrupted run. And back: a host-tier checkpoint loaded with the shards on disk."""
    data = batches(4, world, 1)
    cfg = {"stage": 3, "chunk_size": 20000}
    root = shared_temp_dir("zeroshard-ckpt-")
    whole = zeroshard.initialize(_frozen_wpe(), make_adamw, params_disk(cfg))
    train(whole, data[:2], rank)
    whole.save_checkpoint(root, tag="from_disk")
    train(whole, data[2:], rank)
    want = whole.full_state_dict()
    out = {"frozen_chunks": sum(not c.trainable for c in whole.chunks)}
    for name, c in (("disk", params_disk(cfg)), ("host", {**cfg, **HOST}), ("device", {**cfg, "stage": 2})):
        e = zeroshard.initialize(_frozen_wpe(), make_adamw, c)
        e.load_checkpoint(root, tag="from_disk")
        train(e, data[2:], rank)
        out[name] = max_diff(want, e.full_state_dict())
        if name == "host":
            h = zeroshard.initialize(_frozen_wpe(), make_adamw, {**cfg, **HOST})
            train(h, data[:2], rank)
            h.save_checkpoint(root, tag="from_host")
    e = zeroshard.initialize(_frozen_wpe(), make_adamw, params_disk(cfg))
    e.load_checkpoint(root, tag="from_host")
    train(e, data[2:], rank)
    out["host_to_disk"] = max_diff(want, e.full_state_dict())
    every_rank(None)
    if rank == 0:
        shutil.rmtree(root)
    return out


@scenario
def pdisk_load_state_dict_midway(rank, world):
    """model.load_state_dict after two steps writes the shards (and masters) in their tiers; the next
    steps, full_state_dict() and generate() equal the host tier's doing the same."""
    data = batches(4, world, 1)
    values = {k: v * 0.5 for k, v in tiny_gpt2(seed=3).state_dict().items()}
    out = {}
    for name, cfg in (("host", HOST), ("disk", params_disk({}))):
        e = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "chunk_size": 20000, **cfg})
        train(e, data[:2], rank)
        e.module.load_state_dict(values)
        train(e, data[2:], rank)
        out[name] = e.full_state_dict()
        out[f"{name}_generated"] = e.module.generate(data[0, 0, rank][:1, :4], max_new_tokens=4, do_sample=False,
                                                     pad_token_id=0).tolist()
    return {"diff": max_diff(out["host"], out["disk"]), "generated": out["disk_generated"],
            "same_generated": out["host_generated"] == out["disk_generated"]}


def _fault(rank, world, harm) -> dict:
    """disk_scenarios._fault with the shards on disk, a two-chunk rCache (prefetched chunks evicted
    and gathered again) and a later forward as what is tried after the failure."""
    return disk_fault(rank, world, harm, {"stage": 3, "chunk_size": 20000, "cache_chunks": 2}, params_disk,
                      again=lambda engine, x: engine(input_ids=x, labels=x))


def _shard_file(engine) -> str:
    return engine.layout.shard_tier.files["shard"].path


@scenario
def pdisk_fault_truncated(rank, world):
    return _fault(rank, world, lambda e: os.truncate(_shard_file(e), 4096))


@scenario
def pdisk_fault_removed(rank, world):
    return _fault(rank, world, lambda e: os.remove(_shard_file(e)))


@scenario
def pdisk_fault_full(rank, world):
    """The step's writes of shards fail (a full disk) on the last rank, its optimizer tier's
    writes still succeeding: every rank raises at that step."""
    import errno
    import zeroshard.files.tier_files as tf

    def fill(e):
        def full(fd, buffers, offset):
            if os.readlink(f"/proc/self/fd/{fd}").endswith(".shard.tier"):
                raise OSError(errno.ENOSPC, "No space left on device")
            return os.pwritev(fd, buffers, offset)
        tf.os = _OsWith(pwritev=full)
    try:
        return _fault(rank, world, fill)
    finally:
        tf.os = os


@scenario
def pdisk_files_removed_with_the_engine(rank, world):
    return disk_files_removed_with_the_engine(rank, world, params_disk)


def run(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in SCENARIOS.items()],
           traceback_limit=-3)


PARAM_DISK = WorldResults(run, "param_disk")
