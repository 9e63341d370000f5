"""Multi-process halves of tests/test_checkpoint.py: train and save in one process group, load and
train on in a fresh one (another spawn), and saves killed part-way.

Every function runs on each rank of a spawned group; rank 0 writes what the test reads.
"""
from __future__ import annotations

import functools
import os

import torch

import zeroshard
from distributed import record
from models import batches, make_adamw, make_sgd, tiny_gpt2, train


def tiny_gpt2_dropout(seed=0):
    """tiny_gpt2 with dropout on: a resumed run matches only if every rank's RNG state came back."""
    m = tiny_gpt2(seed=seed)
    for mod in m.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.1
    return m


def tiny_gpt2_frozen_positions(seed=0):
    """tiny_gpt2 with its position embedding frozen: a frozen chunk, saved and loaded without state."""
    m = tiny_gpt2(seed=seed)
    m.transformer.wpe.weight.requires_grad_(False)
    return m


def _cases():
    """name -> (config, optimizer, model): stages 0-3, without and with offload, fp32 and bf16."""
    out = {}
    for prec in ("fp32", "bf16"):
        for stage, offloads in ((0, ["none"]), (1, ["none", "opt"]), (2, ["none", "opt"]),
                                (3, ["none", "opt", "opt+params"])):
            for off in offloads:
                cfg = {"stage": stage, "precision": prec, "chunk_size": 20000,
                       "offload_optimizer": off != "none", "offload_params": off == "opt+params"}
                opt = zeroshard.CPUAdamW if off != "none" else make_adamw
                out[f"stage{stage}_{off}_{prec}"] = (cfg, opt, tiny_gpt2)
    out["stage1_none_fp32_sgd"] = ({"stage": 1, "chunk_size": 20000}, make_sgd, tiny_gpt2)
    out["stage3_opt_fp32_sgd"] = ({"stage": 3, "chunk_size": 20000, "offload_optimizer": True}, make_sgd, tiny_gpt2)
    out["stage2_none_fp16"] = ({"stage": 2, "precision": "fp16", "chunk_size": 20000,
                                "initial_loss_scale": 2.0**14, "loss_scale_window": 2}, make_adamw, tiny_gpt2)
    out["stage3_none_bf16_dropout"] = ({"stage": 3, "precision": "bf16", "chunk_size": 20000}, make_adamw,
                                       tiny_gpt2_dropout)
    out["stage2_none_bf16_frozen"] = ({"stage": 2, "precision": "bf16", "chunk_size": 20000}, make_adamw,
                                      tiny_gpt2_frozen_positions)
    out["stage2_none_fp32_accum2"] = ({"stage": 2, "chunk_size": 20000, "gradient_accumulation_steps": 2},
                                      make_adamw, tiny_gpt2)
    return out


CASES = _cases()
STEPS, HALF = 6, 3


def _data(world, cfg):
    return batches(STEPS, world, 1, cfg.get("gradient_accumulation_steps", 1))


def _each(rank, out_path, fn, names):
    # Bit for bit across two runs needs deterministic kernels: on CUDA, embedding and index backward
    # add with atomics in a varying order (a resumed bf16 run on an H100 landed one bf16 ulp away).
    torch.use_deterministic_algorithms(True)
    record(rank, out_path, [(name, functools.partial(fn, name)) for name in names])


def save_cases(rank, world, root, out_path):
    """For every case: a straight run of STEPS steps (its state saved by rank 0), and a run of HALF
    steps saved as checkpoint root/<case>."""
    def run(name):
        cfg, opt, model = CASES[name]
        data = _data(world, cfg)
        straight = zeroshard.initialize(model(), opt, cfg)
        torch.manual_seed(1000 + rank)  # each rank's dropout stream
        train(straight, data[:STEPS], rank)
        state = straight.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(root, f"{name}.straight.pt"))
        engine = zeroshard.initialize(model(), opt, cfg)
        torch.manual_seed(1000 + rank)
        train(engine, data[:HALF], rank)
        engine.save_checkpoint(os.path.join(root, name), client_state={"next_step": HALF, "saved_by_world": world})
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(root, f"{name}.saved.pt"))
        return {"steps": engine.steps}
    _each(rank, out_path, run, CASES)


def resume_cases(rank, world, root, out_path):
    """In a fresh process group: a model built with other weights loads each checkpoint and trains the
    remaining steps; compared bit for bit with the straight run."""
    def run(name):
        cfg, opt, model = CASES[name]
        data = _data(world, cfg)
        engine = zeroshard.initialize(model(seed=7), opt, cfg)
        torch.manual_seed(99)  # overwritten by the checkpoint's RNG state
        client = engine.load_checkpoint(os.path.join(root, name))
        steps_loaded = engine.steps
        train(engine, data[client["next_step"]:STEPS], rank)
        got = engine.full_state_dict()
        want = torch.load(os.path.join(root, f"{name}.straight.pt"))
        return {"bitwise": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
                "max_diff": max((got[k] - want[k]).abs().max().item() for k in want),
                "client_state": client, "steps_loaded": steps_loaded, "steps": engine.steps,
                "loss_scale": engine.stats()["loss_scale"]}
    _each(rank, out_path, run, CASES)


# -- another world size, stage and offload setting --------------------------------------------------------
GLOBAL = 6  # sequences per step: 3 per rank at world 2, 2 at world 3, 6 at world 1
TOPO_OPTS = {"sgd": make_sgd, "adamw": make_adamw}


def global_data():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, 128, (STEPS, GLOBAL, 32), generator=g)


