"""The parameter tier (issue 33, config offload_params='disk', stage 3): the 16-bit parameter
shards live in the disk tier's files, read at each gather and written by each step.

Equality: bit for bit what offload_params=True (with offload_optimizer=True) trains, fp32/bf16/fp16,
with accumulation and clipping, frozen chunks, a re-pack and a thaw: the same values move, only
through files between uses. Checkpoints go to host-tier and device-only runs and back, exactly.
A harmed shard file raises TierFileError on every rank at the gather that reads it (the ranks
exchange read failures beside the gather, so none waits in it).
"""
import re

import pytest

from disk_scenarios import CASES
from param_tier_scenarios import PARAM_DISK

RESULTS = PARAM_DISK  # read by the `res` fixture (conftest.py)
from distributed import ok


@pytest.mark.parametrize("case", list(CASES) + ["bf16_cpuadamw_cache1"])
def test_the_parameter_tier_trains_what_offloaded_parameters_train(res, case):  # noqa: F811
    r, _ = res
    got = ok(r, f"pdisk_{case}")
    assert got["diff"] == 0.0, got["diff"]
    assert len(set(got["digests"])) == 1  # every rank holds the same model
    moved = got["param_tier"]  # the last step read every shard and wrote every one back
    assert moved["written_bytes"] == got["shard_bytes"], (moved, got["shard_bytes"])
    assert moved["read_bytes"] >= got["shard_bytes"], moved
    assert set(got["shards"]) == {0}, got["shards"]  # no shard is host memory between uses
    # the params' bytes moved from the host to the disk (the records: the shards, padding included)
    assert got["by_kind"]["params"] == got["shard_bytes"] == got["host_by_kind"]["params"], got


def test_the_estimate_is_what_the_parameter_tier_holds(res):  # noqa: F811
    """`zeroshard estimate`'s "disk+params-on-disk" row: nothing on the device, the gradient shard on
    the host, master, moments and the 16-bit shard on disk (bf16 Adam: 2 / N and 14 / N bytes per
    parameter), within the chunks' padding."""
    from zeroshard.planning.estimate import PARAMS_ON_DISK, estimate
    r, world = res
    got = ok(r, "pdisk_bf16_cpuadamw")
    e = estimate(got["num_params"], 3, world, offload=PARAMS_ON_DISK)
    by = got["by_device"]
    assert abs(e.device) < 1e-6 and by["device"] == 0, (e, by)
    for want, have in ((e.host, by["host"]), (e.disk, by["disk"])):
        assert want <= have <= 1.04 * want + 4096, (e, by)


def test_masters_and_shards_go_to_disk_as_each_chunk_is_built(res):  # noqa: F811
    r, _ = res
    got = ok(r, "pdisk_packed_a_chunk_at_a_time")
    for name in ("stage2", "stage3"):
        assert got[name]["chunks"] >= 4 and got[name]["host_masters"] == 0 == got[name]["host_shards"], got


def test_frozen_chunks_a_repack_and_a_thaw_with_the_shards_on_disk(res):  # noqa: F811
    r, _ = res
    got = ok(r, "pdisk_frozen_repacked_thawed")
    assert got["repack_first_packed"] == "a.weight"  # it did re-pack, in order of first use
    assert got["repack"] == 0.0 and got["frozen"] == 0.0 and got["thaw"] == 0.0, got


def test_parameter_tier_checkpoints_go_to_the_host_and_the_device_and_back(res):  # noqa: F811
    r, _ = res
    got = ok(r, "pdisk_checkpoint_round_trips")
    assert got.pop("frozen_chunks") >= 1
    assert got == {"disk": 0.0, "host": 0.0, "device": 0.0, "host_to_disk": 0.0}, got


def test_load_state_dict_and_generate_with_the_shards_on_disk(res):  # noqa: F811
    r, _ = res
    got = ok(r, "pdisk_load_state_dict_midway")
    assert got["diff"] == 0.0 and got["same_generated"] and len(got["generated"][0]) == 8, got


@pytest.mark.parametrize("fault, needle", [("truncated", "short read|truncated"), ("removed", "removed"),
                                           ("full", "disk is full")])
def test_a_harmed_shard_file_raises_on_every_rank(res, fault, needle):  # noqa: F811
    r, world = res
    got = ok(r, f"pdisk_fault_{fault}")
    raised = got["raised"]
    assert all(e.startswith("TierFileError") for e in raised), raised
    assert re.search(needle, raised[-1]), raised[-1]  # the rank whose file was harmed says what happened
    assert all(f"rank {world - 1}" in e for e in raised[:-1]), raised  # the others name it
    # a later forward raises on every rank again (no rank gathers what the tier lost)
    assert all(e.startswith("TierFileError") for e in got["again"]), got["again"]
    assert got["checkpoint_intact"] == 0.0  # the last checkpoint loads as it was saved


def test_the_shard_files_go_with_the_engine(res):  # noqa: F811
    r, _ = res
    got = ok(r, "pdisk_files_removed_with_the_engine")
    assert any(f.endswith(".shard.tier") for f in got["during"]) and got["after"] == [], got


@pytest.mark.parametrize("cfg, needle", [
    ({"stage": 3, "offload_params": "disk", "offload_optimizer": True}, "needs offload_optimizer='disk'"),
    ({"stage": 2, "offload_params": "disk", "offload_optimizer": "disk", "offload_dir": "/x"}, "needs stage 3"),
    ({"stage": 3, "offload_params": "disk", "offload_optimizer": "disk", "offload_dir": "/x", "hpz_group_size": 2},
     "hpz_group_size"),
    ({"stage": 3, "offload_params": "disk", "offload_optimizer": "disk", "offload_dir": "/x", "shard_group_size": 2},
     "shard_group_size"),
    ({"stage": 3, "offload_params": "disk", "offload_optimizer": "disk", "offload_dir": "/x", "tensor_parallel": 2},
     "tensor_parallel"),
    ({"stage": 3, "offload_params": "nvme", "offload_optimizer": "disk", "offload_dir": "/x"}, "offload_params"),
    ({"stage": 3, "offload_params": 1, "offload_optimizer": "disk", "offload_dir": "/x"}, "offload_params"),
])
def test_parameter_tier_config_errors(cfg, needle):
    import zeroshard
    with pytest.raises(ValueError, match=needle):
        zeroshard.Config(**cfg)
