"""Checkpoints: every rank writes its own shards through torch.distributed.checkpoint (DCP); any world
size, stage, chunk size or offload setting loads them, with no conversion step.

Vocabulary (root, tag, version, lease: checkpoint_dirs.py, the layout of a root on disk):
- piece: the elements of one parameter (or of one elementwise optimizer state) that lie in this
  rank's shard of a chunk: a run of the parameter's row-major elements. DCP stores tensors as boxes,
  so a piece goes to DCP as the few boxes its run covers (whole rows in the middle, part rows at the
  ends). Keys and shapes are the model's own, as in `model.state_dict()`; the checkpoint knows nothing
  of chunks, which is what makes it topology-independent.
- DCP keys: `model.<name>` (fp32 values of parameters: the masters, or frozen parameters widened;
  under their first name; and buffers),
  `optim.state.<name>.<state>` (e.g. exp_avg, step; a Python number as a 0-d tensor),
  `rng.<rank>.<generator>` (each rank's RNG states, as tensors). Every entry is a tensor.
- files of one checkpoint: DCP's `.metadata` (written as JSON by SafeWriter, not DCP's pickle) and
  `__<rank>_0.distcp` (tensors, which DCP reads with torch.load(weights_only=True)); `zeroshard.json`
  (what was saved: parameter names and shapes, tied names, optimizer state kinds, step counters, loss
  scale, config, a transformers config if the model has one); `extra.pt` (the user's dict, the
  optimizer's hyperparameters: plain data, read with weights_only=True); `checksums.json` (size and
  SHA-256 of every other file), written last. No file is unpickled into code: a tampered checkpoint
  (checksums rewritten too) is a CheckpointError, never code run by load_checkpoint or export.

A save is atomic: it is written to `.tmp-<tag>-<id>` in root, checksummed, renamed to its version
directory, the tag's link switched to it (a new link renamed over the old), and only then is
`latest` replaced (write, fsync, rename). A crash at any point leaves `latest` naming a complete
checkpoint: the previous one until the new one is complete (a tag whose link is missing is found at
its newest complete version). The next save clears what a crash left; `keep` (save_checkpoint)
removes all but the newest tags. A load holds a lease on the version it reads, so no save removes
it meanwhile. Checkpoints of older zeroshard (a plain `<tag>` directory) load as they are. A load checks, before it changes any value: every file's
size and checksum (the ranks split the files between them), that the checkpoint's parameter names
and shapes are this model's, and that its optimizer state is this optimizer's.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import random
import contextlib
import re
import shutil
import time
import uuid
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .checkpoint_dirs import (LATEST, META, SUMS, VERSION, commit, fsync_dir, held, lease, prune,
                              remove_leftovers, write_file, write_latest)
from .errors import CheckpointError, PeerLostError, PeerLostInCheckpointError
from .optimizer import probe_state
from .ordering import CHECKPOINT, peer_lost

log = logging.getLogger("zeroshard")

FORMAT = 2  # 2: nothing pickled (DCP's metadata as JSON, extra.pt read weights_only); 1 is refused
EXTRA = "extra.pt"


def cause_line(e: BaseException) -> str:
    """What `e` was, in one line (DCP's CheckpointException: its first rank's failure); the rest
    stays in the error's __cause__."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = min(failures.items(), key=lambda kv: kv[0])
        return f"rank {rank}: {cause_line(wrapped[0] if isinstance(wrapped, tuple) else wrapped)}"
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    if not first and isinstance(e, EOFError):  # torch.load of a file that ends too soon says nothing
        first = "a file ended before its data did (replaced or cut short)"
    return f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__


def failure(e: BaseException, doing: str, timeout_s: float, note: str = "") -> CheckpointError:
    """The CheckpointError for `e`, raised while `doing` (e.g. "save checkpoint 'step2' in /ckpt"):
    PeerLostInCheckpointError for a lost or stopped peer, else its cause in one line."""
    lost = e if isinstance(e, PeerLostError) else peer_lost(e, doing, timeout_s)
    if lost is not None:
        return PeerLostInCheckpointError(f"{lost}{note}")
    return CheckpointError(f"zeroshard: could not {doing}{note}: {cause_line(e)}")


