"""Hybrid sharding (config shard_group_size) and hpZ (hpz_group_size): stages 1-3, offload and
accumulation train what single-process PyTorch trains on the global batch, every rank ending with
the same bytes; the per-link counts and model-state bytes equal docs/communication.md's formulas;
checkpoints reshard between hybrid and full layouts bit for bit.

Tolerances: fp32 SGD with momentum 1e-5, fp32 AdamW 1e-4 (models.TOL)."""
import pytest

from distributed import ok
from hybrid_scenarios import (CROSS_LOADS, CROSS_RESULTS, GROUPS, HPZ, PARITY, RESULTS as HYBRID, TP_CASES, TP_RESULTS,
                              cross_root)
from models import TOL

RESULTS = HYBRID  # read by the `res` fixture (conftest.py)


@pytest.mark.parametrize("name", list(PARITY))
def test_trains_the_single_process_model(res, name):
    results, world = res
    stage, opt, _ = PARITY[name]
    for group in GROUPS[world]:
        got = ok(results, f"g{group}_{name}")
        assert got["shard_group_size"] == group
        assert got["diff"] <= TOL[opt], (group, got["diff"])
        assert len(set(got["digests"])) == 1, got["digests"]  # every rank, every group: the same bytes


@pytest.mark.parametrize("stage,cache", [(1, None), (2, None), (3, None), (3, 2)])
def test_per_link_counts_equal_the_formulas(res, stage, cache):
    """Per rank and step, Psi the padded elements: inside the shard group 2 Psi (stages 1-2: the
    reduce-scatter and the all-gather of the update; stage 3 with every chunk cached: the forward's
    gathers and the reduce-scatter), up to 3 Psi at stage 3 with a bounded rCache (the backward
    gathers again); across the groups 2 Psi/G (the all-reduce of each 1/G shard)."""
    results, world = res
    for group in GROUPS[world]:
        s = ok(results, f"g{group}_counts_stage{stage}_cache{cache}")
        psi, link = s["padded_elements"], s["comm_elements_by_link"]
        assert psi % group == 0 and s["shard_group_size"] == group and s["world_size"] == world
        assert link["across"] == 2 * psi // group, (group, link, psi)
        if cache is None:
            assert link["inside"] == 2 * psi, (group, link, psi)
        else:
            assert 2 * psi < link["inside"] <= 3 * psi, (group, link, psi)
            assert s["cache_overflows"] == 0
        assert s["comm_elements"] == link["inside"] + link["across"]
        # Model states, fp32 SGD with momentum (4-byte parameters, gradients, momentum), ZeRO's
        # Table 1 with G in place of N: stage 1 4 + 4 + 4/G, stage 2 4 + 8/G, stage 3 12/G bytes
        # per parameter.
        want = {1: 8 + 4 / group, 2: 4 + 8 / group, 3: 12 / group}[stage]
        psi_real = s["num_params"]
        assert psi_real * want <= s["model_state_bytes"] <= 1.04 * psi_real * want, (group, s["model_state_bytes"])


@pytest.mark.parametrize("name", list(HPZ))
def test_hpz_trains_the_single_process_model(res, name):
    """Parameters sharded over the whole world, secondary shards over groups of G: the same model
    as plain PyTorch; where the rCache is bounded the secondary shards were read (inside > 0)."""
    results, world = res
    opt, extra = HPZ[name]
    for group in GROUPS[world]:
        got = ok(results, f"g{group}_{name}")
        assert (got["shard_group_size"], got["hpz_group_size"]) == (world, group), got
        assert got["diff"] <= TOL[opt], (group, got["diff"])
        assert len(set(got["digests"])) == 1, got["digests"]
        if "cache_chunks" in extra:
            assert got["comm_elements_by_link"]["inside"] > 0, (group, got["comm_elements_by_link"])


def test_hpz_counts_and_bytes_equal_the_formulas(res):
    """hpZ per rank and step (Psi the padded elements, a 2-chunk rCache): across the groups 2 Psi
    exactly (each chunk's first gather, from the primary shards, and the reduce-scatter); every
    other gather reads the secondary shards inside the group, so inside + across is full
    sharding's total with the same rCache. Model states (fp32 SGD with momentum): full sharding's
    12/W bytes per parameter plus the secondary shards' 4/G."""
    results, world = res
    full = ok(results, "full_counts_stage3_cache2")
    for group in GROUPS[world]:
        s = ok(results, f"g{group}_hpz_counts_cache2")
        psi, link = s["padded_elements"], s["comm_elements_by_link"]
        assert (s["shard_group_size"], s["hpz_group_size"], s["cache_overflows"]) == (world, group, 0)
        assert link["across"] == 2 * psi, (group, link, psi)
        assert 0 < link["inside"] <= psi and link["inside"] + link["across"] == full["comm_elements"], (group, link)
        by_kind = s["model_state_bytes_by_kind"]
        assert by_kind["secondary"] == 4 * psi // group, (group, by_kind)
        assert by_kind["params"] + by_kind["grads"] + by_kind["optimizer"] == full["model_state_bytes"], by_kind
        psi_real = s["num_params"]
        want = 12 / world + 4 / group
        assert psi_real * want <= s["model_state_bytes"] <= 1.04 * psi_real * want, (group, s["model_state_bytes"])


