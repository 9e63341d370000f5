"""Materialise: a model built on the meta device gets its values one tensor at a time, on the ranks
that keep that tensor, so that no rank ever holds the whole model (DeepSpeed's zero.Init, FSDP2's
meta-device construction).

How it works (meta model, initialiser path, materialising: docs/vocabulary.md):
- meta model: a model whose parameters and/or buffers are on torch's meta device (shapes and
  dtypes, no storage), as `with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)`
  builds it. Tensors already on a real device keep their values.
- initialiser path: for one tensor, the modules from its owner (the module holding it under its
  first name) up to the root. Each module on it contributes, in this order (torch's `apply` order,
  children before parents, which is also transformers' `initialize_weights` order):
  `init_fn(module)` when the user gives one; else the module's `reset_parameters()` (torch's own
  convention, and what a torch module's constructor ran; `_reset_parameters()` for
  nn.MultiheadAttention), then transformers' `_init_weights(module)` of the nearest PreTrainedModel
  at or above it.
- materialising a tensor: a real host tensor takes the meta tensor's place in its owner, alone (every
  other tensor stays on meta, where writes cost nothing and draw no random numbers), the initialiser
  path runs on it, and its value is taken out. The CPU generator is seeded before each initialiser
  from the base seed, the tensor's name and the initialiser's place on the path, so a tensor's value
  depends on nothing else: not the world size, stage, chunk size, nor which rank computes it. Values
  are therefore identical wherever computed (on the host, whatever the device), statistically what
  the normal constructor gives, but not the same numbers (those come from one shared RNG stream).
- written: an initialiser wrote into the tensor's storage (seen by a dispatch mode), or replaced
  it. A tensor no initialiser writes raises UninitializedTensorError, naming it: typically a custom
  module that fills an nn.Parameter or a buffer (`register_buffer("mask", torch.tril(...))`) in its
  constructor, which the meta device cannot replay. An initialiser that needs the values of other
  tensors (they are still on meta: `.item()`, copying from one) raises, and is reported the same
  way, as is a float tensor left partly unwritten (NaN, its fill before the initialisers run).
  Remedies: a `reset_parameters()` on that module, `init_fn`, weights from a file
  (`weights=`), or building that module on a real device (only meta tensors are materialised).
"""
from __future__ import annotations

import hashlib
import logging
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import UninitializedTensorError, WeightsError
from ..files.weight_files import WeightFiles, raise_on_every_rank, match
from ..distributed.tensor_parallel import as_dtensor, local, region, shard_of