# -- pieces: a run of a tensor's elements, as DCP boxes --------------------------------------------
def row_major_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple, tuple]]:
    """Elements [start, stop) of a row-major tensor of `shape` as boxes (offsets, sizes), in memory
    order: each box is itself a contiguous run, so box i is elements [start + sum of earlier box
    volumes, ...) of the run."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    row, last = start // inner, stop // inner
    out = []
    if start % inner:  # a partial first row
        end = min(stop, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in row_major_boxes(shape[1:], start - row * inner, end - row * inner)]
        row += 1
        if end == stop:
            return out
    if last > row:
        out.append(((row,) + (0,) * (len(shape) - 1), (last - row, *shape[1:])))
    if stop % inner:  # a partial last row
        out += [((last, *o), (1, *s)) for o, s in row_major_boxes(shape[1:], 0, stop - last * inner)]
    return out


class Piece:
    """Elements [start, start + len(values)) of a tensor of `shape`, held in the 1-D `values` (a view
    into a chunk's master, shard or optimizer state). DCP reads and writes it in place through its
    checkpointable protocol (the one DTensor implements)."""

    def __init__(self, values: torch.Tensor, shape: torch.Size, start: int):
        self.values = values
        self.shape = torch.Size(shape)
        self.boxes = []
        at = 0
        for offsets, sizes in row_major_boxes(tuple(self.shape), start, start + values.numel()):
            n = math.prod(sizes)
            self.boxes.append((torch.Size(offsets), torch.Size(sizes), at))
            at += n

    def size(self) -> torch.Size:
        return self.shape

    def _box(self, offsets, sizes, at) -> torch.Tensor:
        return self.values[at:at + math.prod(sizes)].view(sizes)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.values)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=props, size=self.shape))
                for offsets, sizes, _ in self.boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes) for offsets, sizes, _ in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, sizes, at in self.boxes:
            if offsets == torch.Size(index.offset):
                return self._box(offsets, sizes, at)
        raise ValueError(f"zeroshard: no box of {index.fqn} starts at {tuple(index.offset)}")


class _SavePlanner(DefaultSavePlanner):
    """Saves a flat {key: Tensor | Piece} state (SafeWriter refuses anything that DCP would pickle)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Piece) else super().lookup_object(index)


class SafeWriter(FileSystemWriter):
    """DCP's file writer, with its metadata written as JSON instead of a pickle (read back by
    SafeReader): loading a checkpoint runs no code from it."""

    def finish(self, metadata: Metadata, results) -> None:
        storage = {}
        for wr_list in results:
            storage.update({wr.index: wr.storage_data for wr in wr_list})
        out = {"format": "zeroshard-dcp-json", "version": metadata.version, "tensors": {}, "storage": []}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"zeroshard: {fqn} would be saved as a pickled object; only tensors are saved")
            out["tensors"][fqn] = {"dtype": str(md.properties.dtype).removeprefix("torch."), "size": list(md.size),
                                   "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
        for index, info in storage.items():
            out["storage"].append([index.fqn, None if index.offset is None else list(index.offset), index.index,
                                   info.relative_path, info.offset, info.length,
                                   list(info.transform_descriptors or ())])
        path = self._get_metadata_path()
        write_file(os.fspath(path), json.dumps(out).encode())


_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                                        torch.int64, torch.int32, torch.int16, torch.int8,
                                                        torch.uint8, torch.bool)}
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class SafeReader(FileSystemReader):
    """DCP's file reader for SafeWriter's JSON metadata, every field checked (types, dtypes from
    an allow-list, data files named as DCP names them, inside the checkpoint)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = os.fspath(self._get_metadata_path())
        try:
            with open(path, "rb") as f:
                raw = json.loads(f.read())
            if raw.get("format") != "zeroshard-dcp-json":
                raise ValueError("not zeroshard's metadata")
            tensors = {}
            for fqn, t in raw["tensors"].items():
                tensors[str(fqn)] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=_DTYPES[t["dtype"]]), size=torch.Size(_ints(t["size"])),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(_ints(o)), sizes=torch.Size(_ints(z)))
                            for o, z in t["chunks"]])
            storage = {}
            for fqn, offset, index, rel, at, length, transforms in raw["storage"]:
                if not _SHARD_FILE.fullmatch(str(rel)):
                    raise ValueError(f"data file {rel!r}")
                key = MetadataIndex(str(fqn), None if offset is None else torch.Size(_ints(offset)),
                                    None if index is None else int(index))
                storage[key] = _StorageInfo(str(rel), *_ints([at, length]), tuple(str(x) for x in transforms) or None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"zeroshard: {path} is not checkpoint metadata zeroshard reads ({type(e).__name__}: "
                                  f"{e})") from None
        meta = Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=StorageMeta(),
                        version=str(raw.get("version")))
        meta.storage_meta.load_id = self.load_id
        return meta


def _ints(values) -> list[int]:
    out = [int(v) for v in values]
    if any(v < 0 or not isinstance(x, int) for v, x in zip(out, values)):
        raise ValueError(f"not sizes: {values!r}")
    return out


class _LoadPlanner(DefaultLoadPlanner):
    """Loads a flat {key: Tensor | Piece | None} state in place (DCP's default set-up would turn
    objects it does not know into None)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Piece) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"zeroshard: {read_item.dest_index.fqn} is stored as a pickled object, which zeroshard "
                              "does not load")


