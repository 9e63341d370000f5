"""Export: a checkpoint's model as one safetensors file, with the model's own state_dict keys.

The file is written as a stream: its header first (every name, dtype, shape and offset is known from
the checkpoint's metadata), then the tensors in state_dict order, read from the shards a few at a
time (at most `batch_bytes`, or one tensor when it alone is larger). So the model never sits in
memory whole, let alone twice: the peak is about one batch plus the largest stored piece of one
tensor (StreamedSafetensors, which engine.save_pretrained uses too).

OUT is the file itself when it ends in `.safetensors`, else a folder holding `model.safetensors` and,
for a model that has a transformers config, `config.json`: a folder `from_pretrained` opens.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import struct
import sys
import time

import torch

from ..files.checkpoint_files import SafeReader, cause_line, dcp_load, read_extra, read_meta, read_sums, verify_all
from ..files.checkpoint_dirs import lease
from ..errors import CheckpointError
from ..files.weight_files import WEIGHTS

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def export(ckpt, out, dtype: torch.dtype | None = None, verify: bool = True, batch_bytes: int = 64 << 20,
           progress=None) -> str:
    """Write the model of checkpoint `ckpt` (a root or a checkpoint dir; for a tensor-parallel model
    the root holding tp0-of-N, ...: the TP ranks' shards are joined) to `out` (a .safetensors
    file, or a folder); returns the safetensors file's path. dtype: convert floating tensors
    (default: as saved, fp32 masters). batch_bytes: most bytes read from the shards at once (also at
    most half the largest shard).
    verify: check every file's checksum first. progress: called with one line of text now and then;
    by default a progress bar on stderr when it is a terminal, and the closing line."""
    try:
        with contextlib.ExitStack() as leases:  # no save removes what is being read (checkpoint_dirs)
            parts = [leases.enter_context(lease(d)) for d in tensor_parallel_dirs(ckpt) or [ckpt]]
            return _export(ckpt, parts, out, dtype, verify, batch_bytes, progress)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a damaged file DCP or torch could not read, a full disk, ...
        raise CheckpointError(f"zeroshard: export of {os.fspath(ckpt)} to {os.fspath(out)} failed: "
                              f"{cause_line(e)}") from e


def _export(ckpt, parts: list[str], out, dtype, verify: bool, batch_bytes: int, progress) -> str:
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    lines = progress  # None: a progress bar instead of lines while writing
    t0 = time.perf_counter()
    metas, largest = [], 0
    for part in parts:
        sums = read_sums(part)
        metas.append(read_meta(part, sums))
        largest = max([largest] + [os.path.getsize(os.path.join(part, n)) for n in sums if n.endswith(".distcp")])
        if verify:
            verify_all(part, sums)
        read_extra(part)  # not needed here, but a checkpoint zeroshard would not load is not exported either
    path, meta = parts[0], metas[0]
    split = _check_parts(parts, metas, ckpt)  # checkpoint key -> its TP layout, for a split parameter
    readers = [SafeReader(part).read_metadata().state_dict_metadata for part in parts]
    saved = readers[0]

    out = os.path.abspath(os.fspath(out))
    folder = not out.endswith(".safetensors")
    target = os.path.join(out, WEIGHTS) if folder else out
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # A batch well under the bound the issue sets (1.5 x the largest shard + one tensor).
    batch_bytes = min(batch_bytes, max(1 << 20, largest // 2))

    shapes = {f"model.{n}": tuple(shape) for n, shape, _ in meta["params"]}
    entries, begin = [], 0  # (output key, checkpoint key or None if empty, dtype, shape, first byte)
    for key in meta["state_dict_keys"]:
        source = "model." + meta["tied"].get(key, key)
        md = saved.get(source)
        if source in split:  # the whole tensor, joined from every TP rank's shards
            base = md.properties.dtype if md is not None else torch.float32
            want = dtype if dtype is not None and base.is_floating_point else base
            shape = tuple(split[source]["shape"])
            entries.append((key, source, want, shape, begin))
            begin += math.prod(shape) * want.itemsize
            continue
        if md is None:  # an empty parameter: no rank held any of it
            shape = shapes.get(source)
            if shape is None or math.prod(shape):
                raise CheckpointError(f"zeroshard: checkpoint {path} has no tensor {source!r}")
            entries.append((key, None, dtype or torch.float32, shape, begin))
            continue
        want = dtype if dtype is not None and md.properties.dtype.is_floating_point else md.properties.dtype
        if want not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"zeroshard: {key} is {want}, which safetensors cannot hold")
        entries.append((key, source, want, tuple(md.size), begin))
        begin += md.size.numel() * want.itemsize
    total = begin
    out_file = StreamedSafetensors(target, [(key, want, shape) for key, _, want, shape, _ in entries])
    try:
        _write(out_file, entries, _Sources(parts, readers, split), batch_bytes, total, lines)
        out_file.commit()
    except BaseException:
        out_file.abort()
        raise
    if folder and meta.get("hf_config") is not None:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(meta["hf_config"], f, indent=2)
    say(f"zeroshard export: {len(entries)} tensors, {total / 1e6:,.1f} MB to {target} in "
        f"{time.perf_counter() - t0:.1f} s")
    return target


def tensor_parallel_dirs(ckpt) -> list[str]:
    """The TP ranks' checkpoint roots under `ckpt` (tp0-of-N, tp1-of-N, ...: what save_checkpoint
    writes for a tensor-parallel model), in rank order; [] when `ckpt` is not such a root."""
    root = os.path.abspath(os.fspath(ckpt))
    found = {} if not os.path.isdir(root) else \
        {m.group(1, 2): n for n in os.listdir(root) if (m := re.fullmatch(r"tp(\d+)-of-(\d+)", n))}
    if not found:
        return []
    degrees = {int(n) for _, n in found}
    degree = max(degrees)
    missing = [f"tp{r}-of-{degree}" for r in range(degree) if (str(r), str(degree)) not in found]
    if len(degrees) > 1 or missing:
        raise CheckpointError(f"zeroshard: {root} holds tensor-parallel checkpoints of degrees {sorted(degrees)}"
                              + (f", without {', '.join(missing)}" if missing else "")
                              + ": one complete set is needed")
    return [os.path.join(root, f"tp{r}-of-{degree}") for r in range(degree)]


def _check_parts(parts: list[str], metas: list[dict], ckpt) -> dict[str, dict]:
    """The split parameters ("model.<name>" -> {"shape", "dim"}) of a tensor-parallel checkpoint
    whose TP ranks' parts are `parts`, after checking they belong together; {} for another."""
    tp = metas[0].get("tensor_parallel")
    if tp is None:
        return {}
    if len(parts) == 1:
        raise CheckpointError(f"zeroshard: {parts[0]} is TP rank {tp['rank']}'s part of a tensor-parallel checkpoint "
                              f"(degree {tp['degree']}): export the folder that holds tp0-of-{tp['degree']}, ... "
                              f"(export joins every TP rank's shards)")
    ranks = [m.get("tensor_parallel", {}).get("rank") for m in metas]
    if ranks != list(range(len(parts))) or len({m["steps"] for m in metas}) != 1:
        raise CheckpointError(f"zeroshard: the TP ranks' checkpoints in {os.fspath(ckpt)} do not belong together "
                              f"(ranks {ranks}, steps {[m['steps'] for m in metas]}): each tp<r>-of-N/latest "
                              "must name the same save")
    odd = [name for name, v in tp["split"].items() if v["dim"] is None]
    if odd:
        raise CheckpointError(f"zeroshard: export joins parameters split along one dimension (Shard); "
                              f"{', '.join(odd)} are laid out otherwise")
    return {"model." + name: v for name, v in tp["split"].items()}