def _train_rows(engine, data, rank, world, steps):
    per = GLOBAL // world
    for t in steps:
        x = data[t, rank * per:(rank + 1) * per]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()


def save_all(rank, world, root):
    """save_cases, then save_topology, in one spawned world (its processes start once)."""
    save_cases(rank, world, root, os.path.join(root, "saved.json"))
    save_topology(rank, world, root, os.path.join(root, "topo_saved.json"))


def save_topology(rank, world, root, out_path):
    """World 2, stage 3: a straight run and a checkpoint after HALF steps, per optimizer."""
    def run(name):
        cfg = {"stage": 3, "chunk_size": 20000}
        data = global_data()
        straight = zeroshard.initialize(tiny_gpt2(), TOPO_OPTS[name], cfg)
        _train_rows(straight, data, rank, world, range(STEPS))
        state = straight.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(root, f"topo_{name}.straight{world}.pt"))
        engine = zeroshard.initialize(tiny_gpt2(), TOPO_OPTS[name], cfg)
        _train_rows(engine, data, rank, world, range(HALF))
        engine.save_checkpoint(os.path.join(root, f"topo_{name}"))
        return {}
    _each(rank, out_path, run, TOPO_OPTS)


def resume_topology(rank, world, root, out_path, targets):
    """Load the world-2 stage-3 checkpoints with each config in `targets` ({label: (optimizer, config)})
    and train the remaining steps on this world's split of the same global batches."""
    def run(label):
        name, cfg = targets[label]
        x = global_data()[0, :GLOBAL // world]
        engine = zeroshard.initialize(tiny_gpt2(seed=7), TOPO_OPTS[name], cfg,
                                      example_inputs={"input_ids": x, "labels": x})  # used by 'auto' only
        engine.load_checkpoint(os.path.join(root, f"topo_{name}"))
        _train_rows(engine, global_data(), rank, world, range(HALF, STEPS))
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(root, f"topo_{label}.resumed{world}.pt"))
        return {"stats": {k: engine.stats()[k] for k in ("world_size", "model_state_bytes_by_device")},
                "plan": engine.plan.describe() if engine.plan else None}
    _each(rank, out_path, run, targets)


# -- saves killed part-way ------------------------------------------------------------------------------
def killed_save(rank, world, root, point):
    """Train, save checkpoint A (its state to root/../A.pt), train on, then die at `point` while
    saving B. Exits the process (os._exit), as a kill would: nothing is cleaned up."""
    data = batches(STEPS, world, 1)
    tag = "keep" if point == "replace" else None
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "chunk_size": 20000})
    train(engine, data[:HALF], rank)
    engine.save_checkpoint(root, tag=tag, client_state={"next_step": HALF})
    state = engine.full_state_dict()
    if rank == 0:
        torch.save(state, os.path.join(os.path.dirname(root), "A.pt"))
    train(engine, data[HALF:HALF + 1], rank)
    _arm(point, rank, world)
    engine.save_checkpoint(root, tag=tag)
    raise AssertionError(f"the save should have died at {point!r}")


def disk_full_save(rank, world, root, out_path):
    """Train, save A, train on, then save B with every rank unable to grow a file past 4 KiB (as a
    full disk: writes fail with EFBIG): every rank gets zeroshard.CheckpointError (an Exception),
    and A still loads bit for bit into a fresh engine."""
    import json
    import resource
    import signal
    data = batches(STEPS, world, 1)
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 2, "chunk_size": 20000})
    train(engine, data[:HALF], rank)
    engine.save_checkpoint(root, tag="A")
    saved = engine.full_state_dict()
    train(engine, data[HALF:HALF + 1], rank)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
    try:
        engine.save_checkpoint(root, tag="B")
        got = "no error"
    except Exception as e:  # noqa: BLE001 -- what reached the user is the figure
        got = f"{type(e).__name__}: {e}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    errors = engine.comm.all_gather_objects(got)
    fresh = zeroshard.initialize(tiny_gpt2(seed=1), make_adamw, {"stage": 3, "chunk_size": 20000})
    fresh.load_checkpoint(root)
    loaded = fresh.full_state_dict()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"errors": errors, "entries": sorted(os.listdir(root)),
                       "bitwise": all(torch.equal(loaded[k], saved[k]) for k in saved)}, f)


def _arm(point, rank, world):
    import torch.distributed.checkpoint.filesystem as fs

    import zeroshard.state.checkpoint as ck

    def die(*_, **__):
        os._exit(17)

    if point == "write" and rank == world - 1:  # half of one tensor's bytes, then gone
        original = fs._write_item
        calls = [0]

        def dying_write(transforms, stream, data, write_item, *args):
            calls[0] += 1
            if calls[0] == 3:
                stream.write(b"\x00" * 64)
                stream.flush()
                die()
            return original(transforms, stream, data, write_item, *args)
        fs._write_item = dying_write
    elif point == "metadata" and rank == 0:  # every shard written, no .metadata yet
        ck.SafeWriter.finish = die
    elif point == "commit" and rank == 0:  # checksums written, not renamed
        ck.commit = die
    elif point == "latest" and rank == 0:  # renamed, `latest` not yet replaced
        ck.write_latest = die
    elif point == "replace" and rank == 0:  # same tag: the old one set aside, the new one not in place
        real = os.replace

        def dying_replace(src, dst, *a, **k):
            if "/.tmp-" in str(src):
                die()
            return real(src, dst, *a, **k)
        ck.os.replace = dying_replace

