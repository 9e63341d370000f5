"""Checkpoint tags are immutable once committed (issue 16): a save to an existing tag writes a new
version and switches to it atomically, so a load racing the save reads one save whole, client
state included, never a mix of two; `keep` retains the newest checkpoints.

The race: one process re-saves tag "same" in a loop, every parameter and the client state holding
the save's number; another loads it at least 200 times meanwhile. A load either equals exactly one
save or raises CheckpointError (the version it was reading was removed, two saves later).
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.multiprocessing as mp

import zeroshard


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _writer(root: str, stop: str, out: str) -> None:
    torch.set_num_threads(1)
    engine = zeroshard.initialize(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 0})
    i = 0
    while not os.path.exists(stop) and i < 5000:
        i += 1
        engine.module.load_state_dict({k: torch.full_like(v, float(i)) for k, v in engine.module.state_dict().items()})
        engine.save_checkpoint(root, tag="same", client_state={"i": i})
    with open(out, "w") as f:
        json.dump({"saves": i}, f)


def _reader(root: str, stop: str, out: str) -> None:
    torch.set_num_threads(1)
    engine = zeroshard.initialize(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 0})
    loads = mixed = failed = 0
    seen = set()
    deadline = time.time() + 240
    while loads < 200 and time.time() < deadline:
        try:
            client = engine.load_checkpoint(root, tag="same")
        except zeroshard.CheckpointError:
            failed += 1
            continue
        values = {float(v.flatten()[0]) for v in engine.full_state_dict().values()} | \
            {float(x) for v in engine.full_state_dict().values() for x in (v.min(), v.max())}
        loads += 1
        seen.add(client["i"])
        if values != {float(client["i"])}:
            mixed += 1
    open(stop, "w").close()
    with open(out, "w") as f:
        json.dump({"loads": loads, "mixed": mixed, "failed": failed, "distinct": len(seen)}, f)


def test_loads_racing_saves_of_the_same_tag_never_mix(tmp_path):
    root, stop = str(tmp_path / "ckpts"), str(tmp_path / "stop")
    first = zeroshard.initialize(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 0})
    first.module.load_state_dict({k: torch.zeros_like(v) for k, v in first.module.state_dict().items()})
    first.save_checkpoint(root, tag="same", client_state={"i": 0})
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(root, stop, str(tmp_path / "w.json"))),
             ctx.Process(target=_reader, args=(root, stop, str(tmp_path / "r.json")))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    r, w = json.loads((tmp_path / "r.json").read_text()), json.loads((tmp_path / "w.json").read_text())
    assert r["loads"] >= 200 and r["mixed"] == 0, (r, w)
    assert r["distinct"] > 10 and w["saves"] > 20, (r, w)  # the loads did race the saves
    versions = [n for n in os.listdir(root) if n.startswith("same.v-")]
    assert 1 <= len(versions) <= 2, versions  # the current version and the one before it


def test_keep_retains_the_newest_checkpoints(tmp_path):
    engine = zeroshard.initialize(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 0})
    for i in range(5):
        engine.save_checkpoint(tmp_path, tag=f"t{i}", keep=2)
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if ".v-" not in n] == ["latest", "t3", "t4"], names
    assert len([n for n in names if ".v-" in n]) == 2
    assert engine.load_checkpoint(tmp_path) == {}