def dcp_load(state: dict, path: str, comm=None) -> None:
    """DCP load of `state` (tensors, Pieces) from checkpoint dir `path`;
    collective over comm's group, or this process alone when comm is None."""
    single = comm is None or not comm.distributed
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(state, storage_reader=SafeReader(path), planner=_LoadPlanner(),
                 process_group=None if single else comm.group, no_dist=single)


# -- files: checksums, atomic commit, finding a checkpoint -------------------------------------------
def digest(path: str) -> dict:
    """{'bytes': size, 'sha256': hex digest} of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 23):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def verify(path: str, name: str, want: dict) -> str | None:
    """None if file `name` in checkpoint dir `path` has the recorded size and checksum, else why not."""
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        return f"{full}: missing"
    size = os.path.getsize(full)
    if size != want["bytes"]:
        return f"{full}: {size} bytes, {want['bytes']} were written (truncated or overwritten)"
    if digest(full)["sha256"] != want["sha256"]:
        return f"{full}: checksum mismatch (the file changed after it was written: corrupted)"
    return None


def read_sums(path: str) -> dict:
    try:
        with open(os.path.join(path, SUMS)) as f:
            sums = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"zeroshard: {os.path.join(path, SUMS)} is damaged ({type(e).__name__})") from None
    if not isinstance(sums, dict) or not all(isinstance(v, dict) and isinstance(v.get("sha256"), str)
                                             and isinstance(v.get("bytes"), int) for v in sums.values()):
        raise CheckpointError(f"zeroshard: {os.path.join(path, SUMS)} is damaged (not a map of file names to sizes "
                              "and checksums)")
    return sums


def read_meta(path: str, sums: dict) -> dict:
    """zeroshard.json of checkpoint dir `path`, checked against its checksum."""
    why = verify(path, META, sums.get(META, {"bytes": -1, "sha256": ""}))
    if why:
        raise CheckpointError(f"zeroshard: checkpoint {path} is damaged: {why}")
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"zeroshard: {os.path.join(path, META)} is damaged ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("format", 0), int):
        raise CheckpointError(f"zeroshard: {os.path.join(path, META)} is damaged")
    if meta.get("format", 0) > FORMAT:
        raise CheckpointError(f"zeroshard: {path} has checkpoint format {meta.get('format')}; this zeroshard "
                              f"reads format {FORMAT}: upgrade zeroshard")
    if meta.get("format", 0) < FORMAT:
        raise CheckpointError(f"zeroshard: {path} has checkpoint format {meta.get('format')}, whose files are "
                              "pickles, which zeroshard no longer loads (a pickle runs code): load it with the "
                              "zeroshard that saved it and save it again, or export it with that version")
    return meta


def verify_all(path: str, sums: dict, comm=None) -> None:
    """Check every file's size and checksum, the files split between the ranks; raises on every rank
    naming each damaged file."""
    rank, world = (comm.rank, comm.world) if comm is not None else (0, 1)
    mine = [why for name in sorted(sums)[rank::world] if (why := verify(path, name, sums[name]))]
    bad = [why for got in (comm.all_gather_objects(mine) if comm is not None else [mine]) for why in got]
    if bad:
        raise CheckpointError(f"zeroshard: checkpoint {path} is damaged; nothing was loaded:\n  " + "\n  ".join(bad))


# -- what the engine holds, by the model's own names ------------------------------------------------
def _elementwise(v, piece) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.shape == piece.shape


def _optim_kinds(engine) -> dict[str, dict[str, str]]:
    """Collective: {parameter name: {state name: 'elementwise' | 'tensor' | 'int' | 'float'}} for
    every parameter with optimizer state on some rank (one never stepped has none, as in torch);
    CheckpointError for a state of any other kind (nothing is pickled)."""
    mine, error = {}, None
    for c in engine.optim.chunks:
        for pc in c.pieces:
            kinds = {}
            for k, v in engine.optim.optimizer.state.get(pc.param, {}).items():
                if _elementwise(v, pc.param):
                    kinds[k] = "elementwise"
                elif torch.is_tensor(v) and v.numel() == 1:
                    kinds[k] = "tensor"
                elif torch.is_tensor(v):
                    error = (f"zeroshard: optimizer state {k!r} of {pc.slot.name} has shape {tuple(v.shape)} for a "
                             f"piece of {tuple(pc.param.shape)}: only elementwise states (and scalars) can be saved "
                             "independently of the sharding")
                elif isinstance(v, (int, float)) and not isinstance(v, bool):
                    kinds[k] = "float" if isinstance(v, float) else "int"
                else:
                    error = (f"zeroshard: optimizer state {k!r} of {pc.slot.name} is a {type(v).__name__}: a checkpoint "
                             "holds tensors and numbers only (nothing pickled)")
            if kinds:
                mine[pc.slot.name] = kinds
    everyone = engine.comm.all_gather_objects((mine, error))
    errors = [e for _, e in everyone if e]
    if errors:
        raise CheckpointError(errors[0])
    return {name: kinds for got, _ in everyone for name, kinds in got.items()}


def describe_model(engine) -> dict:
    """Parameter names, shapes and trainability in packing order, tied names, buffers, state_dict keys."""
    params = [[s.name, list(s.shape), s.param.requires_grad] for c in engine.chunks for s in c.slots]
    tied, buffers = {}, {}
    for key, obj in engine.state_keys:
        if id(obj) in engine.names:
            if key != engine.names[id(obj)]:
                tied[key] = engine.names[id(obj)]
        elif torch.is_tensor(obj):
            buffers[key] = list(obj.shape)
        else:
            raise CheckpointError(f"zeroshard: state_dict entry {key!r} is neither a parameter nor a buffer (a "
                                  "module's extra state): zeroshard checkpoints do not hold those yet")
    return {"params": params, "tied": tied, "buffers": buffers,
            "state_dict_keys": [k for k, _ in engine.state_keys]}


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


def _set_rng_state(st: dict[str, torch.Tensor], device: torch.device) -> None:
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


def _runs(c, lo: int, hi: int):
    """(slot, start in the parameter, [a, b) in chunk coordinates) for each parameter of chunk c
    with elements in [lo, hi)."""
    for s in c.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a < b:
            yield s, a - s.offset, a, b


# -- save ------------------------------------------------------------------------------------------
def _save_state(engine) -> dict:
    """This rank's DCP state: the pieces in its shard range (at stage 0 too, so ranks split the
    writing), scalar optimizer states from the rank holding a parameter's first element, its RNG."""
    out = {}
    opt = engine.optim.optimizer
    buffers = describe_model(engine)["buffers"]  # on every rank: it may raise, and must raise everywhere
    for c in engine.chunks:
        lo, hi = c.shard_range
        base = c.owned_range[0]
        # fp32 throughout: masters are; a frozen 16-bit shard is widened (exactly)
        src = c.master.detach() if c.trainable else c.shard[lo - base:hi - base].float()
        if not c.trainable:
            base = lo
        piece_of = {id(pc.slot): pc for pc in c.pieces}
        for s, start, a, b in _runs(c, lo, hi):
            out[f"model.{s.name}"] = Piece(src[a - base:b - base], s.shape, start)
            pc = piece_of.get(id(s))
            for k, v in (opt.state.get(pc.param, {}) if pc is not None else {}).items():
                key = f"optim.state.{s.name}.{k}"
                if _elementwise(v, pc.param):
                    out[key] = Piece(v.detach().reshape(-1)[a - pc.lo:b - pc.lo], s.shape, start)
                elif start == 0:  # a scalar: a 0-d tensor, or a Python number saved as one
                    out[key] = v.detach().cpu().clone() if torch.is_tensor(v) else \
                        torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
    if engine.comm.rank == 0:
        for key in buffers:
            out[f"model.{key}"] = engine.module.get_buffer(key).detach()
    for k, v in _rng_state(engine.device).items():
        out[f"rng.{engine.comm.rank}.{k}"] = v
    return out


