"""Checkpoints: every rank writes its own shards through torch.distributed.checkpoint (DCP); any world
size, stage, chunk size or offload setting loads them, with no conversion step.

What is written (root, tag, version, lease, piece, the files of one checkpoint: docs/vocabulary.md):
- DCP keys: `model.<name>` (fp32 values of parameters: the masters, or frozen parameters widened;
  under their first name; and buffers),
  `optim.state.<name>.<state>` (e.g. exp_avg, step; a Python number as a 0-d tensor),
  `rng.<rank>.<generator>` (each rank's RNG states, as tensors). Every entry is a tensor.

A save is atomic: it is written to `.tmp-<tag>-<id>` in root, checksummed, renamed to its version
directory, the tag's link switched to it (a new link renamed over the old), and only then is
`latest` replaced (write, fsync, rename). A crash at any point leaves `latest` naming a complete
checkpoint: the previous one until the new one is complete (a tag whose link is missing is found at
its newest complete version). The next save clears what a crash left; `keep` (save_checkpoint)
removes all but the newest tags. Checkpoints of older zeroshard (a plain `<tag>` directory) load as
they are. Loading: checkpoint_load.py.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import shutil
import time
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp

from ..files.checkpoint_dirs import (LATEST, META, SUMS, VERSION, commit, fsync_dir, prune, remove_leftovers, write_file,
                              write_latest)
from ..files.checkpoint_files import (EXTRA, FORMAT, LazyPiece, Piece, SafeWriter, SavePlanner, cause_line, digest,
                                      failure)
from ..errors import CheckpointError
from ..runtime.placeholder import real_parameter
from ..distributed.ordering import CHECKPOINT
from .view import TrainingState

log = logging.getLogger("zeroshard")

# -- what the engine holds (read through its TrainingState view), by the model's own names --------
def _elementwise(v, piece) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == piece.shape


def tiered(c) -> bool:
    """Whether chunk c's master and optimizer states are in the disk tier (open it to read them)."""
    return c.trainable and c.tier is not None and c.tier.adopted_chunk(c)


def frozen_tiered(c) -> bool:
    """Whether chunk c is frozen and its shard is in the parameter tier (offload_params='disk'):
    its values are read and written there (a trainable one's come from its master)."""
    return not c.trainable and c.shard_tier is not None and c.shard_tier.adopted_chunk(c)


class OneOpen:
    """Disk-tier chunks opened one at a time (to be read), for as long as the next value asked for
    is theirs: in the optimizer's tier, or (a frozen chunk's shard) the parameter tier."""

    def __init__(self):
        self.chunk = self.tier = None

    def values(self, c, get):
        """get(), with chunk c open."""
        if self.chunk is not c:
            self.close()
            self.tier = c.shard_tier if frozen_tiered(c) else c.tier
            self.tier.open(c)
            self.chunk = c
        return get()

    def close(self) -> None:
        if self.chunk is not None:
            c, self.chunk = self.chunk, None
            self.tier.close(c, write=False)


def optim_kinds(view) -> dict[str, dict[str, str]]:
    """Collective: {parameter name: {state name: 'elementwise' | 'tensor' | 'int' | 'float'}} for
    every parameter with optimizer state on some rank (one never stepped has none, as in torch);
    CheckpointError for a state of any other kind (nothing is pickled)."""
    mine, error = {}, None
    for c in view.optim.chunks:
        for pc in c.pieces:
            kinds = {}
            for k, v in view.optim.optimizer.state.get(pc.param, {}).items():
                if _elementwise(v, pc):
                    kinds[k] = "elementwise"
                elif torch.is_tensor(v) and v.numel() == 1:
                    kinds[k] = "tensor"
                elif torch.is_tensor(v):
                    error = (f"zeroshard: optimizer state {k!r} of {pc.slot.name} has shape {tuple(v.shape)} for a "
                             f"piece of {tuple(pc.shape)}: only elementwise states (and scalars) can be saved "
                             "independently of the sharding")
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    kinds[k] = "float" if isinstance(v, float) else "int"
                else:
                    error = (f"zeroshard: optimizer state {k!r} of {pc.slot.name} is a {type(v).__name__}: a checkpoint "
                             "holds tensors and numbers only (nothing pickled)")
            if kinds:
                mine[pc.slot.name] = kinds
    everyone = view.comm.all_gather_objects((mine, error))
    errors = [e for _, e in everyone if e]
    if errors:
        raise CheckpointError(errors[0])
    return {name: kinds for got, _ in everyone for name, kinds in got.items()}


