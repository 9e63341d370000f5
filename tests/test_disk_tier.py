"""The disk tier (issue 33, config offload_optimizer='disk', runtime/disk_tier.py).

Equality: a disk-tier run equals the same run with offload_optimizer=True bit for bit, at stages
1-3, fp32/bf16/fp16, with accumulation, clipping, the delayed update and a skipped non-finite step:
the host step performs the same operations on the same values, which only come from and go to
files between steps. Checkpoints of a disk-tier run load into host-tier and device-only runs and
back, exactly. Failures raise TierFileError on every rank (the failing rank's, and one naming it).
"""
import os
import subprocess
import sys
import textwrap

import pytest

from disk_scenarios import CASES, DISK

RESULTS = DISK  # read by the `res` fixture (conftest.py)
from distributed import free_port, ok
from models import ADAMW_TOL


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_disk_tier_trains_what_the_host_tier_trains(res, case, stage):  # noqa: F811
    r, world = res
    got = ok(r, f"disk_{case}_stage{stage}")
    assert got["diff"] == 0.0, got["diff"]
    assert len(set(got["digests"])) == 1  # every rank holds the same model
    moved = got["disk_tier"]  # the last step really read and wrote the records
    assert moved["read_bytes"] > 0 and moved["written_bytes"] == moved["read_bytes"], moved
    by = got["by_device"]
    # The host keeps no master and no optimizer state of its own: what the host tier keeps there
    # (12 bytes per owned element with Adam, 8 with SGD) is on disk instead (records span the
    # owned range, padding included: up to a few percent more).
    moved_out = got["host_bytes"]["host"] - by["host"]
    assert moved_out > 0 and moved_out <= by["disk"] <= 1.05 * moved_out, (by, got["host_bytes"])
    assert {f.split(".")[-2] for f in got["files"] if f.endswith(".tier")} >= {"master"}
    if "vs_ref" in got:
        assert got["vs_ref"] <= (1e-5 if "sgd" in case else ADAMW_TOL)


def test_disk_tier_under_the_delayed_update(res):  # noqa: F811
    r, _ = res
    assert ok(r, "disk_delayed_update")["diff"] == 0.0