def _quiesce(engine) -> None:
    """Before reading or writing states: every rank is here (else DivergedError everywhere) and the
    last update is in."""
    engine.comm.agree(CHECKPOINT)
    engine.apply_delayed_update()


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """See Engine.full_state_dict: the model's own state_dict keys, full fp32 parameter values and
    buffers as they are, on the CPU (a collective; with tensor parallelism over the TP group too: a
    split parameter's whole tensor, as plain torch would hold it)."""
    _quiesce(engine)
    full = engine.layout.full_values()
    if engine.tp is not None:
        full = {id(p): engine.tp.full_tensor(p, full[id(p)]) for p in engine.params}
    return {key: (full[id(obj)] if id(obj) in full else engine.module.get_buffer(key)).detach().cpu().clone()
            for key, obj in engine.state_keys}


def save(engine, root, tag: str | None = None, client_state: dict | None = None, keep: int | None = None,
         omit_pending_grads: bool = False) -> str:
    """See Engine.save_checkpoint. Saves model, optimizer states, loss scale, step counters, RNG
    states, the config and `client_state` (rank 0's dict of tensors, numbers, strings, None, lists,
    tuples and dicts, e.g. the data position; nothing a load would have to unpickle) as
    checkpoint `tag` (default `step<N>`) in directory `root`, every rank writing its own shards; then
    points root/latest at it. Any world size, stage, chunk size or offload setting can load it;
    `zeroshard export` turns it into one safetensors file."""
    _quiesce(engine)
    comm = engine.comm
    if engine.grads_pending and not omit_pending_grads:
        raise CheckpointError("zeroshard: save_checkpoint with gradients that no step() has applied yet (they "
                              "would be lost); save after engine.step() has applied the update")
    kinds = _optim_kinds(engine)
    tag = tag if tag is not None else f"step{engine.steps}"
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
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(_save_state(engine), storage_writer=SafeWriter(tmp), planner=_SavePlanner(),
                     process_group=comm.group, no_dist=not comm.distributed)
        try:
            mine = {n: digest(os.path.join(tmp, n)) for n in os.listdir(tmp) if n.startswith(f"__{comm.rank}_")}
        except OSError as e:
            mine = f"rank {comm.rank}: {e}"
        everyone = comm.all_gather_objects(mine)
        error = next((x for x in everyone if isinstance(x, str)), None)
        if comm.rank == 0 and error is None:
            try:
                _finish(engine, tmp, root, tag, {k: v for d in everyone for k, v in d.items()}, client_state, kinds)
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