def describe_model(view: TrainingState) -> dict:
    """Parameter names, shapes and trainability in packing order, tied names, buffers, state_dict keys."""
    params = [[s.name, list(s.shape), s.param.requires_grad] for c in view.chunks for s in c.slots]
    tied, buffers = {}, {}
    for key, obj in view.state_keys:
        if id(obj) in view.names:
            if key != view.names[id(obj)]:
                tied[key] = view.names[id(obj)]
        elif torch.is_tensor(obj):
            buffers[key] = list(obj.shape)
        else:
            raise CheckpointError(f"zeroshard: state_dict entry {key!r} is neither a parameter nor a buffer (a "
                                  "module's extra state): zeroshard checkpoints do not hold those yet")
    return {"params": params, "tied": tied, "buffers": buffers,
            "state_dict_keys": [k for k, _ in view.state_keys]}


def mismatch(saved: dict, model: dict) -> str | None:
    """What differs between a checkpoint's model and this one, or None."""
    a = {n: tuple(s) for n, s, _ in saved["params"]} | {k: tuple(s) for k, s in saved["buffers"].items()}
    b = {n: tuple(s) for n, s, _ in model["params"]} | {k: tuple(s) for k, s in model["buffers"].items()}

    def listed(keys):
        keys = sorted(keys)
        return ", ".join(keys[:20]) + (f" and {len(keys) - 20} more" if len(keys) > 20 else "")

    lines = []
    if a.keys() - b.keys():
        lines.append(f"in the checkpoint, not in this model ({len(a.keys() - b.keys())}): {listed(a.keys() - b.keys())}")
    if b.keys() - a.keys():
        lines.append(f"in this model, not in the checkpoint ({len(b.keys() - a.keys())}): {listed(b.keys() - a.keys())}")
    shapes = sorted(k for k in a.keys() & b.keys() if a[k] != b[k])
    if shapes:
        lines.append(f"shapes differ ({len(shapes)}): " + ", ".join(f"{k} {a[k]} in the checkpoint, {b[k]} here"
                                                                  for k in shapes[:20]))
    if saved["tied"] != model["tied"]:
        lines.append(f"tied parameters differ: checkpoint {saved['tied']}, this model {model['tied']}")
    return "\n  ".join(lines) if lines else None


def _hf_config(module) -> dict | None:
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "to_json_string") or not hasattr(cfg, "model_type"):
        return None
    out = json.loads(cfg.to_json_string())
    if not out.get("architectures"):
        out["architectures"] = [type(module).__name__]
    return out


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (nothing pickled): torch's (and CUDA's) byte states,
    Python's and NumPy's Mersenne Twisters as integer tensors."""
    version, words, gauss = random.getstate()
    st = {"torch": torch.get_rng_state(), "python": torch.tensor([version, *words], dtype=torch.int64),
          "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64)}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy
        _, keys, pos, has_gauss, cached = numpy.random.get_state()
        st["numpy"] = torch.tensor([int(pos), int(has_gauss), *(int(k) for k in keys)], dtype=torch.int64)
        st["numpy_gauss"] = torch.tensor([float(cached)], dtype=torch.float64)
    except ImportError:
        pass
    return st


def set_rng_state(st: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(st["torch"])
    gauss = float(st["python_gauss"][0])
    random.setstate((int(st["python"][0]), tuple(int(x) for x in st["python"][1:]),
                     None if math.isnan(gauss) else gauss))
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)
    if "numpy" in st:
        import numpy
        n = st["numpy"].tolist()
        numpy.random.set_state(("MT19937", numpy.array(n[2:], dtype=numpy.uint32), n[0], n[1],
                                float(st["numpy_gauss"][0])))


def runs(c, lo: int, hi: int):
    """(slot, start in the parameter, [a, b) in chunk coordinates) for each parameter of chunk c
    with elements in [lo, hi)."""
    for s in c.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            yield s, a - s.offset, a, b


# -- save ------------------------------------------------------------------------------------------
def _save_state(view, one: OneOpen) -> dict:
    """This rank's DCP state: the pieces in its shard range (at stage 0 too, so ranks split the
    writing), scalar optimizer states from the rank holding a parameter's first element, its RNG.
    Hybrid sharding: the first shard group writes the pieces; the others hold the same values
    (with the optimizer split across the replicas, every rank writes its owned range). Disk-tier
    chunks' pieces are read as DCP writes them, through `one`."""
    out = {}
    opt = view.optim.optimizer
    buffers = describe_model(view)["buffers"]  # on every rank: it may raise, and must raise everywhere
    split = view.shards.split
    for c in (view.chunks if view.shards.replica == 0 or split else ()):
        lo, hi = c.owned_range if split else c.shard_range
        base = c.owned_range[0]
        lazy = tiered(c) or frozen_tiered(c)
        # fp32 throughout: masters are; a frozen 16-bit shard is widened (exactly)
        src = None if lazy else c.master.detach() if c.trainable else c.shard[lo - base:hi - base].float()
        if not c.trainable:
            base = lo
        piece_of = {id(pc.slot): pc for pc in c.pieces}
        for s, start, a, b in runs(c, lo, hi):
            out[f"model.{s.name}"] = Piece(src[a - base:b - base], s.shape, start) if not lazy else LazyPiece(
                lambda c=c, x=a - base, y=b - base: one.values(
                    c, lambda: c.master.detach()[x:y] if c.trainable else c.shard[x:y].float()),
                b - a, torch.float32, s.shape, start)
            pc = piece_of.get(id(s))
            for k, v in (opt.state.get(pc.param, {}) if pc is not None else {}).items():
                key = f"optim.state.{s.name}.{k}"
                if _elementwise(v, pc) and lazy:
                    out[key] = LazyPiece(lambda c=c, p=pc.param, k=k, x=a - pc.lo, y=b - pc.lo: one.values(
                        c, lambda: opt.state[p][k].detach().reshape(-1)[x:y]), b - a, v.dtype, s.shape, start)
                elif _elementwise(v, pc):
                    out[key] = Piece(v.detach().reshape(-1)[a - pc.lo:b - pc.lo], s.shape, start)
                elif start == 0:  # a scalar: a 0-d tensor, or a Python number saved as one
                    out[key] = v.detach().cpu().clone() if torch.is_tensor(v) else \
                        torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
    if view.comm.rank == 0:
        for key in buffers:
            out[f"model.{key}"] = view.module.get_buffer(key).detach()
    for k, v in _rng_state(view.device).items():
        out[f"rng.{view.comm.rank}.{k}"] = v
    return out