def test_a_skipped_nonfinite_step_is_skipped_alike(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_nonfinite_skip")
    assert got["skipped"] == [1, 1] and got["diff"] == 0.0, got


def test_a_repack_and_a_thaw_move_masters_through_the_tier(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_repacked_and_thawed")
    assert got["repack_first_packed"] == "a.weight"  # it did re-pack, in order of first use
    assert got["repack"] == 0.0 and got["thaw"] == 0.0, got


def test_offload_auto_uses_the_disk_only_past_host_memory(res):  # noqa: F811
    """The planner's side is tests/test_planner.py (no disk while host memory holds everything)."""
    r, _ = res
    got = ok(r, "disk_auto_plan")
    assert got["fits"] and 0 < got["disk_chunks"] <= got["offloaded_chunks"], got["plan"]
    assert got["diff"] <= ADAMW_TOL, got["diff"]  # fp32 AdamW against single-process PyTorch
    assert got["by_device"]["disk"] == got["predicted_disk"], (got["by_device"], got["predicted_disk"])


def test_load_state_dict_midway_writes_the_masters_alone(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_load_state_dict_midway")
    assert got["diff"] == 0.0, got
    assert got["read_by_state_dict"] == got["masters"], got  # no optimizer state read for a state dict


def test_checkpoints_go_between_the_disk_the_host_and_the_device(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_checkpoint_round_trips")
    # optimizer.state_dict() cannot hold the tier's states: it says so rather than hand out meta tensors
    assert got.pop("optimizer_state_dict").startswith("CheckpointError: zeroshard: the optimizer's states are in "
                                                      "the disk tier")
    assert got.pop("optimizer_load_state_dict").startswith("CheckpointError: zeroshard: the optimizer's states are "
                                                           "in the disk tier (offload_optimizer='disk'): load them")
    assert got.pop("full_optimizer_state_dict").startswith("CheckpointError: zeroshard: the optimizer's states are "
                                                           "in the disk tier (offload_optimizer='disk'): save them")
    assert got == {"disk": 0.0, "host": 0.0, "device": 0.0, "host_to_disk": 0.0, "reload": 0.0}, got


@pytest.mark.parametrize("fault, needle", [("truncated", "short read|truncated"), ("removed", "removed"),
                                           ("changed", "checksum"), ("full", "disk is full")])
def test_a_broken_tier_raises_on_every_rank(res, fault, needle):  # noqa: F811
    r, world = res
    got = ok(r, f"disk_fault_{fault}")
    raised = got["raised"]
    assert all(e.startswith("TierFileError") for e in raised), raised
    import re
    assert re.search(needle, raised[-1]), raised[-1]  # the rank whose file was harmed says what happened
    assert all(f"rank {world - 1}" in e for e in raised[:-1]), raised  # the others name it
    # the states are not used again: every later read raises too
    assert all(e.startswith("TierFileError") and "earlier step" in e for e in got["again"]), got["again"]
    assert got["checkpoint_intact"] == 0.0  # the last checkpoint loads as it was saved


def test_an_optimizer_raising_in_the_tier_loop_raises_on_every_rank(res):  # noqa: F811
    r, world = res
    got = ok(r, "disk_fault_optimizer_raises")
    raised = got["raised"]
    assert raised[-1] == "RuntimeError: the optimizer broke", raised
    if world > 1:
        assert all(e.startswith("TierFileError") and f"rank {world - 1}" in e and "the optimizer broke" in e
                   for e in raised[:-1]), raised
    assert all(e.startswith("TierFileError") and "earlier step" in e for e in got["again"]), got["again"]
    assert got["checkpoint_intact"] == 0.0


def test_a_save_to_a_full_disk_leaves_the_tier_and_the_last_checkpoint_intact(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_full_during_save")
    assert all(e.startswith("CheckpointError") for e in got["raised"]), got["raised"]
    assert got["after"] == 0.0 and got["checkpoint_intact"] == 0.0, got


def test_an_unusable_offload_dir_is_named_on_every_rank(res):  # noqa: F811
    r, world = res
    raised = ok(r, "disk_unusable_directory")["raised"]
    assert all(e.startswith("TierFileError") for e in raised), raised
    assert "offload_dir" in raised[-1] and all(f"rank {world - 1}" in e for e in raised[:-1]), raised


def test_the_tier_files_go_with_the_engine(res):  # noqa: F811
    r, _ = res
    got = ok(r, "disk_files_removed_with_the_engine")
    assert any(f.endswith(".tier") for f in got["during"]) and got["after"] == [], got


def test_files_are_removed_at_exit_and_a_killed_runs_are_reclaimed(tmp_path):
    """A normal exit removes the tier's files; a run killed with SIGKILL leaves them, and the next
    engine using the directory reclaims them, saying so."""
    # A plain MLP in 4 chunks, not GPT-2: each of the three interpreters would import transformers
    # (5 s of CPU) for files that do not depend on the model.
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import torch
        import zeroshard
        from models import make_adamw
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
        e = zeroshard.initialize(m, make_adamw, {{"stage": 2, "chunk_size": 1000,
                                 "offload_optimizer": "disk", "offload_dir": {str(tmp_path)!r}}})
        e.backward(e(torch.randn(4, 32)).pow(2).mean())
        e.step()
        print(len([f for f in os.listdir({str(tmp_path)!r}) if f.endswith(".tier")]), flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.pop("LOCAL_RANK", None)
    done = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) >= 3, done.stderr[-2000:]
    assert os.listdir(tmp_path) == []
    killed = subprocess.run([sys.executable, "-c", script, "kill"], capture_output=True, text=True, env=env)
    assert killed.returncode == -9
    left = sorted(os.listdir(tmp_path))
    assert any(f.endswith(".tier") for f in left) and any(f.endswith(".lease") for f in left), left
    again = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr.count("reclaiming the disk tier file") == len([f for f in left if f.endswith(".tier")])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("cfg, needle", [
    ({"stage": 2, "offload_optimizer": "disk"}, "needs offload_dir"),
    ({"stage": 2, "offload_optimizer": True, "offload_dir": "/x"}, "needs offload_optimizer='disk'"),
    ({"stage": 2, "offload_optimizer": "nvme", "offload_dir": "/x"}, "offload_optimizer"),
])
def test_disk_tier_config_errors(cfg, needle):
    import zeroshard
    with pytest.raises(ValueError, match=needle):
        zeroshard.Config(**cfg)


def _cross_world(rank, world, out_path):
    """World 2 saves a disk-tier checkpoint after 2 of 4 steps and trains on; world 1 (a disk-tier
    run at stage 3) loads it, trains the last 2 steps on the whole batch, and must match."""
    import json
    import tempfile

    import torch.distributed as dist

    import zeroshard
    from models import batches, make_adamw, max_diff, tiny_gpt2
    root = os.environ.get("DISK_CROSS_ROOT")
    data = batches(4, 2, 1)
    cfg = {"chunk_size": 20000, "offload_optimizer": "disk", "offload_dir": tempfile.mkdtemp(prefix="zeroshard-tier-")}
    out = {}
    if world == 2:
        e = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "stage": 2})
        for k in range(4):
            e.backward(e(input_ids=data[k, 0, rank], labels=data[k, 0, rank]).loss)
            e.step()
            if k == 1:
                e.save_checkpoint(root, tag="mid")
                mid = e.full_state_dict()
                if rank == 0:
                    import torch
                    torch.save(mid, os.path.join(root, "mid.pt"))
        sd = e.full_state_dict()
        if rank == 0:
            import torch
            torch.save(sd, os.path.join(root, "want.pt"))
    else:
        import torch
        e = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "stage": 3})
        e.load_checkpoint(root, tag="mid")
        for k in range(2, 4):  # the global batch of world 2, as one micro-batch of two halves
            for half in range(2):
                e.backward(e(input_ids=data[k, 0, half], labels=data[k, 0, half]).loss / 2)
            e.step()
        out["diff"] = max_diff(torch.load(os.path.join(root, "want.pt")), e.full_state_dict())
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def test_a_disk_tier_checkpoint_reshards_and_exports(tmp_path):
    """Saved at world 2 (stage 2), loaded at world 1 (stage 3), both with the disk tier: training
    goes on as the world-2 run did (two half-batch backwards at world 1 sum to the world-2 mean:
    fp32 AdamW within ADAMW_TOL); `zeroshard export` of it gives the saved masters."""
    import json

    import torch
    from safetensors.torch import load_file

    import zeroshard.cli
    from distributed import spawn
    os.environ["DISK_CROSS_ROOT"] = str(tmp_path)
    try:
        spawn(2, _cross_world, str(tmp_path / "w2.json"))
        spawn(1, _cross_world, str(tmp_path / "w1.json"))
    finally:
        del os.environ["DISK_CROSS_ROOT"]
    got = json.loads((tmp_path / "w1.json").read_text())
    assert got["diff"] <= ADAMW_TOL, got
    assert zeroshard.cli.main(["export", str(tmp_path / "mid"), str(tmp_path / "out")]) == 0
    exported = load_file(next(str(p) for p in (tmp_path / "out").iterdir() if p.suffix == ".safetensors"))
    mid = torch.load(tmp_path / "mid.pt")
    assert len(exported) >= 10 and set(exported) <= set(mid)
    assert all(torch.equal(v, mid[k]) for k, v in exported.items())  # the masters as they were saved
