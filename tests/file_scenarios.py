"""Multi-process halves of tests/test_files.py (issue 30): every weight file is checked before its
values are used, and what it does wrong is a WeightsError on every rank.

`run(rank, world, out_path)` runs them all in one process group (rank 0 writes {name: figures}).
"""
from __future__ import annotations

import json
import os
import shutil

import torch

import zeroshard
from distributed import error_on_every_rank, every_rank, shared_temp_dir
from models import make_sgd, max_diff, tiny_gpt2
from scenarios import run_all

SCENARIOS = {}
_ROOT = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def place(name: str) -> str:
    if "dir" not in _ROOT:
        import torch.distributed as dist
        if not dist.is_initialized():  # every_rank needs the group the first initialize would make
            import datetime
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        _ROOT["dir"] = shared_temp_dir()
    return os.path.join(_ROOT["dir"], name)


def on_rank0(make) -> None:
    """`make()` on rank 0, every rank waiting until it is done."""
    if int(os.environ["RANK"]) == 0:
        make()
    every_rank(None)


def sharded(name: str) -> str:
    """A tiny GPT-2 saved as a sharded folder (index + several files); returns the folder."""
    path = place(name)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 2})
    engine.save_pretrained(path, max_shard_size="100kB")
    return path


def rewrite_index(path: str, change) -> None:
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        got = json.load(f)
    change(got)
    with open(index, "w") as f:
        json.dump(got, f)


@scenario
def index_paths(rank, world):
    """Issue 30, point 2: an index naming a file outside its folder was read and loaded. Refused
    now, naming it: '../other/...', an absolute path, a directory symlinked out of the folder, a
    file symlinked out of it; a folder whose files are symlinks into the blob store of the cache
    repository it is a snapshot of (the Hugging Face cache's layout) loads."""
    good = sharded("good")
    first = sorted(n for n in os.listdir(good) if n.startswith("model-"))[0]
    out = {}

    def outside(kind):
        bad = place(f"bad_{kind}")

        def make():
            shutil.copytree(good, bad)
            other = place(f"other_{kind}")
            os.makedirs(other)
            shutil.copy(os.path.join(good, first), other)
            if kind == "symlinked_dir":
                os.symlink(other, os.path.join(bad, "sub"))
            if kind == "symlinked_file":
                os.remove(os.path.join(bad, first))
                os.symlink(os.path.join(other, first), os.path.join(bad, first))
            name = {"dotdot": f"../other_{kind}/{first}", "absolute": os.path.join(other, first),
                    "symlinked_dir": f"sub/{first}", "symlinked_file": first}[kind]
            rewrite_index(bad, lambda index: index["weight_map"].update(
                {k: name for k, v in index["weight_map"].items() if v == first}))
        on_rank0(make)
        return error_on_every_rank(
            lambda: zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 2}, weights=bad))
    for kind in ("dotdot", "absolute", "symlinked_dir", "symlinked_file"):
        out[kind] = outside(kind)

    cache = place("cache")

    def make_cache():  # snapshots/<rev>/<file> -> ../../blobs/<name>, as huggingface_hub stores them
        os.makedirs(os.path.join(cache, "blobs"))
        snapshot = os.path.join(cache, "snapshots", "rev")
        os.makedirs(snapshot)
        for n in os.listdir(good):
            shutil.copy(os.path.join(good, n), os.path.join(cache, "blobs", "blob-" + n))
            os.symlink(os.path.join("..", "..", "blobs", "blob-" + n), os.path.join(snapshot, n))
    on_rank0(make_cache)
    loaded = zeroshard.initialize(tiny_gpt2(seed=3), make_sgd, {"stage": 3},
                                  weights=os.path.join(cache, "snapshots", "rev")).full_state_dict()
    out["cache_diff"] = max_diff(loaded, tiny_gpt2().state_dict())

    listed = place("listed")
    on_rank0(lambda: (shutil.copytree(good, listed),
                      rewrite_index(listed, lambda index: index.update(weight_map=list(index["weight_map"])))))
    out["weight_map_list"] = error_on_every_rank(
        lambda: zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 2}, weights=listed))
    return out


def single_file(name: str, change) -> str:
    """The tiny GPT-2's weights as one file, `change(state_dict)` applied; returns the folder."""
    path = place(name)

    def make():
        from safetensors.torch import save_file
        sd = {k: v.contiguous() for k, v in tiny_gpt2().state_dict().items() if k != "lm_head.weight"}
        change(sd)
        os.makedirs(path)
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    on_rank0(make)
    return path


@scenario
def impossible_values(rank, world):
    """Issue 30, point 3: a tensor stored as I32 for a float parameter was cast into the weights; an
    unknown dtype counted as float32; NaN or inf landed with no word. Each is a WeightsError on every
    rank naming the tensors, at initialize and at load_weights, which then writes nothing; config
    allow_nonfinite_weights loads a checkpoint that holds them on purpose."""
    def as_int(sd):
        sd["transformer.h.0.attn.c_attn.weight"] = (sd["transformer.h.0.attn.c_attn.weight"] * 100).to(torch.int32)

    def as_fp8(sd):
        sd["transformer.h.0.mlp.c_fc.weight"] = sd["transformer.h.0.mlp.c_fc.weight"].to(torch.float8_e4m3fn)

    def nonfinite(sd):
        sd["transformer.h.0.mlp.c_proj.weight"][3, 5] = float("nan")
        sd["transformer.h.1.attn.c_proj.bias"][7] = float("inf")

    out = {}
    engine = zeroshard.initialize(tiny_gpt2(seed=1), make_sgd, {"stage": 3, "chunk_size": 20000})
    before = engine.full_state_dict()
    for name, change in (("int", as_int), ("fp8", as_fp8), ("nonfinite", nonfinite)):
        path = single_file(name, change)
        out[f"{name}_at_init"] = error_on_every_rank(
            lambda: zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 2}, weights=path))
        out[f"{name}_load"] = error_on_every_rank(lambda: engine.load_weights(path))
        out[f"{name}_unchanged"] = max_diff(engine.full_state_dict(), before)
    allowed = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 3, "allow_nonfinite_weights": True},
                                   weights=place("nonfinite")).full_state_dict()
    out["allowed_nan"] = bool(allowed["transformer.h.0.mlp.c_proj.weight"][3, 5].isnan())
    out["allowed_inf"] = bool(allowed["transformer.h.1.attn.c_proj.bias"][7].isinf())
    return out


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
