"""The files of one checkpoint, below the engine: DCP's writer and reader made safe (metadata as
JSON, tensors read weights_only), pieces of tensors as DCP boxes, checksums, and reading the side
files, each refusal a CheckpointError. checkpoint.py saves and checkpoint_load.py loads the engine's
state through them; export.py reads a checkpoint's model through them.

How pieces and files are written (root, tag, version, lease, piece: docs/vocabulary.md):
- a piece (or one of an elementwise optimizer state) is a run of the parameter's row-major
  elements. DCP stores tensors as boxes,
  so a piece goes to DCP as the few boxes its run covers (whole rows in the middle, part rows at the
  ends). Keys and shapes are the model's own, as in `model.state_dict()`; the checkpoint knows nothing
  of chunks, which is what makes it topology-independent.
- files of one checkpoint: DCP's `.metadata` (written as JSON by SafeWriter, not DCP's pickle) and
  `__<rank>_0.distcp` (tensors, which DCP reads with torch.load(weights_only=True)); `zeroshard.json`
  (what was saved: parameter names and shapes, tied names, optimizer state kinds, step counters, loss
  scale, config, a transformers config if the model has one); `extra.pt` (the user's dict, the
  optimizer's hyperparameters: plain data, read with weights_only=True); `checksums.json` (size and
  SHA-256 of every other file), written last. No file is unpickled into code: a tampered checkpoint
  (checksums rewritten too) is a CheckpointError, never code run by load_checkpoint or export.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .checkpoint_dirs import META, SUMS, write_file
from ..errors import CheckpointError, PeerLostError, PeerLostInCheckpointError
from ..distributed.ordering import peer_lost


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
        raise CheckpointError(f"zeroshard: no box of {index.fqn} starts at {tuple(index.offset)}")


class LazyPiece(Piece):
    """A Piece whose values are fetched as DCP writes each box: `get()` returns the 1-D values,
    valid until the next get of another piece (the disk tier's chunks, opened one at a time), so
    a save never holds them all. Each box is copied out (a parameter's size at most)."""

    def __init__(self, get, numel: int, dtype: torch.dtype, shape: torch.Size, start: int):
        self._get = get
        super().__init__(torch.empty(numel, dtype=dtype, device="meta"), shape, start)

    def _box(self, offsets, sizes, at) -> torch.Tensor:
        return self._get()[at:at + math.prod(sizes)].view(sizes).clone()


class SavePlanner(DefaultSavePlanner):
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
