"""Pretrained weights in and out, in the Hugging Face layout, streamed so that no rank ever holds the
whole model.

Reading the files and matching their keys: weight_files.py.
- load_weights: each rank reads only the ranges its chunks keep, straight into them; every range
  is read once first when non-finite values are refused, so a refused file writes nothing.
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
from typing import Iterator

import torch
import torch.nn as nn

from .export import StreamedSafetensors, remove_partials
from ..distributed.tensor_parallel import region, whole_shape
from ..errors import ConfigError, WeightsError
from ..files.weight_files import INDEX, WEIGHTS, Match, WeightFiles, raise_on_every_rank, match
from ..runtime.placeholder import real_parameter
from .view import TrainingState

log = logging.getLogger("zeroshard")

@torch.no_grad()
def load_weights(view: TrainingState, path, strict: bool = True) -> Match:
    """See Engine.load_weights."""
    problems, m = [], None
    comm = view.world_comm  # a rank alone must not stop
    try:
        files = WeightFiles(path, view.config.allow_nonfinite_weights)
        shapes = {id(p): whole_shape(p, view.shapes[id(p)]) for p in view.params}
        m = match(files, view.module, view.state_keys, shapes)
        problems = m.problems(strict)
    except WeightsError as e:
        problems = [str(e)]
    raise_on_every_rank(comm, problems, what=f"cannot load {os.fspath(path)}:")
    params = {id(p) for p in view.params}
    reads = []  # what this rank reads: (chunk, slot, lo, hi, file key), its held range of each parameter
    for c in view.chunks:
        lo, hi = c.held_range()
        for s in c.slots:
            a, b = max(lo, s.offset) - s.offset, min(hi, s.offset + s.numel) - s.offset
            if id(s.param) in m.source and a < b:
                reads.append((c, s, a, b, m.source[id(s.param)]))
    buffers = [(t, m.source[id(t)]) for _, t in view.state_keys if id(t) in m.source and id(t) not in params]
    if not files.allow_nonfinite:  # read everything once before writing anything: a refusal changes nothing
        bad = []
        for c, s, a, b, key in reads:
            try:
                for _ in files.blocks(key, a, b, region(s.param)):
                    pass
            except Exception as e:  # noqa: BLE001 -- raised on every rank below
                bad.append(str(e) if isinstance(e, WeightsError) else f"rank {comm.rank}: {type(e).__name__}: {e}")
        for _, key in buffers:
            try:
                files.read_all(key)
            except Exception as e:  # noqa: BLE001
                bad.append(str(e) if isinstance(e, WeightsError) else f"rank {comm.rank}: {type(e).__name__}: {e}")
        raise_on_every_rank(comm, bad, what=f"cannot load {os.fspath(path)} (nothing was written):")
    failed = []
    try:
        for c, s, a, b, key in reads:
            c.write_blocks(s, a, files.blocks(key, a, b, region(s.param)))
        for t, key in buffers:  # a buffer: every rank keeps all of it
            t.copy_(files.read_all(key))
    except Exception as e:  # noqa: BLE001 -- raised on every rank below
        failed.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    raise_on_every_rank(comm, failed, what=f"loading {os.fspath(path)} failed part way (the model is partly loaded: "
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
    raise ConfigError(f"zeroshard: max_shard_size {size!r} is not bytes or a size such as '5GB'")


def _file_names(n: int) -> list[str]:
    return [WEIGHTS] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


@torch.no_grad()
def save_pretrained(view: TrainingState, path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                    submodule: str = "") -> str:
    """See Engine.save_pretrained."""
    path = os.path.abspath(os.fspath(path))
    if not submodule and adapter_marks(view.module):
        return save_adapter(view, path, dtype)
    # Every rank holds every value once gathered, so the files are shared out over the whole world.
    comm, limit = view.world_comm, shard_size(max_shard_size)
    module = view.module.get_submodule(submodule)  # AttributeError naming it when there is none
    prefix = submodule + "." if submodule else ""
    key_of = lambda name: name[len(prefix):] if name.startswith(prefix) else None  # noqa: E731
    # Every tensor once, in chunk order (the order values become available), then the buffers.
    order = [s.name for c in view.chunks for s in c.slots]
    if view.tp is not None:  # TP ranks may pack their shards apart; assembling follows TP rank 0
        order = view.tp.comm.broadcast_object(order)
    slots = {s.name: s for c in view.chunks for s in c.slots}
    tensors = [(key_of(n), dtype or torch.float32, whole_shape(slots[n].param, slots[n].shape)) for n in order
               if key_of(n) is not None]
    params, seen, buffers = {id(p) for p in view.params}, set(), {}
    for name, t in view.state_keys:
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
    if comm.rank == 0:  # a save that never finished (a killed rank) left its partial files: they go first
        try:
            os.makedirs(path, exist_ok=True)
            remove_partials(path)
        except OSError as e:
            problems.append(f"rank 0: {type(e).__name__}: {e}")
    raise_on_every_rank(comm, problems, what=f"save_pretrained to {path} failed (files already there are as they were):")
    try:
        _stream(view, path, order, buffers, names, files, file_of, key_of, mine)
    except BaseException:  # this rank's partial files go, whatever stopped the save (a lost peer too)
        for out in mine.values():
            if out is not None:
                out.abort()
        raise
    problems = []
    try:
        for out in mine.values():
            out.rename()
    except Exception as e:  # noqa: BLE001
        problems.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    # Every file is in place before the index names them (and stale files go).
    raise_on_every_rank(comm, problems, what=f"save_pretrained to {path} failed while renaming its files into place:")
    if comm.rank == 0:
        try:
            _finish_folder(module, path, names, files)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{type(e).__name__}: {e}")
    raise_on_every_rank(comm, problems, what=f"save_pretrained to {path}: the weights are saved, but finishing the folder failed:")
    return path


def _stream(view, path: str, order: list[str], buffers: dict, names: list[str], files: list, file_of: dict,
            key_of, mine: dict) -> None:
    """Collective: every value, gathered a chunk at a time, written by the rank that holds its file
    (`mine`: file index -> its StreamedSafetensors, made here); each rank's files synced and read
    back. A failure anywhere raises WeightsError on every rank, after every rank got this far."""
    comm, problems = view.world_comm, []
    try:
        for i in mine:
            mine[i] = StreamedSafetensors(os.path.join(path, names[i]), files[i])
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        problems.append(f"rank {comm.rank}: {type(e).__name__}: {e}")
    next_report = 0.25
    for done, (s, value) in enumerate(whole_values(view, order), 1):
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
    raise_on_every_rank(comm, problems, what=f"save_pretrained to {path} failed (files already there are as they were):")


def adapter_marks(module: nn.Module) -> tuple[str, ...]:
    """For a peft model (LoRA and the like), what every adapter tensor's name holds: ".<adapter
    name>." (peft names them `...q_proj.lora_A.default.weight`); () for any other model."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not hasattr(module, "get_base_model"):
        return ()
    return tuple(f".{name}." for name in configs)


