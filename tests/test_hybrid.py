"""Hybrid sharding (config shard_group_size): stages 1-3, offload and accumulation train what
single-process PyTorch trains on the global batch, every rank ending with the same bytes; the
per-link counts equal docs/communication.md's formulas; checkpoints reshard between hybrid and
full layouts bit for bit.

Tolerances: fp32 SGD with momentum 1e-5, fp32 AdamW 3e-5 (models.TOL)."""
import pytest

from distributed import ok
from hybrid_scenarios import GROUPS, PARITY, RESULTS as HYBRID, TP_CASES, TP_RESULTS
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


def test_full_sharding_counts_everything_inside(res):
    results, world = res
    s = ok(results, "full_counts_stage3_cache2")
    assert s["shard_group_size"] == world and s["comm_elements_by_link"]["across"] == 0
    assert 2 * s["padded_elements"] < s["comm_elements"] <= 3 * s["padded_elements"]


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoints_reshard_between_hybrid_and_full(res, stage):
    """Saved at G=2; loaded at full sharding and at another group size: the same model bit for
    bit, and the next step lands where the saving engine's own next step did (AdamW, 3e-5)."""
    results, world = res
    got = ok(results, f"reshard_stage{stage}")
    assert len(got) == 2
    for group, r in got.items():
        assert r["loaded_diff"] == 0.0, (group, r)
        assert r["next_step_diff"] <= TOL["adamw"], (group, r)


@pytest.fixture(scope="module")
def tp_res(tmp_path_factory):
    return TP_RESULTS.get(8, tmp_path_factory)


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tensor_parallel_x_shard_x_replicate(tp_res, name):
    """World 8 as TP 2 x shard 2 x replicate 2: the single-process model (all ranks the same full
    model), and the per-link counts of the data-parallel side: 2 Psi inside, 2 Psi/G across, for
    each rank's 1/TP of the model."""
    stage, kind = TP_CASES[name]
    got = ok(tp_res, name)
    assert got["diff"] <= TOL[kind], got["diff"]
    assert len(set(got["digests"])) == 1, got["digests"]
    assert (got["world_size"], got["tensor_parallel"], got["shard_group_size"]) == (4, 2, 2)
    psi, link = got["padded_elements"], got["comm_elements_by_link"]
    assert link == {"inside": 2 * psi, "across": psi}, (link, psi)