def quiesce(view) -> None:
    """Before reading or writing states: every rank is here (else DivergedError everywhere) and the
    last update is in."""
    view.comm.agree(CHECKPOINT)
    view.apply_delayed_update()


def full_state_dict(view: TrainingState, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """See Engine.full_state_dict: the model's own state_dict keys, full fp32 parameter values and
    buffers as they are, on the CPU (a collective; with tensor parallelism over the TP group too: a
    split parameter's whole tensor, as plain torch would hold it). Chunk by chunk: the device holds
    one gathered chunk at a time (with tensor parallelism: all of them, joined in the parameters'
    order). `rank0_only`: the other ranks keep nothing and get {}."""
    quiesce(view)
    keep = not rank0_only or view.world_comm.rank == 0
    if view.tp is not None:
        full = view.layout.full_values()
        full = {id(p): view.tp.full_tensor(p, full[id(p)]).detach().cpu().clone() for p in view.params}
    else:
        full = {}
        with view.shards.uncounted():
            for c in view.layout.chunks:
                whole = view.layout.full_fp32(c)
                if keep:
                    full.update({id(s.param): whole[s.offset:s.offset + s.numel].view(s.shape).cpu().clone()
                                 for s in c.slots})
                del whole  # before the next chunk's
    if not keep:
        return {}
    return {key: full[id(obj)] if id(obj) in full else view.module.get_buffer(key).detach().cpu().clone()
            for key, obj in ((key, _held_now(view.module, key, obj, full)) for key, obj in view.state_keys)}


def _held_now(module, key: str, obj, full: dict):
    """The parameter `key` names now, where it is another held one than at initialize (a forward
    that points `lin.weight` at one of several parameters the model holds): its value, not the
    first one's, is what the model's own state_dict() would give under `key`."""
    prefix, _, name = key.rpartition(".")
    try:
        now = real_parameter(module.get_submodule(prefix)._parameters.get(name))
    except AttributeError:  # a module deleted since: what it held at initialize
        return obj
    return now if now is not None and id(now) in full else obj


def save(view: TrainingState, root, tag: str | None = None, client_state: dict | None = None, keep: int | None = None,
         omit_pending_grads: bool = False) -> str:
    """See Engine.save_checkpoint. Saves model, optimizer states, loss scale, step counters, RNG
    states, the config and `client_state` (rank 0's dict of tensors, numbers, strings, None, lists,
    tuples and dicts, e.g. the data position; nothing a load would have to unpickle) as
    checkpoint `tag` (default `step<N>`) in directory `root`, every rank writing its own shards; then
    points root/latest at it. Any world size, stage, chunk size or offload setting can load it;
    `zeroshard export` turns it into one safetensors file."""
    quiesce(view)
    comm = view.comm
    if view.grads_pending and not omit_pending_grads:
        raise CheckpointError("zeroshard: save_checkpoint with gradients that no step() has applied yet (they "
                              "would be lost); save after engine.step() has applied the update")
    kinds = optim_kinds(view)
    tag = tag if tag is not None else f"step{view.steps}"
    if not tag or os.sep in tag or tag.startswith(".") or tag == LATEST or VERSION.fullmatch(tag):
        raise CheckpointError(f"zeroshard: checkpoint tag {tag!r} must be a plain name (no '{os.sep}', not "
                              f"starting with '.', not '{LATEST}', not ending in '.v-' and 8 hex digits)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"zeroshard: keep={keep!r}: give the number of newest checkpoints to keep (>= 1)")
    root = os.path.abspath(os.fspath(root))
    t0 = time.perf_counter()
    tmp = error = None
    if comm.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            remove_leftovers(root)
            tmp = os.path.join(root, f".tmp-{tag}-{uuid.uuid4().hex[:8]}")
        except OSError as e:  # every rank must reach the broadcast
            error = f"zeroshard: cannot write checkpoints in {root}: {e}"
    tmp, error = comm.broadcast_object((tmp, error))
    if error:
        raise CheckpointError(error)
    try:
        one = OneOpen()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            try:
                dcp.save(_save_state(view, one), storage_writer=SafeWriter(tmp), planner=SavePlanner(),
                         process_group=comm.group, no_dist=not comm.distributed)
            finally:
                one.close()
        try:
            mine = {n: digest(os.path.join(tmp, n)) for n in os.listdir(tmp) if n.startswith(f"__{comm.rank}_")}
        except OSError as e:
            mine = f"rank {comm.rank}: {e}"
        everyone = comm.all_gather_objects(mine)
        error = next((x for x in everyone if isinstance(x, str)), None)
        if comm.rank == 0 and error is None:
            try:
                _finish(view, tmp, root, tag, {k: v for d in everyone for k, v in d.items()}, client_state, kinds)
                if keep is not None:
                    prune(root, keep, tag)
            except Exception as e:  # reported on every rank below
                error = cause_line(e)
        error = comm.broadcast_object(error)
        if error is not None:
            raise CheckpointError(f"zeroshard: saving checkpoint {tag!r} in {root} failed: {error}")
    except BaseException as e:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (CheckpointError, KeyboardInterrupt, SystemExit)):
            raise
        # torch's CheckpointException (a full or read-only disk in a writer) is a BaseException:
        # an `except Exception` around save_checkpoint must catch it.
        raise failure(e, f"save checkpoint {tag!r} in {root}", comm.timeout_s,
                      " (the checkpoints already there are intact)") from e
    final = os.path.join(root, tag)
    if comm.rank == 0:
        size = sum(os.path.getsize(os.path.join(final, n)) for n in os.listdir(final))
        log.info("saved checkpoint %s (%.1f MB, world %d) in %.2f s", final, size / 1e6, comm.world,
                 time.perf_counter() - t0)
    return final


def _finish(view, tmp: str, root: str, tag: str, sums: dict, client_state, kinds: dict) -> None:
    """Rank 0, once every rank's shards are written: the side files, the checksums, then the commit."""
    meta = {"format": FORMAT, "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world": view.comm.world, "stage": view.stage, "precision": view.config.precision,
            "config": view.config.to_dict(), "steps": view.steps, "micro_steps": view.micro_steps,
            "skipped_steps": view.optim.skipped_steps, "optimizer_steps": view.optim.boundaries,
            "loss_scale": view.scaler.state_dict() if view.scaler else None,
            **describe_model(view), "optim_state": kinds,
            "hf_config": _hf_config(view.module),
            "tensor_parallel": view.tp.describe(view.params, view.names) if view.tp else None}
    write_file(os.path.join(tmp, META), json.dumps(meta, indent=1).encode())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in view.optim.optimizer.param_groups]
    buf = io.BytesIO()
    torch.save({"client_state": client_state, "param_groups": groups}, buf)
    try:  # what a load will read: refuse now, not then
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError("client_state (and the optimizer's hyperparameters) must hold only tensors, numbers, "
                              "strings, None, and lists, tuples and dicts of them: a checkpoint is loaded without "
                              f"unpickling code ({type(e).__name__}: {e})") from None
    write_file(os.path.join(tmp, EXTRA), buf.getvalue())
    for name in (".metadata", META, EXTRA):
        sums[name] = digest(os.path.join(tmp, name))
    write_file(os.path.join(tmp, SUMS), json.dumps(sums, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)
    commit(tmp, root, tag)
    write_latest(root, tag)