class _Sources:
    """Reads checkpoint tensors by key: whole ones from the checkpoint, a split one (tensor
    parallelism) concatenated from every TP rank's shard along its dimension."""

    def __init__(self, parts: list[str], readers: list, split: dict):
        self.parts, self.readers, self.split = parts, readers, split

    def stored_bytes(self, source: str | None) -> int:
        """Bytes read for `source` (every TP rank's shard of a split tensor)."""
        return 0 if source is None else sum(saved[source].size.numel() * saved[source].properties.dtype.itemsize
                                            for saved in self.readers if source in saved)

    def read(self, sources: set[str]) -> dict[str, torch.Tensor]:
        pieces: dict[str, list[torch.Tensor]] = {}
        for r, (part, saved) in enumerate(zip(self.parts, self.readers)):
            wanted = [s for s in sources if (s in self.split or r == 0) and s in saved]
            state = {s: torch.empty(saved[s].size, dtype=saved[s].properties.dtype) for s in wanted}
            if state:
                try:
                    dcp_load(state, part)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:  # DCP's CheckpointException included
                    raise CheckpointError(f"zeroshard: the tensor files (__*.distcp) of {part} could not be read: "
                                          f"{cause_line(e)}") from e
            for s, t in state.items():
                pieces.setdefault(s, []).append(t)
        return {s: torch.cat(ts, dim=self.split[s]["dim"]) if s in self.split else ts[0] for s, ts in pieces.items()}


