"""Reading pretrained weights: Hugging Face weight folders (and single files), a range at a time,
matched to a model's state_dict keys, with every check of a file's contents (pretrained.py uses
them, for initialize's `weights` and engine.load_weights).

How they are read (weight files, reading a range, matching: docs/vocabulary.md):
- weight files: `model.safetensors`, or a sharded set named by `model.safetensors.index.json` (its
  `weight_map`: key -> file), in a folder; or one `.safetensors` file (a `zeroshard export` output is
  either). `WeightFiles` reads any of them as one key -> tensor map. An index may name only files in
  its folder (`inside`).
- reading a range: a rank asks for elements [lo, hi) of a tensor, flattened; safetensors reads only
  the rows that hold them (a slice of the first dimension), from a file mapping opened for that one
  read, so that the pages it touched leave this process's memory with it. A block holding NaN or
  inf is refused unless allowed.
- matching: file keys are matched to the model's state_dict keys as `load_state_dict(strict=True)`
  matches them. Tied weights are one tensor under several keys: any one of its keys in the file
  gives its value, and a file holds it once. Keys that transformers models list as ignorable
  (`_keys_to_ignore_on_load_missing/unexpected`) are ignored, and the base model's prefix is added
  or removed when the file is of the base model (`GPT2Model` weights into `GPT2LMHeadModel`, as
  `from_pretrained` does). Anything else missing, unexpected, of another shape or of another kind
  of number (integers for floats) is a WeightsError that lists them all.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn

from ..errors import WeightsError
from ..numerics import all_finite

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
READ_BLOCK = 16 << 20  # bytes of a file mapped at once
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _kind(dtype: torch.dtype) -> str:
    """What kind of number a dtype holds: a value of one kind is not a value of another."""
    return "bool" if dtype == torch.bool else "complex" if dtype.is_complex else \
        "floating" if dtype.is_floating_point else "integer"


def _cache_blobs(folder: str) -> str | None:
    """The blob store of a Hugging Face cache snapshot folder (<repo>/snapshots/<rev> ->
    <repo>/blobs), or None for any other folder."""
    parent = os.path.dirname(os.path.realpath(folder))
    if os.path.basename(parent) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(parent), "blobs")
    return blobs if os.path.isdir(blobs) else None


def inside(folder: str, name) -> str:
    """The path of the file an index names `name` in `folder`, refused (WeightsError) unless it
    lies in the folder: a relative path with no '..' that leaves it, whose directories do not leave
    it through a symlink, and which, if a symlink itself, leads to a file in the folder, or (the
    Hugging Face cache, which keeps every file of a snapshot as a link into its blobs) in the blob
    store of the cache repository whose snapshot the folder is."""
    index = os.path.join(folder, INDEX)
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\0" in name:
        raise WeightsError(f"zeroshard: {index} names {name!r}, not a path relative to {folder}, so possibly outside "
                           "it: refused")
    norm = os.path.normpath(name)
    if norm == os.curdir or norm == os.pardir or norm.startswith(os.pardir + os.sep):
        raise WeightsError(f"zeroshard: {index} names {name!r}, outside {folder}: refused")
    home = os.path.realpath(folder)
    where = os.path.realpath(os.path.join(folder, os.path.dirname(norm)))
    if os.path.commonpath([home, where]) != home:
        raise WeightsError(f"zeroshard: {index} names {name!r}, which a symlinked directory takes outside {folder} "
                           f"(to {where}): refused")
    path = os.path.join(folder, norm)
    target = os.path.realpath(path)
    if os.path.islink(path) and os.path.commonpath([home, target]) != home:
        blobs = _cache_blobs(folder)
        if blobs is None or os.path.commonpath([blobs, target]) != blobs:
            raise WeightsError(f"zeroshard: {index} names {name!r}, a symlink to {target}, outside {folder} (and not "
                               "in the blobs of the Hugging Face cache it is a snapshot of): refused")
    return path


class WeightFiles:
    """A folder or file of safetensors weights (see the module docstring), read a range at a time.
    Blocks holding NaN or inf raise WeightsError, unless `allow_nonfinite` (config
    allow_nonfinite_weights, for a checkpoint that holds them on purpose)."""

    def __init__(self, path: str | os.PathLike, allow_nonfinite: bool = False):
        from safetensors import safe_open

        path = os.path.abspath(os.fspath(path))
        self.allow_nonfinite = allow_nonfinite
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, WEIGHTS)):  # transformers' order: the single file first
                files = [os.path.join(path, WEIGHTS)]
            elif os.path.exists(os.path.join(path, INDEX)):
                index = os.path.join(path, INDEX)
                try:
                    with open(index) as f:
                        weight_map = json.load(f).get("weight_map")
                except Exception as e:  # noqa: BLE001 -- named
                    raise WeightsError(f"zeroshard: cannot read {index}: {type(e).__name__}: {e}") from e
                if not isinstance(weight_map, dict):
                    raise WeightsError(f"zeroshard: {index}: 'weight_map' must map tensor names to file names, "
                                       f"not be {type(weight_map).__name__}")
                files = [inside(path, name) for name in dict.fromkeys(weight_map.values())]
            else:
                other = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
                raise WeightsError(f"zeroshard: {path} holds neither {WEIGHTS} nor {INDEX}" + (
                    f" ({', '.join(other)} are pickles, which zeroshard does not read: convert them to safetensors)"
                    if other else ""))
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            files = [path]
        else:
            raise WeightsError(f"zeroshard: {path} is neither a folder of safetensors weights nor a .safetensors file")
        self.path = path
        self.entries: dict[str, tuple[str, tuple[int, ...]]] = {}  # key -> (file, shape)
        self.dtypes: dict[str, torch.dtype] = {}
        for name in files:
            try:
                with safe_open(name, framework="pt") as f:
                    for key in f.keys():
                        s = f.get_slice(key)
                        self.entries[key] = (name, tuple(s.get_shape()))
                        dtype = _DTYPES.get(s.get_dtype())
                        if dtype is None:
                            raise WeightsError(f"zeroshard: {name}: tensor {key} is of dtype {s.get_dtype()!r}, "
                                               f"which zeroshard does not read (it reads {', '.join(_DTYPES)})")
                        self.dtypes[key] = dtype
            except WeightsError:
                raise
            except Exception as e:  # noqa: BLE001 -- a missing or damaged file, named
                raise WeightsError(f"zeroshard: cannot read {name}: {type(e).__name__}: {e}") from e

    def blocks(self, key: str, lo: int, hi: int, region=None) -> Iterator[torch.Tensor]:
        """Elements [lo, hi) of tensor `key`, flattened, in the file's dtype, as consecutive blocks of
        whole rows of at most READ_BLOCK bytes, each read through a mapping of its own (see the
        module docstring): a caller that writes each block away holds no more than one.
        `region`: (offset, shape) of a block of the tensor (a tensor-parallel shard,
        tensor_parallel.region); [lo, hi) then count the elements of that block, flattened."""
        from safetensors import safe_open

        name, whole = self.entries[key]
        offset, shape = region if region is not None else ((0,) * len(whole), whole)
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], shape[1:]))
        dtype = self.dtypes[key]
        row = math.prod(shape[1:]) if shape else 1
        if len(shape) == 0 or row == 0 or hi <= lo:
            with safe_open(name, framework="pt") as f:
                t = f.get_tensor(key)
                yield self._finite(key, (t[(slice(offset[0], offset[0] + shape[0]),) + inner] if region and shape
                                         else t).reshape(-1)[lo:hi].clone())
            return
        step = max(1, READ_BLOCK // (row * dtype.itemsize))
        end = -(-hi // row)
        for first in range(lo // row, end, step):
            last = min(end, first + step)
            with safe_open(name, framework="pt") as f:
                rows = f.get_slice(key)[(slice(offset[0] + first, offset[0] + last),) + inner].reshape(-1)
            a, b = max(lo, first * row), min(hi, last * row)
            yield self._finite(key, rows[a - first * row:b - first * row])

    def _finite(self, key: str, block: torch.Tensor) -> torch.Tensor:
        if not self.allow_nonfinite and block.is_floating_point() and not all_finite([block]):
            raise WeightsError(f"zeroshard: tensor {key} of {self.entries[key][0]} holds NaN or inf values: refused "
                               "(config allow_nonfinite_weights=True loads a checkpoint that holds them on purpose)")
        return block

    def read(self, key: str, lo: int, hi: int, region=None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` (of its `region`), flattened, in the file's dtype."""
        return torch.cat(list(self.blocks(key, lo, hi, region)))

    def read_all(self, key: str) -> torch.Tensor:
        shape = self.entries[key][1]
        return self.read(key, 0, math.prod(shape)).view(shape)