def adapter_keys(module: nn.Module, held: dict) -> list[str]:
    """Every rank: the state-dict keys whose values peft's save_pretrained writes, found by running
    its selection (get_peft_model_state_dict, every adapter) over meta tensors of the values'
    shapes and keeping the keys whose meta tensors it returned. peft decides by method what it saves: besides
    names holding ".<adapter>.", a ParameterDict's entries (LoRA's embedding adapters, IA3's
    scales: "...lora_embedding_A.default"), modules_to_save, trainable tokens, and whole
    embedding layers where an embedding is targeted; a filter on names had left some out, and peft
    then wrote the adapter without them, silently, or raised a KeyError. `held`: the module's
    state_dict(keep_vars=True), the tensors themselves (no value is read)."""
    from peft.utils import get_peft_model_state_dict
    shapes = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in held.items()
              if isinstance(v, torch.Tensor)}
    key_of = {id(v): k for k, v in shapes.items()}
    keys = set()
    for adapter in module.peft_config:
        chosen = get_peft_model_state_dict(module, state_dict=shapes, adapter_name=adapter)
        keys |= {key_of[id(v)] for v in chosen.values() if id(v) in key_of}
    return [k for k in shapes if k in keys]


def save_adapter(view: TrainingState, path: str, dtype: torch.dtype | None) -> str:
    """Collective: a peft model's adapters in peft's own format (what `PeftModel.save_pretrained`
    writes, and `PeftModel.from_pretrained` opens): only the chunks holding what peft saves are
    gathered (`adapter_keys`), not the frozen base; every rank then runs peft's save_pretrained
    on those whole values, rank 0 writing (peft's is_main_process), since peft lists a
    modules_to_save module's keys from its state_dict(), at stage 3 a gather every rank makes."""
    held = view.module.state_dict(keep_vars=True)
    keys = adapter_keys(view.module, held)
    if view.tp is not None:
        keys = view.tp.comm.broadcast_object(keys)
    slots = [s for c in view.chunks for s in c.slots]
    position, slot_of = {s.name: i for i, s in enumerate(slots)}, {id(s.param): s.name for s in slots}
    # stage 3's placeholders stand for the slots' parameters; the keys of no slot are buffers
    names = {k: slot_of[id(real_parameter(held[k]))] for k in keys if id(real_parameter(held[k])) in slot_of}
    wanted = sorted(set(names.values()), key=position.__getitem__)  # chunk order: one gathered at a time
    cast = lambda t: t.to(dtype or torch.float32).cpu().clone()  # noqa: E731
    values = {s.name: cast(value) for s, value in whole_values(view, wanted)}
    state = {k: values[names[k]] if k in names else cast(held[k].detach()) for k in keys}
    problems = []
    try:
        view.module.save_pretrained(path, state_dict=state, is_main_process=view.world_comm.rank == 0)
    except Exception as e:  # noqa: BLE001 -- reported on every rank
        problems.append(f"{type(e).__name__}: {e}")
    raise_on_every_rank(view.world_comm, problems, what=f"saving the adapters to {path} failed:")
    return path


def whole_values(view: TrainingState, order: list[str]) -> Iterator[tuple[object, torch.Tensor]]:
    """Collective: (slot, the parameter's whole fp32 value) for each parameter named in `order`
    (every rank the same order), a chunk gathered over the data-parallel group when first needed
    and dropped for the next, a tensor-parallel parameter then assembled over its TP group: a rank
    holds one gathered chunk and one whole tensor at a time."""
    slot_of = {s.name: (c, s) for c in view.chunks for s in c.slots}
    current = full = None
    for name in order:
        c, s = slot_of[name]
        if c is not current:
            full = None
            with view.shards.uncounted():
                full = view.layout.full_fp32(c)
            current = c
        value = full[s.offset:s.offset + s.numel].view(s.shape)
        yield s, value if view.tp is None else view.tp.full_tensor(s.param, value)


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
