"""Pretrained weights in and out, in the Hugging Face layout, streamed so that no rank ever holds the
whole model.

Vocabulary:
- weight files: `model.safetensors`, or a sharded set named by `model.safetensors.index.json` (its
  `weight_map`: key -> file), in a folder; or one `.safetensors` file (a `zeroshard export` output is
  either). `WeightFiles` reads any of them as one key -> tensor map.
- reading a range: a rank asks for elements [lo, hi) of a tensor, flattened; safetensors reads only
  the rows that hold them (a slice of the first dimension), from a file mapping opened for that one
  read, so that the pages it touched leave this process's memory with it.
- matching: file keys are matched to the model's state_dict keys as `load_state_dict(strict=True)`
  matches them. Tied weights are one tensor under several keys: any one of its keys in the file
  gives its value, and a file holds it once. Keys that transformers models list as ignorable
  (`_keys_to_ignore_on_load_missing/unexpected`) are ignored, and the base model's prefix is added
  or removed when the file is of the base model (`GPT2Model` weights into `GPT2LMHeadModel`, as
  `from_pretrained` does). Anything else missing, unexpected or of another shape is a WeightsError
  that lists them all.
- save_pretrained: the values are taken chunk by chunk (each gathered in fp32 from the masters on
  every rank, one chunk at a time), and the files of the set are written by the ranks in turn (file
  i by rank i mod world), each at its place in its file (export.StreamedSafetensors). So a rank
  holds at most one gathered chunk. The folder has one file, or several of at most
  `max_shard_size` bytes with an index, and the model's transformers config: `from_pretrained`
  opens it. Writing needs every rank to see the same folder (a shared file system on several nodes).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn as nn

from .export import WEIGHTS, StreamedSafetensors
from .tensor_parallel import region, whole_shape

log = logging.getLogger("zeroshard")

INDEX = "model.safetensors.index.json"
READ_BLOCK = 16 << 20  # bytes of a file mapped at once
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class WeightsError(RuntimeError):
    """Pretrained weights could not be loaded or saved: unreadable files, or keys missing,
    unexpected or of the wrong shape (all listed). Raised on every rank."""


class WeightFiles:
    """A folder or file of safetensors weights (see the module docstring), read a range at a time."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        path = os.path.abspath(os.fspath(path))
        if os.path.isdir(path):
            if os.path.exists(os.path.join(path, WEIGHTS)):  # transformers' order: the single file first
                files = [os.path.join(path, WEIGHTS)]
            elif os.path.exists(os.path.join(path, INDEX)):
                try:
                    with open(os.path.join(path, INDEX)) as f:
                        weight_map = json.load(f)["weight_map"]
                except Exception as e:  # noqa: BLE001 -- named
                    raise WeightsError(f"zeroshard: cannot read {os.path.join(path, INDEX)}: {type(e).__name__}: {e}") \
                        from e
                files = [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
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
                        self.dtypes[key] = _DTYPES.get(s.get_dtype(), torch.float32)
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
                yield (t[(slice(offset[0], offset[0] + shape[0]),) + inner] if region and shape else t) \
                    .reshape(-1)[lo:hi].clone()
            return
        step = max(1, READ_BLOCK // (row * dtype.itemsize))
        end = -(-hi // row)
        for first in range(lo // row, end, step):
            last = min(end, first + step)
            with safe_open(name, framework="pt") as f:
                rows = f.get_slice(key)[(slice(offset[0] + first, offset[0] + last),) + inner].reshape(-1)
            a, b = max(lo, first * row), min(hi, last * row)
            yield rows[a - first * row:b - first * row]

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

    def problems(self, strict: bool) -> list[str]:
        out = [f"size mismatch for {m}" for m in self.mismatched]
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
    for key, t in state_keys:
        keys_of.setdefault(id(t), []).append(key)
        shape_of[id(t)] = shapes.get(id(t), getattr(t, "shape", None))
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
        out.source[tid] = found[0]
    # A non-persistent buffer in an older checkpoint (position ids, rotary frequencies) is not
    # unexpected: the model computes it (transformers ignores it too).
    computed = {n for n, _ in module.named_buffers()} - expected
    out.unexpected = [fk for mk, fk in in_file.items()
                      if mk not in expected and mk not in computed and not any(r.search(mk) for r in ignore_unexpected)]
    return out


def agree(comm, problems: list[str], error=WeightsError, what: str = "") -> None:
    """Collective: raise `error` on every rank if any rank has problems (listing every rank's)."""
    every = comm.all_gather_objects(problems)
    lines = list(dict.fromkeys(p for ps in every for p in ps))
    if lines:
        raise error(f"zeroshard: {what}" + "".join(f"\n  {line}" for line in lines))


@torch.no_grad()
def load_weights(engine, path, strict: bool = True) -> Match:
    """See Engine.load_weights."""
    problems, m = [], None
    comm = engine.world_comm  # a rank alone must not stop
    try:
        files = WeightFiles(path)
        shapes = {id(p): whole_shape(p, engine.shapes[id(p)]) for p in engine.params}
        m = match(files, engine.module, engine.state_keys, shapes)
        problems = m.problems(strict)
    except WeightsError as e:
        problems = [str(e)]
    agree(comm, problems, what=f"cannot load {os.fspath(path)}:")
    failed = []
    try:
        for c in engine.chunks:
            lo, hi = c.held_range()
            for s in c.slots:
                key = m.source.get(id(s.param))
                a, b = max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset
                if key is not None and a < b:
                    c.write_blocks(s, a, files.blocks(key, a, b, region(s.param)))
        params = {id(p) for p in engine.params}
        for _, t in engine.state_keys:
            key = m.source.get(id(t))
            if key is not None and id(t) not in params:  # a buffer: every rank keeps all of it
                t.copy_(files.read_all(key))
    except Exception as e:  # noqa: BLE001 -- raised on every rank below
        failed.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    agree(comm, failed, what=f"loading {os.fspath(path)} failed part way (the model is partly loaded: "
                             "load again or restore a checkpoint):")
    if comm.rank == 0 and (m.missing or m.unexpected):
        log.warning("loaded %s with %d keys missing (%s) and %d unexpected (%s)", path, len(m.missing),
                    ", ".join(m.missing[:8]), len(m.unexpected), ", ".join(m.unexpected[:8]))
    return m


def shard_size(size: int | str) -> int:
    """Bytes from an int or a string such as '5GB' or '500MiB'."""
    if isinstance(size, int):
        return size
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    text = size.strip().upper()
    for unit, scale in units.items():
        if text.endswith(unit) and text[:-len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[:-len(unit)]) * scale)
    raise ValueError(f"zeroshard: max_shard_size {size!r} is not bytes or a size such as '5GB'")


def _file_names(n: int) -> list[str]:
    return [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


@torch.no_grad()
def save_pretrained(engine, path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                    submodule: str = "") -> str:
    """See Engine.save_pretrained."""
    path = os.path.abspath(os.fspath(path))
    if not submodule and adapter_marks(engine.module):
        return save_adapter(engine, path, dtype)
    # Every rank holds every value once gathered, so the files are shared out over the whole world.
    comm, limit = engine.world_comm, shard_size(max_shard_size)
    module = engine.module.get_submodule(submodule)  # AttributeError naming it when there is none
    prefix = submodule + "." if submodule else ""
    key_of = lambda name: name[len(prefix):] if name.startswith(prefix) else None  # noqa: E731
    # Every tensor once, in chunk order (the order values become available), then the buffers.
    order = [s.name for c in engine.chunks for s in c.slots]
    if engine.tp is not None:  # TP ranks may pack their shards apart; assembling follows TP rank 0
        order = engine.tp.comm.broadcast_object(order)
    slots = {s.name: s for c in engine.chunks for s in c.slots}
    tensors = [(key_of(n), dtype or torch.float32, whole_shape(slots[n].param, slots[n].shape)) for n in order
               if key_of(n) is not None]
    params, seen, buffers = {id(p) for p in engine.params}, set(), {}
    for name, t in engine.state_keys:
        key = key_of(name)
        if key is not None and id(t) not in params and id(t) not in seen and torch.is_tensor(t):
            seen.add(id(t))
            buffers[key] = t
            tensors.append((key, dtype if dtype is not None and t.is_floating_point() else t.dtype, tuple(t.shape)))
    files, size = [[]], 0
    for key, dt, shape in tensors:
        nbytes = math.prod(shape) * dt.itemsize
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append((key, dt, shape))
        size += nbytes
    names = _file_names(len(files))
    file_of = {key: i for i, f in enumerate(files) for key, _, _ in f}
    mine = {i: None for i in range(len(files)) if i % comm.world == comm.rank}
    problems = []
    try:
        os.makedirs(path, exist_ok=True)
        for i in mine:
            mine[i] = StreamedSafetensors(os.path.join(path, names[i]), files[i])
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        problems.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    next_report = 0.25
    for done, (s, value) in enumerate(whole_values(engine, order), 1):
        key = key_of(s.name)
        out = None if key is None else mine.get(file_of[key])
        if out is not None and not problems:
            try:
                out.write(key, value)
            except Exception as e:  # noqa: BLE001
                problems.append(f"rank {comm.rank}: writing {s.name}: {type(e).__name__}: {e}")
        if comm.rank == 0 and done / len(order) >= next_report:
            log.info("save_pretrained %s: %d%%", path, int(100 * done / len(order)))
            next_report += 0.25
    for key, t in buffers.items():
        out = mine.get(file_of[key])
        if out is not None and not problems:
            try:
                out.write(key, t)
            except Exception as e:  # noqa: BLE001
                problems.append(f"rank {comm.rank}: writing {key}: {type(e).__name__}: {e}")
    for out in mine.values():
        try:
            if out is not None and not problems:
                out.close()
        except Exception as e:  # noqa: BLE001
            problems.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    try:
        agree(comm, problems, what=f"save_pretrained to {path} failed (files already there are as they were):")
    except WeightsError:
        for out in mine.values():
            if out is not None:
                out.abort()
        raise
    try:
        for out in mine.values():
            out.rename()
    except Exception as e:  # noqa: BLE001
        problems.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    # Every file is in place before the index names them (and stale files go).
    agree(comm, problems, what=f"save_pretrained to {path} failed while renaming its files into place:")
    if comm.rank == 0:
        try:
            _finish_folder(module, path, names, files)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{type(e).__name__}: {e}")
    agree(comm, problems, what=f"save_pretrained to {path}: the weights are saved, but finishing the folder failed:")
    return path


def adapter_marks(module: nn.Module) -> tuple[str, ...]:
    """For a peft model (LoRA and the like), what every adapter tensor's name holds: ".<adapter
    name>." (peft names them `...q_proj.lora_A.default.weight`); () for any other model."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(module, "get_base_model"):
        return ()
    return tuple(f".{name}." for name in configs)


def save_adapter(engine, path: str, dtype: torch.dtype | None) -> str:
    """Collective: a peft model's adapters in peft's own format (what `PeftModel.save_pretrained`
    writes, and `PeftModel.from_pretrained` opens): only the chunks holding adapter tensors are
    gathered, never the frozen base; rank 0 hands peft their whole values to write."""
    marks = adapter_marks(engine.module)
    order = [s.name for c in engine.chunks for s in c.slots if any(m in s.name for m in marks)]
    if engine.tp is not None:
        order = engine.tp.comm.broadcast_object(order)
    state = {s.name: value.to(dtype or torch.float32).cpu().clone() for s, value in whole_values(engine, order)}
    problems = []
    if engine.world_comm.rank == 0:
        try:
            engine.module.save_pretrained(path, state_dict=state)
        except Exception as e:  # noqa: BLE001 -- reported on every rank
            problems.append(f"{type(e).__name__}: {e}")
    agree(engine.world_comm, problems, what=f"saving the adapters to {path} failed:")
    return path


def whole_values(engine, order: list[str]) -> Iterator[tuple[object, torch.Tensor]]:
    """Collective: (slot, the parameter's whole fp32 value) for each parameter named in `order`
    (every rank the same order), a chunk gathered over the data-parallel group when first needed
    and dropped for the next, a tensor-parallel parameter then assembled over its TP group: a rank
    holds one gathered chunk and one whole tensor at a time."""
    slot_of = {s.name: (c, s) for c in engine.chunks for s in c.slots}
    current = full = None
    for name in order:
        c, s = slot_of[name]
        if c is not current:
            full = None
            engine.comm.counting = False  # not step traffic
            try:
                full = engine.layout.full_fp32(c)
            finally:
                engine.comm.counting = True
            current = c
        value = full[s.offset:s.offset + s.numel].view(s.shape)
        yield s, value if engine.tp is None else engine.tp.full_tensor(s.param, value)


def _finish_folder(module: nn.Module, path: str, names: list[str], files: list) -> None:
    """Rank 0: remove weight files of an earlier save that the new set does not have, write the
    index (several files) and the model's transformers config."""
    stale = [n for n in os.listdir(path) if (n == WEIGHTS or n == INDEX or re.fullmatch(
        r"model-\d{5}-of-\d{5}\.safetensors", n)) and n not in names]
    for n in stale:
        os.remove(os.path.join(path, n))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for f in files for _, d, s in f)},
                 "weight_map": {key: names[i] for i, f in enumerate(files) for key, _, _ in f}}
        tmp = os.path.join(path, INDEX + ".partial")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(path, INDEX))
    config = getattr(module, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(path)
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(path)