def test_the_planners_link_model_counts_what_the_runtime_moves(res):
    """planning/links.py's volumes (every chunk cached, one micro-batch) against the counts of the
    same stage-3 step: full sharding over W, HSDP inside G and across its replicas, hpZ."""
    from zeroshard.planning.links import volumes
    results, world = res
    full = ok(results, "full_counts_stage3_cacheNone")
    assert volumes("full sharding", full["padded_elements"], world, world, 1, regather=False)["W"] == \
        full["comm_elements"]
    for group in GROUPS[world]:  # Psi: each run's padded elements (chunks pad to their shard count)
        s = ok(results, f"g{group}_counts_stage3_cacheNone")
        hsdp, want = s["comm_elements_by_link"], volumes("HSDP (node)", s["padded_elements"], world, group, 1, False)
        assert (hsdp["inside"], hsdp["across"]) == (want["G"], want["replicas"]), (group, hsdp, want)
        s = ok(results, f"g{group}_hpz_counts_cacheNone")
        hpz, want = s["comm_elements_by_link"], volumes("hpZ (node)", s["padded_elements"], world, group, 1, False)
        assert (hpz["inside"], hpz["across"]) == (want["G"], want["W"]), (group, hpz, want)


def test_offload_auto_plans_for_the_shard_group(res):
    """offload/stage 'auto' with shard_group_size: the plan made for a G-rank world fits a cap that
    ZeRO-3 of that world does not (some chunks offloaded), the device holds the model states and
    rCache predicted (within 10%, as test_auto checks; a plan for W ranks would be off by W/G), and
    training equals single-process AdamW (models.TOL)."""
    results, world = res
    for group in GROUPS[world]:
        got = ok(results, f"g{group}_auto")
        assert got["shard_group_size"] == group and got["plan_fits"] and got["offloaded_chunks"] > 0, got
        pred, seen = got["predicted_device_model_bytes"], got["device_model_bytes"]
        assert abs(pred - seen) <= 0.10 * seen, (group, pred, seen)
        assert got["diff"] <= TOL["adamw"], (group, got["diff"])
        assert len(set(got["digests"])) == 1, got["digests"]


@pytest.mark.parametrize("stage", [2, 3])
def test_the_delayed_update_with_shard_groups_trains_what_full_sharding_does(res, stage):
    """The delayed update's background step gets gradients summed across the groups (in the main
    thread, at the step): after 4 steps (3 delayed) the model is full sharding's, within AdamW's
    tolerance (the sums run in another order), every rank the same bytes."""
    results, world = res
    for group in GROUPS[world]:
        got = ok(results, f"g{group}_delayed_stage{stage}")
        assert got["diff"] <= TOL["adamw"], (group, got["diff"])
        assert len(set(got["digests"])) == 1 and got["steps"] >= 3, got


def test_hpz_with_the_delayed_update_trains_the_same_bytes(res):
    """The delayed update lands in the primary shards after the step's flush: with and without
    hpZ, the same bytes on every rank."""
    results, world = res
    for group in GROUPS[world]:
        digests = ok(results, f"g{group}_hpz_delayed")["digests"]
        assert all(d == digests[0] for d in digests) and digests[0][0] == digests[0][1], digests


