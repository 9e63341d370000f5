"""Scenarios of tests/test_hybrid.py: hybrid sharding (config shard_group_size) and hpZ
(hpz_group_size) at worlds 4 (2 groups of 2) and 6 (3 groups of 2, 2 groups of 3), each trained
against single-process PyTorch on the global batch, with its per-link communication counts and
model-state bytes, offload/stage 'auto', the delayed update, the Trainer, and its checkpoints
resharded (within a world; from world 4 to worlds 3 and 6) and exported."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile


from distributed import WorldResults, every_rank, record
from models import (Quirky, batches, digest, make_adamw, make_sgd, max_diff, parity, quirky_data, quirky_loss,
                    reference, tiny_gpt2, train)

STEPS = 3
GROUPS = {4: (2,), 6: (2, 3)}  # shard group sizes tried at each world
# name -> (stage, optimizer, extra config)
PARITY = {
    "stage1_sgd": (1, "sgd", {}),
    "stage2_sgd": (2, "sgd", {}),
    "stage3_sgd": (3, "sgd", {}),
    "stage3_adamw": (3, "adamw", {}),
    "stage2_sgd_offload": (2, "sgd", {"offload_optimizer": True}),
    "stage3_sgd_offload_params_cache2": (3, "sgd", {"offload_optimizer": True, "offload_params": True,
                                                    "cache_chunks": 2}),
    "stage2_adamw_accum2": (2, "adamw", {"gradient_accumulation_steps": 2}),
    # the optimizer split across the replica groups (shard_optimizer_across_replicas)
    "stage1_sgd_split": (1, "sgd", {"shard_optimizer_across_replicas": True}),
    "stage2_sgd_split": (2, "sgd", {"shard_optimizer_across_replicas": True}),
    "stage2_adamw_split_accum2": (2, "adamw", {"shard_optimizer_across_replicas": True,
                                               "gradient_accumulation_steps": 2}),
}
# hpZ (config hpz_group_size), stage 3: name -> (optimizer, extra config). Small rCaches make the
# backward gather again, from the secondary shards; accumulation makes later forwards read them too.
HPZ = {
    "hpz_sgd": ("sgd", {}),
    "hpz_sgd_cache1": ("sgd", {"cache_chunks": 1}),
    "hpz_adamw_cache2_accum2": ("adamw", {"cache_chunks": 2, "gradient_accumulation_steps": 2}),
    "hpz_sgd_offload_params_cache2": ("sgd", {"offload_optimizer": True, "offload_params": True,
                                              "cache_chunks": 2}),
}
OPTIMIZERS = {"sgd": make_sgd, "adamw": make_adamw}


def quirky_parity(rank, world, key, group, stage, opt, extra):
    """`key`: shard_group_size (hybrid) or hpz_group_size, set to `group`."""
    accumulation = extra.get("gradient_accumulation_steps", 1)
    cfg = {"stage": stage, key: group, "chunk_size": 700,
           **{k: v for k, v in extra.items() if k != "gradient_accumulation_steps"}}
    data = quirky_data(STEPS, world, accumulation)
    engine, diff = parity(rank, world, Quirky, lambda m, x, *_: quirky_loss(m, x), data if accumulation > 1
                          else data[:, 0], OPTIMIZERS[opt], cfg, accumulation=accumulation)
    s = engine.stats()
    return {"diff": diff, "digests": every_rank(digest(engine.full_state_dict())),
            **{k: s[k] for k in ("shard_group_size", "hpz_group_size", "comm_elements_by_link")}}


def hpz_delayed_same_bytes(rank, world, group):
    """The delayed update (offloaded optimizer, stage 3, a 1-chunk rCache) with and without hpZ: the
    same reductions over the same ranks, so the same bytes after 4 steps (the update lands into the
    primary shards after the secondary ones were last read)."""
    import zeroshard
    data = quirky_data(4, world)
    digests = []
    for extra in ({}, {"hpz_group_size": group}):
        engine = zeroshard.initialize(Quirky(), make_adamw, {
            "stage": 3, "chunk_size": 700, "cache_chunks": 1, "offload_optimizer": True,
            "delay_update_after": 1, **extra})
        for k in range(4):
            engine.backward(quirky_loss(engine, data[k, 0, rank]))
            engine.step()
        digests.append(digest(engine.full_state_dict()))
    return {"digests": every_rank(digests)}


def hybrid_delayed(rank, world, group, stage):
    """The delayed update (offloaded optimizer, from step 2 on) with shard groups of `group` and
    with full sharding: the same optimisation (each delayed step's gradients summed over every
    rank before the background step), so the same model up to the order of the sums."""
    import zeroshard
    data = quirky_data(4, world)
    fulls = []
    for extra in ({"shard_group_size": group}, {}):
        engine = zeroshard.initialize(Quirky(), make_adamw, {
            "stage": stage, "chunk_size": 700, "offload_optimizer": True, "delay_update_after": 1, **extra})
        for k in range(4):
            engine.backward(quirky_loss(engine, data[k, 0, rank]))
            engine.step()
        fulls.append(engine.full_state_dict())
        applied = engine.stats()["step"]
    return {"diff": max_diff(*fulls), "digests": every_rank(digest(fulls[0])), "steps": applied}


def hybrid_trainer(rank, world, group):
    """The Hugging Face Trainer (trainer_scenarios.py's run) with shard groups of `group` at stage
    3, against the plain zeroshard loop with full sharding; its save_model opened by
    from_pretrained."""
    import transformers
    import trainer_scenarios as ts
    transformers.logging.set_verbosity_error()
    root = os.path.join(tempfile.gettempdir(), f"zeroshard-hybrid-trainer-{os.environ['MASTER_PORT']}")
    got = ts.trainer_run(rank, world, 3, os.path.join(root, "trainer"), config={"shard_group_size": group})
    plain, _ = ts.plain_loop(rank, world, 3, os.path.join(root, "plain"))
    final = os.path.join(root, "final")
    got["trainer"].save_model(final)
    out = {"state_vs_plain": max_diff(got["state"], plain), "digests": every_rank(digest(got["state"])),
           "shard_group_size": got["trainer"].engine.stats()["shard_group_size"]}
    if rank == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(final).state_dict()
        out["save_model_max_diff"] = max(float((loaded[k] - got["state"][k]).abs().max()) for k in got["state"])
        shutil.rmtree(root, ignore_errors=True)  # every rank is past save_model, the last collective
    return out


def hybrid_lightning(rank, world, group):
    """Lightning's ZeroShardStrategy (lightning_scenarios.py's fit) with shard groups of `group` at
    stage 3, against the plain zeroshard loop with full sharding."""
    import lightning_scenarios as ls
    root = os.path.join(tempfile.gettempdir(), f"zeroshard-hybrid-lightning-{os.environ['MASTER_PORT']}")
    trainer, module = ls.fit(rank, world, 3, root, shard_group_size=group)
    engine = trainer.strategy.engine
    state = {k.removeprefix("model."): v for k, v in engine.full_state_dict().items()}  # the LightningModule's keys
    plain, _ = ls.plain_loop(rank, world, 3)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"state_vs_plain": max_diff(state, plain), "digests": every_rank(digest(state)),
            "shard_group_size": engine.stats()["shard_group_size"], "steps": trainer.global_step}


def hybrid_auto(rank, world, group):
    """offload/stage 'auto' with shard groups of `group`: planned for the group (a cap between
    ZeRO-3 and ZeRO-3 offload of a G-rank world), trains the single-process model."""
    import zeroshard
    from offload_memory_scenarios import _auto_caps
    data = batches(3, world, 2, accumulation=2)
    ref, _, _ = reference(tiny_gpt2(), data, make_adamw)
    example = {"input_ids": data[0, 0, rank], "labels": data[0, 0, rank]}
    caps, _ = _auto_caps(group, "fp32", make_adamw, example)
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {
        "stage": "auto", "offload": "auto", "device_memory": caps["tight"], "gradient_accumulation_steps": 2,
        "shard_group_size": group}, example_inputs=example)
    train(engine, data, rank)
    s = engine.stats()
    return {"diff": max_diff(engine.full_state_dict(), ref), "digests": every_rank(digest(engine.full_state_dict())),
            "plan_fits": engine.plan.fits, "offloaded_chunks": engine.plan.offloaded_chunks,
            "predicted_device_model_bytes": engine.plan.device_model_bytes,
            "device_model_bytes": s["device_model_bytes"], "shard_group_size": s["shard_group_size"]}


def gpt2_counts(rank, world, group, stage, cache, key="shard_group_size", extra=None):
    """One step of a GPT-2 whose parameters all train: the step's per-link element counts and
    model-state bytes."""
    import zeroshard
    data = batches(2, world, 1)
    cfg = {"stage": stage, key: group, "chunk_size": 20000, **(extra or {})}
    if cache is not None:
        cfg["cache_chunks"] = cache
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, cfg)
    for step in data:  # the second step: the layout is final (no re-pack traffic)
        x = step[0][rank]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    s = engine.stats()
    return {k: s[k] for k in ("comm_elements", "comm_elements_by_link", "padded_elements", "num_params",
                              "shard_group_size", "hpz_group_size", "world_size", "cache_overflows",
                              "model_state_bytes", "model_state_bytes_by_kind")}


SPLIT = {"shard_optimizer_across_replicas": True}


def resharded(rank, world, root, saved_group, load_groups, stage, saved_extra=None):
    """Train 2 steps at `saved_group` (and `saved_extra` config) and save; load the checkpoint at
    each of `load_groups` (None: full sharding; (G, extra)) and compare the full model with the
    saved one bit for bit, then train a step from both and compare again."""
    import zeroshard
    data = quirky_data(3, world)

    def make(group, extra=None):
        if isinstance(group, tuple):
            group, extra = group
        cfg = {"stage": stage, "chunk_size": 700, **(extra or {})}
        if group is not None:
            cfg["shard_group_size"] = group
        return zeroshard.initialize(Quirky(), make_adamw, cfg)

    def step(engine, k):
        engine.backward(quirky_loss(engine, data[k, 0, rank]))
        engine.step()

    src = make(saved_group, saved_extra)
    for k in range(2):
        step(src, k)
    src.save_checkpoint(root, tag="hybrid")
    saved = src.full_state_dict()
    step(src, 2)
    after = src.full_state_dict()
    out = {}
    for group in load_groups:
        dst = make(group)
        dst.load_checkpoint(root, tag="hybrid")
        loaded = dst.full_state_dict()
        step(dst, 2)
        out[str(group if not isinstance(group, tuple) else group[0]) + ("_split" if isinstance(group, tuple) else "")] = \
            {"loaded_diff": max_diff(loaded, saved), "next_step_diff": max_diff(dst.full_state_dict(),
                                                                                             after)}
    return out


def cross_root(pytest_pid: int) -> str:
    """Where the world-4 run saves the checkpoint the world-3 and world-6 runs load (one per pytest
    process: the spawned ranks' parent)."""
    return os.path.join(tempfile.gettempdir(), f"zeroshard-hybrid-cross-{pytest_pid}")


def _global_rows(world, rank, k):
    """Step k's rank share of one global batch of 12 rows (the same batch at worlds 3, 4 and 6)."""
    import torch
    data = torch.randn(3, 12, 8, generator=torch.Generator().manual_seed(11))
    per = 12 // world
    return data[k, rank * per:(rank + 1) * per]


def _cross_engine(extra):
    import zeroshard
    return zeroshard.initialize(Quirky(), make_adamw, {"stage": 3, "chunk_size": 700, **extra})


def cross_save(rank, world):
    """World 4, G = 2: two steps, a checkpoint, then the step the loaders must reproduce (its model
    saved beside the checkpoint)."""
    import torch
    root = cross_root(os.getppid())
    engine = _cross_engine({"shard_group_size": 2})
    for k in range(2):
        engine.backward(quirky_loss(engine, _global_rows(world, rank, k)))
        engine.step()
    path = engine.save_checkpoint(root, tag="g2w4")
    full = engine.full_state_dict()
    saved = digest(full)
    export = {}
    if rank == 0:  # `zeroshard export` of the hybrid checkpoint: the model as saved, bit for bit
        from safetensors.torch import load_file
        from zeroshard.state.export import export as export_checkpoint
        exported = load_file(export_checkpoint(path, os.path.join(root, "exported.safetensors")))
        export = {"keys": sorted(exported), "full_keys": sorted(full),
                  "diff": max(float((exported[k] - full[k]).abs().max()) for k in exported)}
    engine.backward(quirky_loss(engine, _global_rows(world, rank, 2)))
    engine.step()
    after = engine.full_state_dict()
    if rank == 0:
        torch.save(after, os.path.join(root, "after.pt"))
    return {"saved": saved, "export": export}


def cross_load(rank, world, extra):
    """Load the world-4 G = 2 checkpoint here: its model's digest, then the next step's distance
    from the saving run's."""
    import torch
    root = cross_root(os.getppid())
    engine = _cross_engine(extra)
    engine.load_checkpoint(root, tag="g2w4")
    loaded = digest(engine.full_state_dict())
    engine.backward(quirky_loss(engine, _global_rows(world, rank, 2)))
    engine.step()
    after = torch.load(os.path.join(root, "after.pt"), weights_only=True)
    return {"loaded": every_rank(loaded), "next_step_diff": max_diff(engine.full_state_dict(), after)}


CROSS_LOADS = {3: {"full": {}}, 6: {"g3": {"shard_group_size": 3}, "hpz2": {"hpz_group_size": 2}}}


def run_cross(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(cross_load, rank, world, extra))
                            for name, extra in CROSS_LOADS[world].items()])


