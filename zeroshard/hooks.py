"""Module hooks: where the model's execution drives chunk gathers and releases (stage 3), and where
the first-use order of parameters is recorded (every stage).

Stage 3 lifecycle of one module call:
  forward pre-hook   acquire (gather + pin) the module's chunks; put the real parameters in its slots
  forward post-hook  put placeholders back; unpin; register a pre-backward hook on the outputs
  pre-backward       acquire the chunks again and *hold* them for this module's backward
  gradient arrival   once every trainable direct parameter of the module has its gradient, the hold
                     ends (the engine calls `grad_arrived`); holds still open end with the backward.

Tensors that autograd saves for backward and that are views of a gathered chunk (a weight saved by
a matmul) are saved as a `ChunkView` (chunk, offset, size, stride) instead, and re-read from the
chunk, gathered again by then, in backward: otherwise every saved weight would keep its gathered
chunk alive from forward to backward and stage 3 would hold the whole model at its peak.

Outside its module's forward, a stage-3 parameter's slot holds a `ShardedPlaceholder` with the
parameter's shape, dtype and device: metadata reads work, any computation raises an error that names
the parameter, instead of silently reading a freed buffer. One exception: a module whose forward
reads a parameter of a submodule that does not run (nn.MultiheadAttention reads out_proj.weight) *borrows*
it: the parameter is gathered on the spot, and from then on it belongs to the borrowing module's
unit (gathered, held for backward and released with that module's own parameters).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .chunks import ChunkState
from .tensor_parallel import local

_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.requires_grad.__get__, torch.Tensor.ndim.__get__, torch.Tensor.is_leaf.__get__,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_meta.__get__,
    torch._has_compatible_shallow_copy_type,
    # None: a gradient lives in its chunk (torch's clip_grad_norm_ on these raises: module_state.py)
    torch.Tensor.grad.__get__,
}
_REQUIRES_GRAD = {torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__}


_CASTS = {torch.Tensor.to: None, torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
          torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.double: torch.float64, torch.Tensor.cpu: None}


def _unchanged(func, args, kwargs) -> bool:
    """Whether a cast or move of the placeholder args[0] would return it as it is."""
    t = args[0]
    if func is torch.Tensor.cpu:
        return t.device.type == "cpu"
    if func is not torch.Tensor.to:
        return _CASTS[func] == t.dtype
    with torch._C.DisableTorchFunctionSubclass():
        device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    return (device is None or torch.device(device) == t.device) and (dtype is None or dtype == t.dtype)


class ShardedParameterError(RuntimeError):
    """A stage-3 parameter was computed with outside the forward of a module that owns it."""


class ShardedPlaceholder(torch.Tensor):
    """Occupies a module's parameter slot while stage 3 holds that parameter sharded."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, shape: torch.Size, dtype, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=like.device,
                                                requires_grad=like.requires_grad)
        t._zs_name = name
        t._zs_absorb_copies = False  # inside model.load_state_dict: the value went to the shard already
        t._zs_borrow = None  # Stage3Hooks.borrow: the real parameter, gathered, if a forward may read it
        t._zs_param = None  # the real parameter it stands in for
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_ and isinstance(args[0], ShardedPlaceholder) and args[0]._zs_absorb_copies:
            return args[0]
        if func in _CASTS and isinstance(args[0], ShardedPlaceholder) and _unchanged(func, args, kwargs or {}):
            return args[0]  # model.to(where it is), model.float() in fp32: nothing to do
        # nn.Module._apply putting an unchanged placeholder back (`==`: a method-wrapper is made anew each time)
        if func == torch.Tensor.data.__set__ and args[1] is args[0]:
            return None
        if func in _REQUIRES_GRAD and isinstance(args[0], ShardedPlaceholder) and args[0]._zs_param is not None:
            # freezing or unfreezing through model.parameters(): the real parameter's flag, and its stand-in's
            func(args[0]._zs_param, *args[1:], **(kwargs or {}))
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **(kwargs or {}))
            return args[0] if func is torch.Tensor.requires_grad_ else None
        flat, _ = tree_flatten((args, kwargs or {}))
        held = [a for a in flat if isinstance(a, ShardedPlaceholder)]
        borrow = held[0]._zs_borrow if held and func is not torch.Tensor.__repr__ else None
        real = {id(a): borrow(a) for a in held} if borrow is not None else {}
        if real and all(r is not None for r in real.values()):  # read inside an ancestor's forward
            args, kwargs = tree_map_only(ShardedPlaceholder, lambda a: real[id(a)], (args, kwargs or {}))
            return func(*args, **kwargs)
        names = sorted({a._zs_name for a in held})
        if func is torch.Tensor.__repr__:
            return f"ShardedPlaceholder({names[0]}, shape={tuple(args[0].shape)})"
        raise ShardedParameterError(
            f"zeroshard stage 3: parameter {', '.join(names)} was used by "
            f"{getattr(func, '__name__', func)} outside the forward of a module that owns it, while "
            "it is sharded. Use it inside that module's forward (or a module that registers it), "
            "read engine.full_state_dict(), or use stage <= 2."
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ShardedParameterError(f"zeroshard stage 3: {func} reached a sharded parameter placeholder")


class ChunkView:
    """A saved tensor that is a view of a gathered stage-3 chunk, kept as a reference."""

    __slots__ = ("chunk", "size", "stride", "offset")

    def __init__(self, chunk, t: torch.Tensor):
        self.chunk, self.size, self.stride, self.offset = chunk, t.size(), t.stride(), t.storage_offset()


def weak_method(method):
    """A function that calls `method` while its object lives, without keeping the object alive
    (autograd keeps hooks in C++, where the garbage collector cannot see a cycle through them)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        return m(*args) if m is not None else None
    return call


def direct_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module._parameters.items() if p is not None]


class FirstUseRecorder:
    """Records parameters in order of first use during one forward pass."""

    def __init__(self, model: nn.Module):
        self.order: list[nn.Parameter] = []
        self._seen: set[int] = set()
        self._handles = [m.register_forward_pre_hook(self._pre) for m in model.modules()
                         if direct_params(m)]

    def _pre(self, module, args):
        for _, p in direct_params(module):
            if id(p) not in self._seen and not isinstance(p, ShardedPlaceholder):
                self._seen.add(id(p))
                self.order.append(p)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ArrivalHooks:
    """Stages 1-2: after a step, the updated chunks *arrive* (their all-gather, and with the delayed
    update their upload, still in flight: `Chunk.arriving`) while the next forward runs. Each
    module's forward first waits for its own chunks (on the device where it can), so later chunks'
    gathers overlap earlier modules' compute.

    Code may also read a parameter outside its module's forward before it arrived: a logging or EMA
    line after step(), state_dict(), a parent module's forward reading a child's weight. While
    chunks are arriving, a torch function mode (`ArrivalGuard`) therefore sees every torch call and
    first waits for the chunks of the tensors it is given. It is armed by `arm()` after a step and
    removed once every chunk has arrived (at the latest when the forward ends: `settle()`), so
    calls outside that window pay nothing. Stage 3 waits in the gather instead."""

    def __init__(self, model: nn.Module, chunks_of):
        self.chunks_of = chunks_of
        self.guard = ArrivalGuard()
        self._handles = [m.register_forward_pre_hook(self._pre) for m in model.modules() if direct_params(m)]

    def arm(self, chunks) -> None:
        """Guard reads of the chunks now arriving (call after publishing an update)."""
        self.guard.watch([c for c in chunks if c.arriving is not None])

    def _pre(self, module, args):
        if self.guard.armed:
            for c in self.chunks_of(module):
                self.guard.arrived(c)

    def settle(self) -> None:
        """Wait for every chunk still arriving and remove the guard."""
        self.guard.watch([])

    def remove(self) -> None:
        self.settle()
        for h in self._handles:
            h.remove()
        self._handles = []


class ArrivalGuard(TorchFunctionMode):
    """See ArrivalHooks. Chunks are matched by storage: a parameter (or any view of it) shares its
    chunk's storage, so one lookup per tensor argument finds it."""

    def __init__(self):
        super().__init__()
        self.pending: dict[int, object] = {}  # storage address -> chunk whose data is arriving
        self.armed = False  # on the torch function mode stack

    def watch(self, chunks) -> None:
        """Wait for the chunks watched so far; then watch `chunks` (armed iff there are any)."""
        for c in list(self.pending.values()):
            c.await_arrival()
        if chunks and not self.armed:
            self._sweep()
        if not self.armed and torch._C._len_torch_function_stack():
            # A mode entered before step() would pop this one at its exit: no overlap then.
            for c in chunks:
                c.await_arrival()
            chunks = []
        self.pending = {c.full.untyped_storage().data_ptr(): c for c in chunks}
        if self.pending and not self.armed:
            torch._C._push_on_torch_function_stack(self)
            self.armed = True
        elif not self.pending:
            self._disarm()

    def arrived(self, chunk) -> None:
        """Wait for `chunk`; once nothing is pending, leave the mode stack."""
        if self.pending.pop(chunk.full.untyped_storage().data_ptr(), None) is not None:
            chunk.await_arrival()
        if not self.pending:
            self._disarm()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending:
            # Every torch call of the forward comes through here while chunks arrive: a tensor is
            # looked for among the arguments and one level into lists and tuples (torch.cat's
            # operands), not with a full pytree walk, which cost a tenth of the forward.
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor):
                    self._wait_for(a)
                elif isinstance(a, (list, tuple)):
                    for t in a:
                        if isinstance(t, torch.Tensor):
                            self._wait_for(t)
        return func(*args, **kwargs)

    def _wait_for(self, t: torch.Tensor) -> None:
        t = local(t)  # a DTensor parameter: its local shard lives in the chunk
        if t.layout is torch.strided and not t.is_meta:
            try:
                ptr = t.untyped_storage().data_ptr()
            except RuntimeError:  # a wrapper subclass with no storage of its own (an async collective's)
                return
            c = self.pending.pop(ptr, None)
            if c is not None:
                c.await_arrival()

    @staticmethod
    def _stack() -> list:
        return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]

    def _sweep(self) -> None:
        """Take other guards off the stack (an engine dropped between a step and the next forward
        leaves its guard there; its reads were all waited for or will be now)."""
        for m in self._stack():
            if isinstance(m, ArrivalGuard) and m is not self:
                m.watch([])

    def _disarm(self) -> None:
        """Leave the mode stack, putting back the modes a user entered above this one since (their
        own exits pop them later, in order)."""
        if not self.armed:
            return
        self.armed = False
        if not any(m is self for m in self._stack()):  # already popped
            return
        above = []
        while (m := torch._C._pop_torch_function_stack()) is not self:
            above.append(m)
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)