log = logging.getLogger("zeroshard")


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device."""
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


class _Writes(TorchDispatchMode):
    """Records the storages that in-place and out= ops write, and refuses a write into a real tensor
    computed from a meta one (on meta it would silently leave the real tensor as it was)."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor) and not v.is_meta:
                    flat, _ = tree_flatten((args, kwargs))
                    if any(isinstance(x, torch.Tensor) and x.is_meta for x in flat):
                        raise UninitializedTensorError(f"{func} writes a real tensor from the value of a tensor still on "
                                           "the meta device")
                    self.storages.add(v.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(out, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else out


def _seed(base: int, name: str, step: int) -> int:
    digest = hashlib.sha256(f"{base}:{name}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MetaInit:
    """Computes the values of a meta model's tensors (see the module docstring). Failures are
    collected in `errors` rather than raised, so that every rank can learn of them together."""

    def __init__(self, root: nn.Module, seed: int = 0, init_fn: Callable[[nn.Module], None] | None = None):
        self.root = root
        self.seed = seed
        self.init_fn = init_fn
        self.errors: list[str] = []
        self._modules = dict(root.named_modules(remove_duplicate=False))

    def _path(self, name: str) -> list[str]:
        """Module names on the initialiser path of tensor `name`, owner first."""
        parts = name.split(".")[:-1]
        return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]

    def _initialisers(self, module_name: str) -> list[Callable[[], None]]:
        m = self._modules[module_name]
        if self.init_fn is not None:
            return [lambda: self.init_fn(m)]
        out = []
        reset = getattr(m, "reset_parameters", None)
        if reset is None and isinstance(m, nn.MultiheadAttention):
            reset = m._reset_parameters
        if callable(reset):
            out.append(reset)
        for owner in self._path(module_name + ".x" if module_name else "x"):  # m, then its ancestors
            pm = self._modules[owner]
            if callable(getattr(pm, "_init_weights", None)) and hasattr(pm, "config"):  # transformers
                out.append(lambda pm=pm: pm._init_weights(m))
                break
        return out

    @torch.no_grad()
    def value(self, name: str, meta: torch.Tensor) -> torch.Tensor | None:
        """The value of tensor `name` (a parameter or buffer name of the root; `meta` is it), on the
        host in its own dtype; None, with a line in `errors`, when no initialiser writes it.

        While the initialisers run, every other tensor of the model is on meta (real ones, such as
        buffers already given their values, are swapped for meta stand-ins): what they write
        elsewhere is lost and draws no random numbers, so the tensor's value depends on nothing but
        its own initialisers and seeds, and nothing else changes. Every module's parameter and buffer entries are restored
        afterwards, whatever the initialisers put in them."""
        owner_name, _, leaf = name.rpartition(".")
        owner = self._modules[owner_name]
        is_param = leaf in owner._parameters
        t = torch.empty(meta.shape, dtype=meta.dtype, device="cpu")
        if t.is_floating_point():
            t.fill_(float("nan"))  # a float left NaN was not (wholly) written
        stand_in = nn.Parameter(t, requires_grad=meta.requires_grad) if is_param else t
        if is_param:
            stand_in.__dict__.update(meta.__dict__)
        saved = {id(m): (m, dict(m._parameters), dict(m._buffers)) for m in self._modules.values()}
        for m, params, buffers in saved.values():
            for table, entries in ((m._parameters, params), (m._buffers, buffers)):
                for k, v in entries.items():
                    if v is not None and not v.is_meta:
                        table[k] = _meta_like(v)
        (owner._parameters if is_param else owner._buffers)[leaf] = stand_in
        writes, steps = _Writes(), []
        try:
            with torch.random.fork_rng(devices=[]):
                with writes:
                    for module_name in self._path(name):
                        for init in self._initialisers(module_name):
                            torch.default_generator.manual_seed(_seed(self.seed, name, len(steps)))
                            init()
                            steps.append(module_name or "<root>")
            got = (owner._parameters if is_param else owner._buffers)[leaf]
        except Exception as e:  # noqa: BLE001 -- reported on every rank by the caller
            self.errors.append(f"{name}: initialising it raised {type(e).__name__}: {e}")
            return None
        finally:
            for m, params, buffers in saved.values():
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
        if got is None or got.is_meta:
            written = False
        else:
            written = got is not stand_in or got.data_ptr() != t.data_ptr() or t.numel() == 0 \
                or t.untyped_storage().data_ptr() in writes.storages
            written = written and not (got.is_floating_point() and bool(got.isnan().any()))
        if not written:
            tried = ", ".join(f"{type(self._modules[m]).__name__} ({m or 'root'})" for m in self._path(name))
            self.errors.append(
                f"{name} ({type(owner).__name__}): no initialiser wrote all of it (looked at reset_parameters() "
                f"and transformers' _init_weights of {tried})")
            return None
        return got.detach()

    def fill(self, slot, lo: int, hi: int) -> torch.Tensor:
        """chunks.Fill for parameters on the meta device (zeros where initialising failed)."""
        v = self.value(slot.name, slot.param)
        if v is None:
            return torch.zeros(hi - lo)
        return shard_of(slot.param, v).reshape(-1)[lo:hi]  # a tensor-parallel parameter: its shard

    def materialize_buffers(self) -> None:
        """Give every meta buffer of the root its value, on the host (every rank keeps all buffers)."""
        for name, b in list(self.root.named_buffers()):
            if not b.is_meta:
                continue
            value = self.value(name, b)
            if value is None:
                value = torch.zeros(b.shape, dtype=b.dtype)
            for m in self._modules.values():  # a buffer shared by several modules is replaced in each
                for leaf, other in m._buffers.items():
                    if other is b:
                        m._buffers[leaf] = value


def leave_meta(params: list[nn.Parameter], device: torch.device) -> None:
    """Give each meta parameter empty storage on `device`, keeping the Parameter object (and so
    every reference to it: the module's, tied modules', a user's optimizer's). The chunks then point
    it at its values as for any other parameter."""
    for p in params:
        if p.is_meta:
            empty = torch.empty(0, dtype=p.dtype, device=device)
            # A tensor-parallel parameter stays a DTensor (its local tensor leaves meta).
            real = nn.Parameter(empty if p is local(p) else as_dtensor(p, empty), requires_grad=p.requires_grad)
            real.__dict__.update(p.__dict__)  # swap_tensors swaps the Python attributes too
            torch.utils.swap_tensors(p, real)


class InitialValues:
    """Where `zeroshard.initialize` takes each tensor's first value from: pretrained weights
    (`weights`, a folder or file WeightFiles reads) for the tensors they hold, rounded to the
    tensor's dtype as built (as `from_pretrained(torch_dtype=...)` loads them); else, for tensors on
    the meta device, their initialisers (MetaInit); else the model's own values, rank 0's (as DDP).

    `fill` (chunks.Fill) serves the chunks; buffers are given their values in `check`, at once.
    Tensors the weights do not hold keep the model's values (initialised, on meta), with a warning
    on rank 0, as `from_pretrained` does; unexpected keys are reported; a shape mismatch or an
    unreadable file is a WeightsError on every rank (`check`, before anything is built), and so is a
    read that fails later (`finish`).
    """

    def __init__(self, module: nn.Module, params: list[nn.Parameter], weights=None,
                 init_fn: Callable[[nn.Module], None] | None = None, seed: int = 0, allow_nonfinite: bool = False):
        self.module = module
        self.weights = weights
        self.meta = {id(p) for p in params if p.is_meta}
        self.init = MetaInit(module, seed, init_fn) if on_meta(module) else None
        if init_fn is not None and self.init is None:
            log.warning("init_fn is for a model built on the meta device; this one has no meta tensors, "
                        "so it is not called")
        self.files, self.source, self.problems, self.missing, self.unexpected = None, {}, [], [], []
        self.read_errors: list[str] = []  # reads that failed while the chunks were built (rank-local)
        if weights is not None:
            try:
                self.files = WeightFiles(weights, allow_nonfinite)
                m = match(self.files, module, list(module.state_dict(keep_vars=True).items()), {})
                self.problems = m.problems(strict=False)
                self.source, self.missing, self.unexpected = m.source, m.missing, m.unexpected
            except WeightsError as e:
                self.problems = [str(e)]
        self.broadcast = any(id(p) not in self.meta and id(p) not in self.source for p in params)

    def check(self, comm) -> None:
        """Collective with weights: raise WeightsError on every rank if any rank cannot read them;
        then give the buffers their values."""
        if self.weights is not None:
            raise_on_every_rank(comm, self.problems, what=f"cannot load {self.weights}:")
        if self.files is not None and comm.rank == 0 and (self.missing or self.unexpected):
            log.warning("%s: %d tensors not in the file keep the model's values (initialised, on the meta "
                        "device: %s); %d keys in the file are not in the model (%s)", self.weights,
                        len(self.missing), ", ".join(self.missing[:8]),
                        len(self.unexpected), ", ".join(self.unexpected[:8]))
        self._buffers()

    @torch.no_grad()
    def _buffers(self) -> None:
        values: dict[int, torch.Tensor] = {}  # a buffer shared by several modules stays one tensor
        for m in self.module.modules():
            for leaf, b in list(m._buffers.items()):
                key = self.source.get(id(b)) if b is not None else None
                if key is None:
                    continue
                if id(b) not in values:
                    try:
                        values[id(b)] = self.files.read_all(key).to(b.dtype)
                    except Exception as e:  # noqa: BLE001 -- raised on every rank by finish()
                        self.read_errors.append(f"reading {key}: {type(e).__name__}: {e}")
                        values[id(b)] = torch.zeros(b.shape, dtype=b.dtype)
                if b.is_meta:
                    m._buffers[leaf] = values[id(b)]
                else:
                    b.copy_(values[id(b)])
        if self.init is not None:
            self.init.materialize_buffers()

    def fill(self, slot, lo: int, hi: int):
        key = self.source.get(id(slot.param))
        if key is not None:
            return self._read(key, lo, hi, slot.param.dtype, region(slot.param))
        if id(slot.param) in self.meta:
            return self.init.fill(slot, lo, hi)
        return local(slot.param).detach().reshape(-1)[lo:hi]

    def _read(self, key: str, lo: int, hi: int, dtype: torch.dtype, where=None):
        """The file's blocks of [lo, hi), rounded to `dtype`; zeros for the rest of the range if a read
        fails (recorded, and raised on every rank by finish(): a rank alone must not stop here)."""
        done = lo
        try:
            for block in self.files.blocks(key, lo, hi, where):
                done += block.numel()
                yield block.to(dtype)
        except Exception as e:  # noqa: BLE001
            self.read_errors.append(f"reading {key}: {type(e).__name__}: {e}")
            if done < hi:
                yield torch.zeros(hi - done)

    def finish(self, comm, params: list[nn.Parameter], chunks, device: torch.device) -> None:
        """Collective, after the chunks are built (for a meta model, or with weights): raise
        WeightsError or UninitializedTensorError on every rank if any rank failed to read or to
        initialise a tensor; then point the (former meta) parameters at the chunks."""
        if self.files is not None:
            raise_on_every_rank(comm, self.read_errors, what=f"reading {self.weights} failed:")
        if self.init is not None:
            raise_on_every_rank(comm, self.init.errors, error=UninitializedTensorError,
                  what="some tensors of the model, built on the meta device, could not be initialised:")
        if self.meta:
            leave_meta(params, device)
            for c in chunks:
                c.attach_params()