def _finish(engine, tmp: str, root: str, tag: str, sums: dict, client_state, kinds: dict) -> None:
    """Rank 0, once every rank's shards are written: the side files, the checksums, then the commit."""
    meta = {"format": FORMAT, "torch": torch.__version__, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world": engine.comm.world, "stage": engine.stage, "precision": engine.zeroshard_config.precision,
            "config": engine.zeroshard_config.to_dict(), "steps": engine.steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.optim.skipped_steps, "optimizer_steps": engine.optim.boundaries,
            "loss_scale": engine.scaler.state_dict() if engine.scaler else None,
            **describe_model(engine), "optim_state": kinds,
            "hf_config": _hf_config(engine.module),
            "tensor_parallel": engine.tp.describe(engine.params, engine.names) if engine.tp else None}
    write_file(os.path.join(tmp, META), json.dumps(meta, indent=1).encode())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optim.optimizer.param_groups]
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


# -- load ------------------------------------------------------------------------------------------
def load(engine, path, tag: str | None = None, load_optimizer: bool = True) -> dict:
    """See Engine.load_checkpoint. Every failure is a CheckpointError (torch's CheckpointException,
    a BaseException, included)."""
    try:
        return _load(engine, path, tag, load_optimizer)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise failure(e, f"load checkpoint {path}", engine.comm.timeout_s) from e