@dataclass
class Match:
    """How the model's tensors map to file keys."""

    source: dict[int, str] = field(default_factory=dict)  # id(tensor) -> file key holding its value
    missing: list[str] = field(default_factory=list)  # model keys with no value in the file
    unexpected: list[str] = field(default_factory=list)  # file keys the model does not have
    mismatched: list[str] = field(default_factory=list)  # "key: file shape vs model shape"
    wrong_kind: list[str] = field(default_factory=list)  # "key: file dtype vs model dtype", of another kind

    def problems(self, strict: bool) -> list[str]:
        out = [f"size mismatch for {m}" for m in self.mismatched] + \
            [f"dtype of another kind for {m}" for m in self.wrong_kind]
        if strict and self.missing:
            out.append("missing keys: " + ", ".join(self.missing))
        if strict and self.unexpected:
            out.append("unexpected keys: " + ", ".join(self.unexpected))
        return out


def _regexes(module: nn.Module, attr: str) -> list[re.Pattern]:
    return [re.compile(r) for r in (getattr(module, attr, None) or ())]


def match(files: WeightFiles, module: nn.Module, state_keys: list[tuple[str, object]],
          shapes: dict[int, torch.Size]) -> Match:
    """Match the file's keys to `state_keys` (the module's state_dict keys with their tensors;
    `shapes`: id(tensor) -> the model's shape, for parameters whose storage the chunks hold)."""
    keys_of: dict[int, list[str]] = {}
    shape_of: dict[int, torch.Size] = {}
    dtype_of: dict[int, torch.dtype | None] = {}
    for key, t in state_keys:
        keys_of.setdefault(id(t), []).append(key)
        shape_of[id(t)] = shapes.get(id(t), getattr(t, "shape", None))
        dtype_of[id(t)] = getattr(t, "dtype", None)
    expected = {k for ks in keys_of.values() for k in ks}
    in_file = {k: k for k in files.entries}
    prefix = getattr(module, "base_model_prefix", "") or ""
    if prefix:  # as from_pretrained: one side has the base model's prefix and the other has none
        p = prefix + "."
        file_has, model_has = any(k.startswith(p) for k in in_file), any(k.startswith(p) for k in expected)
        if model_has and not file_has:  # a base model's weights into a model with a head
            in_file = {p + k: k for k in files.entries}
        elif file_has and not model_has:  # a head model's weights into its base
            in_file = {(k[len(p):] if k.startswith(p) else k): k for k in files.entries}
    out = Match()
    ignore_missing = _regexes(module, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _regexes(module, "_keys_to_ignore_on_load_unexpected")
    for tid, keys in keys_of.items():
        found = [in_file[k] for k in keys if k in in_file]
        if not found:
            if not any(r.search(k) for r in ignore_missing for k in keys):
                out.missing.append(keys[0])
            continue
        got = files.entries[found[0]][1]
        want = tuple(shape_of[tid]) if shape_of[tid] is not None else None
        if want is not None and got != want:
            out.mismatched.append(f"{keys[0]}: the file has {list(got)}, the model {list(want)}")
            continue
        theirs, ours = files.dtypes[found[0]], dtype_of[tid]
        if ours is not None and _kind(theirs) != _kind(ours):  # an I32 read into float weights is garbage
            out.wrong_kind.append(f"{keys[0]}: the file holds {theirs}, the model {ours}")
            continue
        out.source[tid] = found[0]
    # A non-persistent buffer in an older checkpoint (position ids, rotary frequencies) is not
    # unexpected: the model computes it (transformers ignores it too).
    computed = {n for n, _ in module.named_buffers()} - expected
    out.unexpected = [fk for mk, fk in in_file.items()
                      if mk not in expected and mk not in computed and not any(r.search(mk) for r in ignore_unexpected)]
    return out


def raise_on_every_rank(comm, problems: list[str], error=WeightsError, what: str = "") -> None:
    """Collective: raise `error` on every rank if any rank has problems (listing every rank's)."""
    every = comm.all_gather_objects(problems)
    lines = list(dict.fromkeys(p for ps in every for p in ps))
    if lines:
        raise error(f"zeroshard: {what}" + "".join(f"\n  {line}" for line in lines))