@pytest.mark.parametrize("stage", [1, 2])
def test_the_optimizer_split_across_replicas_keeps_1_over_w(res, stage):
    """shard_optimizer_across_replicas: the same traffic as hybrid sharding (inside 2 Psi, across
    2 Psi/G: a reduce-scatter and an all-gather of each 1/G shard instead of its all-reduce), and
    the optimizer's bytes over all W ranks: fp32 SGD with momentum, 4 + 4 + 4/W bytes per
    parameter at stage 1, 4 + 4/G + 4/W at stage 2 (the momentum, the master being the shard)."""
    results, world = res
    for group in GROUPS[world]:
        s = ok(results, f"g{group}_split_counts_stage{stage}")
        psi, link = s["padded_elements"], s["comm_elements_by_link"]
        assert link == {"inside": 2 * psi, "across": 2 * psi // group}, (group, link, psi)
        assert s["model_state_bytes_by_kind"]["optimizer"] == 4 * psi // world, (group, s["model_state_bytes_by_kind"])
        want = {1: 8 + 4 / world, 2: 4 + 4 / group + 4 / world}[stage]
        assert s["model_state_bytes"] == pytest.approx(psi * want, rel=1e-12), (group, s["model_state_bytes"], psi * want)


def test_full_sharding_counts_everything_inside(res):
    results, world = res
    s = ok(results, "full_counts_stage3_cache2")
    assert s["shard_group_size"] == world and s["comm_elements_by_link"]["across"] == 0
    assert 2 * s["padded_elements"] < s["comm_elements"] <= 3 * s["padded_elements"]


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_reshard_between_hybrid_and_full(res, stage):
    """Saved at G=2; loaded at full sharding and at another group size: the same model bit for
    bit, and the next step lands where the saving engine's own next step did (AdamW, models.TOL)."""
    results, world = res
    got = ok(results, f"reshard_stage{stage}")
    assert len(got) == 2
    for group, r in got.items():
        assert r["loaded_diff"] == 0.0, (group, r)
        assert r["next_step_diff"] <= TOL["adamw"], (group, r)


def test_a_hybrid_checkpoint_exports_the_saved_model(tmp_path_factory):
    """`zeroshard export` of a checkpoint saved with G = 2 at world 4: every tensor of the model
    as the engine held it at the save, bit for bit."""
    got = ok(HYBRID.get(4, tmp_path_factory), "cross_save")["export"]
    assert got["diff"] == 0.0 and got["keys"] == got["full_keys"], got


def test_the_trainer_with_shard_groups_trains_what_full_sharding_trains(tmp_path_factory):
    """The Hugging Face Trainer with shard_group_size=2 at world 4 (stage 3): the plain zeroshard
    loop's model with full sharding, within AdamW's tolerance; save_model opened by from_pretrained
    holds it bit for bit."""
    got = ok(HYBRID.get(4, tmp_path_factory), "g2_trainer")
    assert got["shard_group_size"] == 2 and len(set(got["digests"])) == 1, got
    assert got["state_vs_plain"] <= TOL["adamw"], got["state_vs_plain"]
    assert got["save_model_max_diff"] == 0.0, got


def test_lightning_with_shard_groups_trains_what_full_sharding_trains(tmp_path_factory):
    """Lightning's ZeroShardStrategy(shard_group_size=2) at world 4, stage 3, 10 optimizer steps:
    the plain zeroshard loop's model with full sharding, within AdamW's tolerance."""
    got = ok(HYBRID.get(4, tmp_path_factory), "g2_lightning")
    assert got["shard_group_size"] == 2 and got["steps"] == 10 and len(set(got["digests"])) == 1, got
    assert got["state_vs_plain"] <= TOL["adamw"], got["state_vs_plain"]


def test_checkpoints_move_across_world_sizes_and_layouts(tmp_path_factory):
    """Saved at world 4 with G = 2 (stage 3, AdamW); loaded at world 3 with full sharding, and at
    world 6 with G = 3 and with hpZ over groups of 2: the saved model bit for bit on every rank,
    and the next step on the same global batch within AdamW's tolerance of the saving run's."""
    import os
    import shutil
    try:
        saved = ok(HYBRID.get(4, tmp_path_factory), "cross_save")["saved"]
        for world, loads in CROSS_LOADS.items():
            results = CROSS_RESULTS.get(world, tmp_path_factory)
            for name in loads:
                got = ok(results, name)
                assert set(got["loaded"]) == {saved}, (world, name, got["loaded"], saved)
                assert got["next_step_diff"] <= TOL["adamw"], (world, name, got["next_step_diff"])
    finally:
        shutil.rmtree(cross_root(os.getpid()), ignore_errors=True)


def test_a_checkpoint_of_the_split_optimizer_reshards(res):
    """Saved with G = 2 and the optimizer split across the replicas (every rank writes its part):
    loaded at full sharding and split again, the same model bit for bit, the next step within
    AdamW's tolerance."""
    results, world = res
    got = ok(results, "reshard_split_stage2")
    assert sorted(got) == ["2_split", "None"], got
    for name, r in got.items():
        assert r["loaded_diff"] == 0.0 and r["next_step_diff"] <= TOL["adamw"], (name, r)


@pytest.fixture(scope="module")
def tp_res(tmp_path_factory):
    return TP_RESULTS.get(8, tmp_path_factory)


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_x_shard_x_replicate(tp_res, name):
    """World 8 as TP 2 x shard 2 x replicate 2: the single-process model (all ranks the same full
    model), and the per-link counts of the data-parallel side, for each rank's 1/TP of the model:
    2 Psi inside, 2 Psi/G across (stage 3 with a 2-chunk rCache: up to 3 Psi inside). With hpZ
    over the 4 data-parallel ranks: 2 Psi across, the re-gathers inside."""
    stage, kind, layout = TP_CASES[name]
    got = ok(tp_res, name)
    assert got["diff"] <= TOL[kind], got["diff"]
    assert len(set(got["digests"])) == 1, got["digests"]
    assert (got["world_size"], got["tensor_parallel"]) == (4, 2)
    psi, link = got["padded_elements"], got["comm_elements_by_link"]
    if layout == "hpz_group_size":
        assert (got["shard_group_size"], got["hpz_group_size"]) == (4, 2)
        assert link["across"] == 2 * psi and 0 < link["inside"] <= psi, (link, psi)
    else:
        assert got["shard_group_size"] == 2 and link["across"] == psi, (link, psi)
        assert link["inside"] == 2 * psi if stage == 2 else 2 * psi < link["inside"] <= 3 * psi, (link, psi)