def _load(engine, path, tag: str | None, load_optimizer: bool) -> dict:
    """See Engine.load_checkpoint. `path` is a root (its `latest`, or `tag`) or a checkpoint
    directory. load_optimizer=False loads the model (and buffers, counters, RNG) and clears the
    optimizer's state. Everything that can refuse the checkpoint runs before anything in
    the engine changes: files, model, optimizer compatibility, agreement of scalar states."""
    _quiesce(engine)
    comm = engine.comm
    t0 = time.perf_counter()
    with contextlib.ExitStack() as leases:
        found = error = None
        if comm.rank == 0:  # one resolution of `latest` for everyone
            try:
                found = leases.enter_context(lease(path, tag))
            except Exception as e:  # every rank must reach the broadcast
                error = str(e) if isinstance(e, CheckpointError) else f"zeroshard: reading {path}: {e}"
        found, error = comm.broadcast_object((found, error))
        if error:
            raise CheckpointError(error)
        missing = None
        if comm.rank != 0:
            try:
                leases.enter_context(held(found))
            except CheckpointError as e:
                missing = f"rank {comm.rank}: {e}"
        missing = next((m for m in comm.all_gather_objects(missing) if m), None)
        if missing:  # on every rank, not a wait on the others
            raise CheckpointError(missing)
        return _load_version(engine, found, load_optimizer, t0)