CROSS_RESULTS = WorldResults(run_cross, "hybrid_cross", shared=False, worlds=(3, 6))


def run(rank, world, out_path):
    calls = []
    for group in GROUPS[world]:
        for name, (stage, opt, extra) in PARITY.items():
            calls.append((f"g{group}_{name}", functools.partial(quirky_parity, rank, world, "shard_group_size", group,
                                                                stage, opt, extra)))
        for stage, cache in ((1, None), (2, None), (3, None), (3, 2)):
            calls.append((f"g{group}_counts_stage{stage}_cache{cache}",
                          functools.partial(gpt2_counts, rank, world, group, stage, cache)))
        for name, (opt, extra) in HPZ.items():
            calls.append((f"g{group}_{name}", functools.partial(quirky_parity, rank, world, "hpz_group_size", group,
                                                                3, opt, extra)))
        for cache in (2, None):
            calls.append((f"g{group}_hpz_counts_cache{cache}", functools.partial(gpt2_counts, rank, world, group, 3,
                                                                                 cache, "hpz_group_size")))
        calls.append((f"g{group}_hpz_delayed", functools.partial(hpz_delayed_same_bytes, rank, world, group)))
        calls.append((f"g{group}_auto", functools.partial(hybrid_auto, rank, world, group)))
        for stage in (1, 2):
            calls.append((f"g{group}_split_counts_stage{stage}", functools.partial(
                gpt2_counts, rank, world, group, stage, None, extra=SPLIT)))
        for stage in (2, 3):
            calls.append((f"g{group}_delayed_stage{stage}", functools.partial(hybrid_delayed, rank, world, group,
                                                                             stage)))
    for cache in (2, None):
        calls.append((f"full_counts_stage3_cache{cache}", functools.partial(gpt2_counts, rank, world, None, 3, cache)))
    root = os.path.join(tempfile.gettempdir(), f"zeroshard-hybrid-{os.environ['MASTER_PORT']}")
    loads = {4: [None, 1], 6: [None, 3]}[world]
    for stage in (2, 3):
        calls.append((f"reshard_stage{stage}", functools.partial(resharded, rank, world, os.path.join(root, str(stage)),
                                                                  2, loads, stage)))
    calls.append(("reshard_split_stage2", functools.partial(resharded, rank, world, os.path.join(root, "split"), 2,
                                                            [None, (2, SPLIT)], 2, SPLIT)))
    if world == 4:
        calls.append(("cross_save", functools.partial(cross_save, rank, world)))
        calls.append(("g2_trainer", functools.partial(hybrid_trainer, rank, world, 2)))
        calls.append(("g2_lightning", functools.partial(hybrid_lightning, rank, world, 2)))
    record(rank, out_path, calls)


