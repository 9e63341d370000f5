"""Module hooks: where the model's execution drives chunk gathers and releases (stage 3), and where
the first-use order of parameters is recorded (every stage).

Stage 3 lifecycle of one module call:
  forward pre-hook   acquire (gather + pin) the module's chunks; put the real parameters in its entries
  forward post-hook  put placeholders back; unpin; register a pre-backward hook on the outputs
  pre-backward       acquire the chunks again and *hold* them for this module's backward (a leaf
                     unit's real parameters stay in its entries while held: _shows_while_held)
  gradient arrival   once every trainable direct parameter of the module has its gradient, the hold
                     ends (the engine calls `grad_arrived`); holds still open end with the backward.

Tensors that autograd saves for backward and that are views of a gathered chunk (a weight saved by
a matmul) are saved as a `ChunkView` (chunk, offset, size, stride) instead, and re-read from the
chunk, gathered again by then, in backward: otherwise every saved weight would keep its gathered
chunk alive from forward to backward and stage 3 would hold the whole model at its peak.

Outside its module's forward, a stage-3 parameter's entries hold a `ShardedPlaceholder`
(placeholder.py) with the parameter's shape, dtype and device: metadata reads work, any computation
raises an error that names the parameter, instead of silently reading a freed buffer. One exception:
a module whose forward reads a parameter of a submodule that does not run (nn.MultiheadAttention
reads out_proj.weight) *borrows* it: the parameter is gathered on the spot, and from then on it belongs to the borrowing module's
unit (gathered, held for backward and released with that module's own parameters). And a parameter
read outside every forward (CLIP's logit_scale in the user's contrastive loss; a method other than
forward reading its module's own) is read as if its unit were called around that one operation:
gathered, released after it and gathered again for the backward of what it computed (Stage3Hooks.used).
A write into a parameter, there or in a forward, is kept in the shard (param_writes.py's Note:
writes into parameters).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from .cache import in_step
from .chunks import ChunkState
from .param_writes import WrittenParameters
from .unit_boundaries import AfterUnitBackward, unit_outputs
from .weak_calls import weak_method
from .placeholder import ShardedPlaceholder
from ..errors import EngineCallError, ShardedParameterError
from ..units import BackwardHolds, direct_params, unit_members


class ChunkView:
    """A saved tensor that is a view of a gathered stage-3 chunk, kept as a reference."""

    __slots__ = ("chunk", "size", "stride", "offset")

    def __init__(self, chunk, t: torch.Tensor):
        self.chunk, self.size, self.stride, self.offset = chunk, t.size(), t.stride(), t.storage_offset()


def _storage(t) -> int | None:
    """Where a plain tensor's (or a parameter's) storage is; None for anything else."""
    strided = type(t) in (torch.Tensor, nn.Parameter) and t.layout is torch.strided
    return t.untyped_storage().data_ptr() if strided else None


class Stage3Hooks:
    """Installs and runs the stage-3 module hooks, one pair per unit (units.py). `chunks_of(unit)`
    gives the chunks holding a unit's parameters, `params_of(unit)` (it changes if the engine
    re-packs chunks); `on_borrow(unit)` is told when a unit's parameters grew by a borrowed one;
    `on_leaf_backward(params)` when the gradient has gone back through a leaf unit with these
    parameters (those that got none will get none in this pass); `on_write(params)` is given
    parameters written in place, while their chunks are gathered (param_writes.py)."""

    def __init__(self, model: nn.Module, cache, chunks_of, names: dict[int, str],
                 shapes: dict[int, torch.Size], dtype: torch.dtype, on_borrow=lambda module: None,
                 leaves=(), on_leaf_backward=lambda params: None, on_write=lambda params: None):
        self.cache = cache
        self.chunks_of = chunks_of
        self.units = unit_members(model, list(leaves))  # unit -> modules whose own parameters it gathers
        self.leaves = {m for m in leaves}
        self.unit_of = {member: unit for unit, members in self.units.items() for member in members}
        self.direct: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}  # member -> its own parameters
        self.placeholders: dict[nn.Module, list[tuple[str, ShardedPlaceholder]]] = {}  # member -> stand-ins
        self.real: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}  # unit -> every parameter it gathers
        self.owners: dict[int, list[nn.Module]] = {}  # id(param) -> units that gather it
        # unit -> (owner module, name, parameter) it borrowed (see the module docstring)
        self.borrowed: dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        self._entry: dict[int, tuple[nn.Module, str, nn.Parameter]] = {}  # id(placeholder) -> where it stands in
        self._ids: dict[nn.Module, set[int]] = {}  # unit -> ids of params_of(unit), made at its first use
        self.on_borrow = on_borrow
        self.on_leaf_backward = on_leaf_backward
        borrow, used = weak_method(self.borrow), weak_method(self.used)
        self._outside: list[nn.Module] = []  # units called around the one operation now reading their parameters
        self._lent: list[tuple] = []  # (units, chunks, weak views) kept gathered for a view (settle_lent)
        # One placeholder per parameter, in every entry that holds it (tied weights): the module's
        # parameters() then lists it once, as torch lists a tied parameter once.
        stand_in: dict[int, ShardedPlaceholder] = {}
        for unit, members in self.units.items():
            seen = set()
            self.real[unit] = []
            for m in members:
                self.direct[m] = direct_params(m)
                self.placeholders[m] = []
                for n, p in self.direct[m]:
                    t = stand_in.get(id(p))
                    if t is None:
                        t = stand_in[id(p)] = ShardedPlaceholder(p, shapes[id(p)], dtype, names[id(p)])
                        t._zs_borrow, t._zs_used, t._zs_param = borrow, used, p
                        self._entry[id(t)] = (m, n, p)
                    self.placeholders[m].append((n, t))
                    if id(p) not in seen:
                        seen.add(id(p))
                        self.real[unit].append((n, p))
                        self.owners.setdefault(id(p), []).append(unit)
            self._swap(unit, real=False)
        self.writes = WrittenParameters({id(p): p for ps in self.real.values() for _, p in ps}.values(), on_write)
        # unit -> ids of params whose grads are pending; None: a leaf, whose hold ends when the
        # gradient reaches its inputs (AfterUnitBackward)
        self.held = BackwardHolds(self.owners)
        # Unit calls whose forward started but has not ended. Non-reentrant checkpointing stops a
        # recomputation early by raising inside the forward, so some never end: they are closed
        # when backward ends (and an exception in a user's forward leaves some for the next call).
        self.active: list[nn.Module] = []
        self._step = True  # the outermost forward running belongs to a training step (_pre_forward)
        self.in_backward = False
        self.whole = False  # inside full_parameters(): every parameter holds its whole value, no gather
        self._handles = []
        for m in self.units:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward_unit, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_forward))
        # The root as the one unit (compiled whole: compiled.py's Note: one chunk): a module of it
        # called outside its forward (an input embedding, as peft and multimodal code call it before
        # the model) runs as a call of the root, gathered, held for backward and released.
        # Every module of it, not only those holding parameters: a parent reads its ParameterList's.
        self.root = model if model in self.leaves else None
        self._calls: list[nn.Module | None] = []  # per module call running: itself if it began a root call
        for m in (self.root.modules() if self.root is not None else ()):
            if m is not model:
                self._handles.append(m.register_forward_pre_hook(self._pre_forward_outside))
                self._handles.append(m.register_forward_hook(self._post_forward_outside))

    def is_unit(self, module: nn.Module) -> bool:
        return module in self.real

    def params_of(self, unit: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """A unit's parameters and those it borrowed."""
        return self.real[unit] + [(n, p) for _, n, p in self.borrowed.get(unit, ())]

    def direct_real(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """A module's own parameters (the real ones, whatever its entries hold now)."""
        return self.direct[module]

    def borrow(self, placeholder: ShardedPlaceholder, through_data: bool, in_place: bool) -> nn.Parameter | None:
        """The real parameter behind `placeholder`, gathered (None: refused). In a unit's forward it
        joins the innermost running unit from now on; outside every forward its own unit is called
        around the operation (`used` ends it), unless the operation reads its `.data` (a write
        through it would go unseen: param_writes.py). `in_place`: the operation writes in place."""
        if self._lent:
            self.settle_lent(whose_views_died=True)
        owner, name, p = self._entry[id(placeholder)]
        if not self.active or self.active[-len(self._outside):] == self._outside:
            if through_data or torch.compiler.is_compiling():
                return None
            unit = self.unit_of[owner]
            if unit not in self.active:
                # an in-place op (nn.init under grad mode) is no use of the step's schedule
                self._pre_forward(unit, (), step=in_step() and not in_place)
                self._outside.append(unit)
            return p
        m = self.active[-1]
        entries = self.borrowed.setdefault(m, [])
        if all(q is not p for _, _, q in entries):
            before = list(self.chunks_of(m))
            entries.append((owner, name, p))
            self._ids.pop(m, None)
            self.owners.setdefault(id(p), []).append(m)
            self.on_borrow(m)
            for c in self.chunks_of(m):  # released with m's own when its forward ends
                if c not in before:
                    self.cache.acquire(c, recorded=self._step)
            owner._parameters[name] = p
        return p

    def used(self, out):
        """After an operation that read parameters outside every forward (borrow; `out`: what it
        returned, None if it raised): their units end as a forward ends. Returns what the caller gets."""
        begun, self._outside = self._outside, []
        self._lend_if_viewed(out, begun)
        try:
            while begun:
                replaced = self._post_forward(begun.pop(), (), out)
                out = out if replaced is None else replaced
        finally:  # a write that could not be kept raised (param_writes.py): the others end all the same
            while begun:
                self._end_forward(begun.pop(), check=False)
        return out

    def _lend_if_viewed(self, out, units) -> None:
        """What an operation outside every forward returned views a parameter of `units` (`p[0]`,
        `p.T`, `p.detach()`): a write through it (`p[0].fill_(v)`, `torch._foreach_mul_` of a list
        of such views) comes after the operation, so their chunks stay gathered while a view lives,
        and at most until the next forward, step or read of the shards (settle_lent), which keeps
        what was written (param_writes.py)."""
        chunks = [c for unit in units for c in self.chunks_of(unit)]
        storages = {c.full.untyped_storage().data_ptr() for c in chunks if c.full is not None}
        params = {id(p) for unit in units for _, p in self.params_of(unit)}  # p.clamp_() returns p: checked already
        flat, _ = tree_flatten(out)
        views = [weakref.ref(t) for t in flat if id(t) not in params and _storage(t) in storages]
        if views:
            for c in chunks:
                self.cache.pin(c)
            self._lent.append((list(units), chunks, views))

    def settle_lent(self, whose_views_died: bool = False) -> None:
        """Keep what was written through views of parameters lent outside every forward, and release
        their chunks (_lend_if_viewed): all of them, or those whose views are gone (before the next
        operation on a parameter: a view still held may yet be written through)."""
        lent, self._lent, done = self._lent, [], []
        for e in lent:
            (self._lent if whose_views_died and any(v() is not None for v in e[2]) else done).append(e)
        try:
            units = dict.fromkeys(u for e in done for u in e[0])
            self.writes.check(p for unit in units for _, p in self.params_of(unit))
        finally:
            for _, chunks, _ in done:
                for c in chunks:
                    self.cache.release(c)

    def _swap_borrowed(self, unit: nn.Module, real: bool) -> None:
        for owner, name, p in self.borrowed.get(unit, ()):
            if real:
                owner._parameters[name] = p
            elif self.unit_of[owner] not in self.active:
                owner._parameters[name] = next(t for n, t in self.placeholders[owner] if n == name)

    def show_real_parameters(self, real: bool) -> None:
        """Put the real parameters, holding their whole values, in every module's entries (True),
        or the placeholders back (the caller kept whatever was written into them meanwhile). A
        forward in between gathers nothing; one recording gradients raises."""
        self.whole = real
        for unit in self.units:
            self._swap(unit, real)
        if not real:
            self.writes.rebase()

    def absorb_copies(self, module: nn.Module, on: bool) -> None:
        """While `module` loads a state dict whose values module_state.py already wrote into the
        shards: its placeholders take torch's copy into them as done."""
        for _, t in self.placeholders[module]:
            t._zs_absorb_copies = on

    def _show(self, unit: nn.Module, real: bool) -> None:
        """Put the unit's real parameters (and those it borrowed) in their entries, or placeholders."""
        self._swap(unit, real)
        self._swap_borrowed(unit, real)

    def _swap(self, unit: nn.Module, real: bool) -> None:
        # an entry holding another tensor (torch.func.functional_call's, for its call) keeps it
        for m in self.units[unit]:
            for (n, p), (_, t) in zip(self.direct[m], self.placeholders[m]):
                now = m._parameters.get(n)
                if now is None or now is p or now is t:
                    m._parameters[n] = p if real else t

    def _pre_forward(self, unit, args, step: bool | None = None):
        """`step`: given for an operation outside every forward (borrow), whether it is a use of the step."""
        if self.whole:
            if torch.is_grad_enabled():  # its saved parameters would lose their values at the exit
                raise EngineCallError("zeroshard: a forward recording gradients inside full_parameters() at stage 3: "
                                      "run it under torch.no_grad(), or train outside full_parameters()")
            return
        if step is None and self._lent:  # a forward: whatever views lent before it were written through
            self.settle_lent()
        # the outermost forward's mode stands for what runs inside it (cache.py's Note: forwards without autograd)
        self._step = self._step if self.active else in_step() if step is None else step
        for c in self.chunks_of(unit):
            self.cache.acquire(c, recorded=self._step)
        self._show(unit, True)
        self.active.append(unit)

    def _pre_forward_unit(self, unit, args, kwargs):
        """A leaf, or a unit none of whose parameters trains (a LoRA model's base): its backward
        hold ends when the gradient reaches its inputs. Without that end, a frozen unit, which no
        gradient of its own ends, held its chunks until the backward was over: all of a LoRA
        model's base gathered at once by the end of it."""
        if self._ends_at_inputs(unit):
            return self._pre_forward_leaf(unit, args, kwargs)
        self._pre_forward(unit, args)
        return None

    def _pre_forward_leaf(self, unit, args, kwargs):
        self._pre_forward(unit, args)
        if not torch.is_grad_enabled():
            return None
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not at:  # nothing to mark where its backward ends: the hold lasts until backward's end
            return None
        done = weak_method(self._end_leaf_backward)
        marked = AfterUnitBackward.apply(lambda: done(unit), *(flat[i] for i in at))
        for i, t in zip(at, marked):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _pre_forward_outside(self, module, args):
        # Inside a graph the root's forward is running (is_compiling is a constant there: no break)
        if torch.compiler.is_compiling():
            return
        begins = self.root not in self.active
        self._calls.append(module if begins else None)  # a module calling itself pops its own entry
        if begins:
            self._pre_forward(self.root, args)

    def _post_forward_outside(self, module, args, out):
        if torch.compiler.is_compiling() or not self._calls or self._calls.pop() is not module:
            return None
        return self._post_forward(self.root, args, out)

    def _post_forward(self, unit, args, out):
        if self.whole:
            return None
        # A parameter returned from its unit's forward: once its chunk is released the parameter
        # holds no data, so the caller gets a view of it instead, made before the release, which
        # keeps the gathered storage (and the values) alive for as long as the caller holds it.
        # One tensor returned (most modules) takes the short way: ~70 us less per call.
        if type(out) is torch.Tensor and id(out) not in self._param_ids(unit):
            tensors, replaced = [out], None
        else:
            tensors, replaced = unit_outputs(out, {id(p): p for _, p in self.params_of(unit)})
        if self.in_backward and torch.is_grad_enabled() and self._begin_hold(unit):
            # An activation checkpoint's recomputation: its backward comes next. Held from here, the
            # chunks stay gathered until then: a frozen parameter autograd saved as itself (not as a
            # view) keeps its values and shape, and the backward gathers nothing a second time. Pinned
            # in hand, not used again: the schedule (and the profile's) sees the recomputation alone.
            for c in self.chunks_of(unit):
                self.cache.pin(c)
        self._end_forward(unit)
        if torch.is_grad_enabled():
            tensors = [t for t in tensors if t.requires_grad]
            if len(tensors) == 1:  # the gradient of the one output: what "any" waits for
                tensors[0].register_hook(lambda grad, m=unit: self._pre_backward(m))
            elif tensors:
                register_multi_grad_hook(tensors, lambda grads, m=unit: self._pre_backward(m), mode="any")
        return replaced

    def _param_ids(self, unit) -> set[int]:
        ids = self._ids.get(unit)
        if ids is None:
            ids = self._ids[unit] = {id(p) for _, p in self.params_of(unit)}
        return ids

    def _end_forward(self, unit, check: bool = True) -> None:
        """`check`: keep what was written into the unit's parameters (param_writes.py), which may raise."""
        i = len(self.active) - 1 - self.active[::-1].index(unit)
        try:
            if check:
                self.writes.check(p for _, p in self.params_of(unit))
        finally:
            del self.active[i]
            if unit not in self.active and not self._shows_while_held(unit):
                self._show(unit, False)
            for c in self.chunks_of(unit):
                self.cache.release(c)

    def close_open_forwards(self) -> None:
        self._calls.clear()
        try:
            while self.active:
                self._end_forward(self.active[-1])
        finally:  # one raised (a write that could not be kept): the rest close all the same
            while self.active:
                self._end_forward(self.active[-1], check=False)

    def _pre_backward(self, unit) -> None:
        self.in_backward = True
        if self._begin_hold(unit):
            for c in self.chunks_of(unit):
                self.cache.acquire(c)
            if unit in self.leaves:
                self._show(unit, True)

    def _shows_while_held(self, unit) -> bool:
        """A leaf shows its real parameters while held in backward: its submodules have no hooks of
        their own, so a recomputation inside it (activation checkpointing of a submodule, as in a
        model compiled whole: compiled.py's Note: one chunk) runs on them."""
        return unit in self.leaves and unit in self.held

    def _begin_hold(self, unit) -> bool:
        """Hold `unit` in backward (False: held already) until its trainable parameters' gradients
        arrived, or, a leaf or a frozen unit, the gradient reached its inputs (_pre_forward_unit)."""
        return self.held.begin(unit, None if unit in self.leaves or self._shares(unit) else
                               {id(p) for _, p in self.params_of(unit) if p.requires_grad})

    def _ends_at_inputs(self, unit) -> bool:
        """A leaf, a unit none of whose parameters trains, or one sharing a parameter with another
        unit: its hold ends when the gradient reaches its inputs. A tied parameter's gradient
        arrives once every use's part is in, so an output head tied to the input embedding held
        its chunk through the whole backward (a 2-chunk rCache then prefetched nothing:
        gpt2-small-cpu waited 190 ms a backward for its gathers)."""
        return unit in self.leaves or self._shares(unit) or not any(p.requires_grad for _, p in self.params_of(unit))

    def _shares(self, unit) -> bool:
        return any(len(self.owners[id(p)]) > 1 for _, p in self.params_of(unit))

    def grad_arrived(self, param: nn.Parameter) -> None:
        for m in self.held.arrived(id(param)):
            self._release_held(m)

    def _counts_at_leaf_end(self, unit) -> bool:
        """Whether the unit's parameters count as arrived when its backward ends: a leaf's, but not
        the root's, whose modules called outside its forward may add gradients after (each would
        reduce its chunk again); the root's count as their gradients arrive."""
        return unit in self.leaves and unit is not self.root

    def params_counted_at_leaf_end(self) -> list[nn.Parameter]:
        """The parameters that count towards their chunk's completion at their leaf's backward end."""
        return [p for leaf in self.leaves if self._counts_at_leaf_end(leaf) for _, p in self.params_of(leaf)]

    def _end_leaf_backward(self, unit) -> None:
        if self._counts_at_leaf_end(unit):  # a frozen unit's parameters are not counted
            self.on_leaf_backward([p for _, p in self.params_of(unit)])
        if self.held.end(unit):
            self._release_held(unit)

    def _release_held(self, unit) -> None:
        for c in self.chunks_of(unit):
            self.cache.release(c)
        if unit in self.leaves and unit not in self.active:  # shown while held (_shows_while_held)
            self._show(unit, False)

    # -- saved tensors (see ChunkView) -------------------------------------------------------------
    def pack_chunk_view(self, t: torch.Tensor) -> ChunkView | None:
        ptr = t.untyped_storage().data_ptr()
        for c in self.cache.cached.values():
            if c.full is not None and c.full.untyped_storage().data_ptr() == ptr:
                return ChunkView(c, t)
        return None

    @staticmethod
    def unpack_chunk_view(v: ChunkView) -> torch.Tensor:
        c = v.chunk
        if c.state is ChunkState.GATHERING:
            c.finish_gather()
        if c.state is not ChunkState.GATHERED:
            names = ", ".join(s.name for s in c.slots)
            raise ShardedParameterError(
                f"zeroshard stage 3: backward needs chunk {c.index} ({names}) but it is not gathered: "
                "a parameter saved for backward was used outside the modules that register it")
        return c.full.as_strided(v.size, v.stride, v.offset)

    def end_backward(self) -> None:
        self.close_open_forwards()
        for m in self.held.end_all():
            self._release_held(m)
        self.in_backward = False