def _load_version(engine, found: str, load_optimizer: bool, t0: float) -> dict:
    """_load of version directory `found`, which every rank holds a lease on."""
    comm = engine.comm
    sums = read_sums(found)
    meta = read_meta(found, sums)
    why = mismatch(meta, describe_model(engine))
    if why:
        raise CheckpointError(f"zeroshard: checkpoint {found} is of another model:\n  {why}")
    verify_all(found, sums, comm)
    extra = read_extra(found)
    kinds = meta["optim_state"] if load_optimizer else {}
    if load_optimizer:
        _check_optimizer(engine, found, kinds, extra["param_groups"])
    # A new chunk layout (if it was not fixed yet) changes no value: refusing after it changes nothing.
    _fix_layout(engine, [n for n, _, _ in meta["params"]])
    # A parameter frozen at initialize whose optimizer state the checkpoint holds (unfrozen before
    # the save): its chunk becomes trainable, so the state has somewhere to go.
    engine.thaw(frozenset(kinds))
    saved = SafeReader(found).read_metadata().state_dict_metadata
    small = _small_state(engine, kinds, meta, saved)
    dcp_load(small, found, comm)

    # From here on values change.
    if engine.stage == 3:
        engine.cache.flush()
    for name, states in kinds.items():  # Python numbers the optimizer kept as such
        for k, kind in states.items():
            key = f"optim.state.{name}.{k}"
            if kind in ("int", "float") and key in small:
                small[key] = (int if kind == "int" else float)(small[key].item())
    pieces, opt_state = _piece_state(engine, kinds)
    dcp_load(pieces, found, comm)
    _apply(engine, opt_state, small, extra["param_groups"] if load_optimizer else None)
    for key in meta["buffers"]:
        with torch.no_grad():
            engine.module.get_buffer(key).copy_(small[f"model.{key}"])

    engine.steps = meta["steps"]
    engine.comm.step = engine.steps + 1
    engine.micro_steps = 0  # at a boundary; counting restarts, so another accumulation works too
    if load_optimizer:
        engine.optim.skipped_steps = meta["skipped_steps"]
        # older checkpoints lack it: count as if every step had applied (only delay_update_after reads it)
        engine.optim.boundaries = meta.get("optimizer_steps", meta["steps"] + meta["skipped_steps"])
    if engine.scaler is not None and meta["loss_scale"] is not None:
        engine.scaler.scale = meta["loss_scale"]["scale"]
        engine.scaler.clean_steps = meta["loss_scale"]["clean_steps"]
    prefix = f"rng.{comm.rank}."
    rng = {k[len(prefix):]: v for k, v in small.items() if k.startswith(prefix)}
    if rng:
        _set_rng_state(rng, engine.device)
    elif comm.rank == meta["world"]:  # once: the first rank the checkpoint has no RNG state for
        log.info("checkpoint saved at world %d: ranks %d.. keep their own RNG state",
                 meta["world"], meta["world"])
    if comm.rank == 0:
        now = engine.zeroshard_config.to_dict()
        changed = {k: (v, now.get(k)) for k, v in meta["config"].items() if now.get(k) != v}
        log.info("loaded checkpoint %s (saved at world %d, stage %d; loaded at world %d, stage %d) "
                 "in %.2f s%s", found, meta["world"], meta["stage"], comm.world, engine.stage,
                 time.perf_counter() - t0,
                 "; config now differs: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
                 if changed else "")
    return extra["client_state"] if extra["client_state"] is not None else {}


def read_extra(path: str) -> dict:
    """extra.pt, read as tensors and plain data only (torch.load weights_only: no code runs)."""
    try:
        extra = torch.load(os.path.join(path, EXTRA), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"zeroshard: {os.path.join(path, EXTRA)} holds something other than tensors and plain "
                              f"data, which zeroshard does not load ({type(e).__name__})") from None
    if not isinstance(extra, dict) or not isinstance(extra.get("param_groups"), list) or "client_state" not in extra:
        raise CheckpointError(f"zeroshard: {os.path.join(path, EXTRA)} is damaged (not the client state and "
                              "param groups a checkpoint holds)")
    return extra


def _check_optimizer(engine, found: str, kinds: dict, groups: list) -> None:
    """A parameter without saved state starts without state (torch's load_state_dict does the same
    for a parameter that was never stepped); the kinds of state must be this optimizer's."""
    theirs = set().union(*(set(k) for k in kinds.values())) if kinds else set()
    ours = set(probe_state(engine.optim.make_opt)) if kinds else set()
    if theirs != ours:
        raise CheckpointError(f"zeroshard: checkpoint {found} holds optimizer state {sorted(theirs)}; this "
                              f"optimizer keeps {sorted(ours)}: another optimizer? Load with load_optimizer=False")
    if len(groups) != len(engine.optim.optimizer.param_groups):
        raise CheckpointError(f"zeroshard: the checkpoint's optimizer has {len(groups)} parameter groups, this one "
                              f"{len(engine.optim.optimizer.param_groups)}")