RESULTS = WorldResults(run, "hybrid", worlds=(4, 6))


def tp_hybrid(rank, world, stage, kind, layout):
    """A Llama split over TP 2 (tp_scenarios.py), ZeRO over shard groups of 2 replicated twice
    (TP 2 x shard 2 x replicate 2 at world 8), or (`layout` hpz_group_size) over the 4
    data-parallel ranks with secondary groups of 2."""
    import zeroshard
    import tp_scenarios as tp
    mesh = zeroshard.device_mesh(2)
    engine = zeroshard.initialize(tp.split_llama(mesh), tp.make_optimizer(kind),
                                  config={"stage": stage, "tensor_parallel": 2, "chunk_size": 5000,
                                          layout: 2, "collective_timeout_s": 120,
                                          **({"cache_chunks": 2} if stage == 3 else {})})
    per = tp.BATCH // mesh["dp"].size()
    dp_rank = mesh["dp"].get_local_rank()
    for x in tp.data():
        xb = x[dp_rank * per:(dp_rank + 1) * per]
        engine.backward(engine(xb, labels=xb).loss)
        engine.step()
    s = engine.stats()
    full = engine.full_state_dict()
    return {"diff": max_diff(full, tp.reference(kind)), "digests": every_rank(digest(full)),
            **{k: s[k] for k in ("comm_elements_by_link", "padded_elements", "shard_group_size", "hpz_group_size",
                                 "world_size", "tensor_parallel")}}


TP_CASES = {"tp2_stage2_sgd": (2, "sgd", "shard_group_size"), "tp2_stage3_adamw": (3, "adamw", "shard_group_size"),
            "tp2_stage3_sgd_hpz": (3, "sgd", "hpz_group_size")}


def run_tp(rank, world, out_path):
    record(rank, out_path, [(name, functools.partial(tp_hybrid, rank, world, *case)) for name, case in TP_CASES.items()])


TP_RESULTS = WorldResults(run_tp, "hybrid_tp", worlds=(8,))