def _write(out: "StreamedSafetensors", entries, sources: _Sources, batch_bytes: int, total: int, say) -> None:
    from tqdm import tqdm
    written, next_report = 0, 0.1
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="zeroshard export", leave=False,
               disable=True if say is not None else None)  # None: shown on a terminal only
    with bar:
        i = 0
        while i < len(entries):
            batch, size = [], 0
            while i < len(entries) and (not batch or size + sources.stored_bytes(entries[i][1]) <= batch_bytes):
                batch.append(entries[i])
                size += sources.stored_bytes(entries[i][1])
                i += 1
            keys = {e[1] for e in batch} - {None}
            state = sources.read(keys) if keys else {}
            for key, source, want, shape, _ in batch:
                if source is None:
                    continue
                out.write(key, state[source])
                written += math.prod(shape) * want.itemsize
                bar.update(math.prod(shape) * want.itemsize)
            del state
            if say is not None and total and written / total >= next_report:
                say(f"zeroshard export: {written / 1e6:,.1f} / {total / 1e6:,.1f} MB")
                next_report = written / total + 0.1


PARTIAL = re.compile(r".+\.partial(-\d+)?")  # a file being written (StreamedSafetensors, an index)


def remove_partials(folder: str) -> list[str]:
    """Remove the partial files a save that never finished left in `folder` (a killed rank's).
    Returns their names."""
    gone = [n for n in os.listdir(folder) if PARTIAL.fullmatch(n)]
    for n in gone:
        os.remove(os.path.join(folder, n))
    return gone


class StreamedSafetensors:
    """One safetensors file written a tensor at a time, in any order: the header (every key, dtype
    and shape, so every offset) goes first, each tensor's bytes at its offset. Written to a temporary
    name; `commit()` syncs it, reads the header back with safetensors and renames it into place;
    `abort()` removes it. (The safetensors package writes only from tensors that are all in memory
    at once, hence the few lines below that write its documented format: an 8-byte little-endian
    header length, a JSON header padded to 8 bytes, the raw little-endian data.)"""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        if sys.byteorder != "little":  # tensors are written as they are in memory
            raise CheckpointError("zeroshard: safetensors is little-endian; this machine is not")
        self.path = path
        self.tmp = path + f".partial-{os.getpid()}"  # no half-written file under the real name
        header, self.entries, begin = {"__metadata__": metadata or {"format": "pt"}}, {}, 0
        for key, dtype, shape in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"zeroshard: {key} is {dtype}, which safetensors cannot hold")
            end = begin + math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [begin, end]}
            self.entries[key] = (dtype, tuple(shape), begin)
            begin = end
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.nbytes = begin  # of tensor data
        self.file = open(self.tmp, "wb")
        try:
            self.file.write(struct.pack("<Q", len(text)))
            self.file.write(text)
            self.file.truncate(self.data_start + begin)
        except BaseException:
            self.abort()
            raise

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write `key`'s value (converted to its declared dtype)."""
        dtype, shape, first = self.entries[key]
        t = tensor.detach().to("cpu", dtype).contiguous()
        if tuple(t.shape) != shape:  # a checkpoint's parts that disagree (export), or a bug
            raise CheckpointError(f"zeroshard: {key} has shape {tuple(t.shape)}, but the file's header says {shape}")
        if t.numel():  # the tensor's bytes as they are in memory (little-endian, as safetensors wants)
            self.file.seek(self.data_start + first)
            self.file.write((ctypes.c_char * (t.numel() * dtype.itemsize)).from_address(t.data_ptr()))

    def close(self) -> None:
        """Sync the data and read the header back (every key, with its shape)."""
        from safetensors import safe_open
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        with safe_open(self.tmp, framework="pt") as f:
            keys = set(f.keys())
            for key, (_, shape, _) in self.entries.items():
                if key not in keys or tuple(f.get_slice(key).get_shape()) != shape:
                    raise CheckpointError(f"zeroshard: {self.path} came out wrong at {key}")

    def rename(self) -> None:
        os.replace(self.tmp, self.path)

    def commit(self) -> None:
        self.close()
        self.rename()

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)