class Stage3Hooks:
    """Installs and runs the stage-3 module hooks. `chunks_of(module)` gives the chunks holding a
    module's parameters, `params_of(module)` (it changes if the engine re-packs chunks);
    `on_borrow(module)` is told when a module's parameters grew by a borrowed one."""

    def __init__(self, model: nn.Module, cache, chunks_of, names: dict[int, str],
                 shapes: dict[int, torch.Size], dtype: torch.dtype, on_borrow=lambda module: None):
        self.cache = cache
        self.chunks_of = chunks_of
        # The root too, parameters or not: a parameter read in its forward outside the module that
        # holds it (nn.ParameterList's, F.linear(x, self.child.weight)) is borrowed by it.
        self.modules = [m for m in model.modules() if direct_params(m) or m is model]
        self.real: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        self.placeholders: dict[nn.Module, list[tuple[str, ShardedPlaceholder]]] = {}
        self.owners: dict[int, list[nn.Module]] = {}  # id(param) -> modules that register it
        # module -> (owner module, name, parameter) it borrowed (see the module docstring)
        self.borrowed: dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]] = {}
        self._slot: dict[int, tuple[nn.Module, str, nn.Parameter]] = {}  # id(placeholder) -> where it stands in
        self.on_borrow = on_borrow
        borrow = weak_method(self.borrow)
        for m in self.modules:
            self.real[m] = direct_params(m)
            self.placeholders[m] = [(n, ShardedPlaceholder(p, shapes[id(p)], dtype, names[id(p)]))
                                    for n, p in self.real[m]]
            for (n, p), (_, t) in zip(self.real[m], self.placeholders[m]):
                self.owners.setdefault(id(p), []).append(m)
                self._slot[id(t)] = (m, n, p)
                t._zs_borrow, t._zs_param = borrow, p
            self._swap(m, self.placeholders[m])
        self.held: dict[nn.Module, set[int]] = {}  # module -> ids of params whose grads are pending
        # Module calls whose forward started but has not ended. Non-reentrant checkpointing stops a
        # recomputation early by raising inside the forward, so some never end: they are closed
        # when backward ends (and an exception in a user's forward leaves some for the next call).
        self.active: list[nn.Module] = []
        self.in_backward = False
        self._handles = []
        for m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre_forward))
            self._handles.append(m.register_forward_hook(self._post_forward))

    def params_of(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """A module's direct parameters and those it borrowed."""
        return self.real[module] + [(n, p) for _, n, p in self.borrowed.get(module, ())]

    def borrow(self, placeholder: ShardedPlaceholder) -> nn.Parameter | None:
        """The real parameter behind `placeholder`, gathered, if a module's forward is running (None
        otherwise): it joins the innermost running module's unit from now on."""
        if not self.active:
            return None
        m = self.active[-1]
        owner, name, p = self._slot[id(placeholder)]
        entries = self.borrowed.setdefault(m, [])
        if all(q is not p for _, _, q in entries):
            before = list(self.chunks_of(m))
            entries.append((owner, name, p))
            self.owners.setdefault(id(p), []).append(m)
            self.on_borrow(m)
            for c in self.chunks_of(m):  # released with m's own when its forward ends
                if c not in before:
                    self.cache.acquire(c)
            owner._parameters[name] = p
        return p

    def _swap_borrowed(self, module: nn.Module, real: bool) -> None:
        for owner, name, p in self.borrowed.get(module, ()):
            if real:
                owner._parameters[name] = p
            elif owner not in self.active:
                owner._parameters[name] = next(t for n, t in self.placeholders[owner] if n == name)

    def show_real_parameters(self, real: bool) -> None:
        """Put the real parameters in every module's slots (True), or the placeholders back."""
        for m in self.modules:
            self._swap(m, self.real[m] if real else self.placeholders[m])

    def absorb_copies(self, module: nn.Module, on: bool) -> None:
        """While `module` loads a state dict whose values module_state.py already wrote into the
        shards: its placeholders take torch's copy into them as done."""
        for _, t in self.placeholders[module]:
            t._zs_absorb_copies = on

    @staticmethod
    def _swap(module: nn.Module, entries) -> None:
        for n, t in entries:
            module._parameters[n] = t

    def _pre_forward(self, module, args):
        for c in self.chunks_of(module):
            self.cache.acquire(c)
        self._swap(module, self.real[module])
        self._swap_borrowed(module, True)
        self.active.append(module)

    def _post_forward(self, module, args, out):
        self._end_forward(module)
        flat, spec = tree_flatten(out)
        real = {id(p) for _, p in self.real[module]}
        if any(id(t) in real for t in flat):
            # A parameter returned from its module's forward: once its chunk is released the
            # parameter holds no data, so the caller gets a view of it instead, which keeps the
            # gathered storage (and the values) alive for as long as the caller holds it.
            flat = [t.view_as(t) if id(t) in real else t for t in flat]
            out = tree_unflatten(flat, spec)
        else:
            out = None  # unchanged
        if torch.is_grad_enabled():
            tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads, m=module: self._pre_backward(m), mode="any")
        return out

    def _end_forward(self, module) -> None:
        i = len(self.active) - 1 - self.active[::-1].index(module)
        del self.active[i]
        if module not in self.active:
            self._swap(module, self.placeholders[module])
            self._swap_borrowed(module, False)
        for c in self.chunks_of(module):
            self.cache.release(c)

    def close_open_forwards(self) -> None:
        while self.active:
            self._end_forward(self.active[-1])

    def _pre_backward(self, module) -> None:
        self.in_backward = True
        if module in self.held:
            return
        self.held[module] = {id(p) for _, p in self.params_of(module) if p.requires_grad}
        # A module with no trainable parameter keeps its hold until the end of backward.
        for c in self.chunks_of(module):
            self.cache.acquire(c)

    def grad_arrived(self, param: nn.Parameter) -> None:
        for m in self.owners.get(id(param), ()):
            pending = self.held.get(m)
            if pending is None:
                continue
            pending.discard(id(param))
            if not pending:
                self._end_hold(m)

    def _end_hold(self, module) -> None:
        del self.held[module]
        for c in self.chunks_of(module):
            self.cache.release(c)

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
        for m in list(self.held):
            self._end_hold(m)
        self.in_backward = False