def _small_state(engine, kinds: dict, meta: dict, saved: dict) -> dict:
    """What is loaded before anything changes: scalar optimizer states of this rank's master pieces,
    buffers and this rank's RNG states (fresh tensors, as the checkpoint's metadata `saved`
    describes them)."""
    state = {}
    for c in engine.optim.chunks:
        for pc in c.pieces:
            for k, kind in kinds.get(pc.slot.name, {}).items():
                key = f"optim.state.{pc.slot.name}.{k}"
                if kind != "elementwise":
                    state[key] = torch.zeros(saved[key].size, dtype=saved[key].properties.dtype)
    for key in meta["buffers"]:
        md = saved[f"model.{key}"]
        state[f"model.{key}"] = torch.empty(md.size, dtype=md.properties.dtype)
    for key, md in saved.items():
        if key.startswith(f"rng.{engine.comm.rank}."):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return state


def _fix_layout(engine, order: list[str]) -> None:
    """Before the first training forward the engine has not fixed its chunk layout (it re-packs in
    order of first use): take the checkpoint's order instead. A re-pack needs an optimizer with no
    state; otherwise the layout stays as it is (pieces load into any layout)."""
    if engine.layout.final:
        return
    by_name = {engine.names[id(p)]: p for p in engine.params}
    engine.fix_layout([by_name[n] for n in order] if not engine.optim.optimizer.state else None)


def _piece_state(engine, kinds: dict):
    """Pieces of each chunk's owned range, loaded in place: its master (its shard if frozen) and
    the elementwise optimizer states of its master pieces (the optimizer's own tensors when they
    fit: no second copy). Returns (DCP state, {id(master piece): {state name: tensor, or None for
    a scalar state}})."""
    state, opt_state = {}, {}
    opt = engine.optim.optimizer
    for c in engine.chunks:
        lo, hi = c.owned_range
        dst = (c.master if c.trainable else c.shard).detach()
        piece_of = {id(pc.slot): pc for pc in c.pieces}
        for s, start, a, b in _runs(c, lo, hi):
            state[f"model.{s.name}"] = Piece(dst[a - lo:b - lo], s.shape, start)
            pc = piece_of.get(id(s))
            if pc is None or s.name not in kinds:
                continue
            old, bufs = opt.state.get(pc.param, {}), {}
            for k, kind in kinds[s.name].items():
                if kind != "elementwise":
                    bufs[k] = None  # a scalar: loaded before anything changed (_small_state)
                else:
                    v = old.get(k)
                    if not (torch.is_tensor(v) and v.shape == pc.param.shape and v.dtype == torch.float32):
                        v = torch.zeros_like(pc.param, dtype=torch.float32).detach()
                    bufs[k] = v
                    state[f"optim.state.{s.name}.{k}"] = Piece(v.detach().reshape(-1), s.shape, start)
            opt_state[id(pc.param)] = bufs
    return state, opt_state


@torch.no_grad()
def _apply(engine, opt_state: dict, small: dict, groups) -> None:
    """After the masters (and frozen shards) are loaded: refresh every 16-bit copy and (stages 1-2)
    the full chunks, and hand the optimizer its state: elementwise states from `opt_state`, scalar
    ones from `small` (groups None: no optimizer state loaded, so the optimizer starts afresh)."""
    comm = engine.comm
    comm.counting = False
    try:
        for c in engine.chunks:
            if c.trainable:
                c.zero_grad()
                if not c.master_is_shard:
                    c.shard.copy_(c.master)
            if engine.stage in (1, 2):
                comm.all_gather(c.full, c.shard)
    finally:
        comm.counting = True
    opt = engine.optim.optimizer
    current = opt.state_dict()["param_groups"]
    if groups is None:
        opt.load_state_dict({"state": {}, "param_groups": current})
        return
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    loaded = {}
    for c in engine.optim.chunks:
        for pc in c.pieces:
            if id(pc.param) in opt_state and id(pc.param) in index:
                loaded[index[id(pc.param)]] = {k: small[f"optim.state.{pc.slot.name}.{k}"] if v is None else v
                                               for k, v in opt_state[id(pc.param)].items()}
    # The saved hyperparameters (a schedule's lr, ...) of every key this optimizer knows.
    opt.load_state_dict({"state": loaded, "param_groups": [{**cur, **{k: v for k, v in g.items() if k in cur}}
                                                           for g, cur in zip(groups, current)]})
