"""Stages 1-2: where the forward waits for chunks still *arriving* (an update's all-gather, or the
delayed update's upload, in flight after a step), so later chunks' arrivals overlap earlier
modules' compute (see ArrivalHooks)."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..distributed.tensor_parallel import local
from ..units import direct_params


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
        self._handles = {m: m.register_forward_pre_hook(self._pre) for m in model.modules() if direct_params(m)}
        self._block_chunks: dict[nn.Module, list] = {}  # compiled block -> the chunks of every parameter in it

    def arm(self, chunks) -> None:
        """Guard reads of the chunks now arriving (call after publishing an update)."""
        self.guard.watch([c for c in chunks if c.arriving is not None])

    def _pre(self, module, args):
        if self.guard.armed:
            for c in self.chunks_of(module):
                self.guard.arrived(c)

    def wait_per_block(self, blocks: list[nn.Module]) -> None:
        """Compiled blocks (compiled.py): each waits, before its graph runs, for the chunks of every
        parameter in it, and its graph runs with the guard off the mode stack (dynamo would trace
        the guard into it, and a graph cannot wait); the modules inside no longer wait on their own.
        So later blocks' chunks still arrive while earlier blocks compute, as in eager mode. Code
        outside the blocks runs eagerly, its reads guarded as before."""
        for b in blocks:
            chunks = []
            for m in b.modules():
                h = self._handles.pop(m, None)
                if h is not None:
                    h.remove()
                chunks += [c for c in self.chunks_of(m) if c not in chunks]
            self._block_chunks[b] = chunks
            self._handles[(b, "pre")] = b.register_forward_pre_hook(self._pre_block, with_kwargs=True)
            self._handles[(b, "post")] = b.register_forward_hook(self._post_block, always_call=True)

    def _pre_block(self, block, args, kwargs):
        if self.guard.armed:
            for c in self._block_chunks[block]:
                self.guard.arrived(c)
            self.guard.wait_for_arguments(args, kwargs)  # a parameter handed in (a tied weight)
            self.guard.suspend()

    def _post_block(self, block, args, out):
        self.guard.resume()

    def resume(self) -> None:
        """After a forward: the guard back on the mode stack if a compiled block was left by an
        exception its forward hook does not see (KeyboardInterrupt)."""
        self.guard.resume()

    def settle(self) -> None:
        """Wait for every chunk still arriving and remove the guard."""
        self.guard.watch([])

    def remove(self) -> None:
        self.settle()
        for h in self._handles.values():
            h.remove()
        self._handles = {}


class ArrivalGuard(TorchFunctionMode):
    """See ArrivalHooks. Chunks are matched by storage: a parameter (or any view of it) shares its
    chunk's storage, so one lookup per tensor argument finds it."""

    def __init__(self):
        super().__init__()
        self.pending: dict[int, object] = {}  # storage address -> chunk whose data is arriving
        self.armed = False  # on the torch function mode stack
        self.suspended = False  # taken off the stack while a compiled block runs (suspend)

    def watch(self, chunks) -> None:
        """Wait for the chunks watched so far; then watch `chunks` (armed iff there are any)."""
        for c in list(self.pending.values()):
            c.await_arrival()
        self.suspended = False
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

    def suspend(self) -> None:
        """Leave the mode stack while a compiled block runs, still watching what is pending."""
        if self.armed:
            self._disarm()
            self.suspended = True

    def resume(self) -> None:
        """After a compiled block: back on the mode stack if chunks are still pending. Only onto an
        empty stack, as `watch` arms: a mode the block left entered would otherwise pop this one at
        its exit; the pending chunks are waited for now instead."""
        if not self.suspended:
            return
        self.suspended = False
        if not self.pending:
            return
        if torch._C._len_torch_function_stack():
            self.watch([])
            return
        torch._C._push_on_torch_function_stack(self)
        self.armed = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.pending:
            self.wait_for_arguments(args, kwargs)
        return func(*args, **kwargs)

    def wait_for_arguments(self, args, kwargs) -> None:
        """Wait for the chunks of the tensors among a call's arguments. Every torch call of the
        forward comes through here while chunks arrive: a tensor is looked for among the arguments
        and one level into lists and tuples (torch.cat's operands), not with a full pytree walk,
        which cost a tenth of the forward."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                self._wait_for(a)
            elif isinstance(a, (list, tuple)):
                for t in a:
                    if isinstance(t, torch.Tensor):
                        self._wait_for(t)

    def _wait_for(self, t: torch.Tensor) -> None:
        t = local(t)  # a DTensor parameter: its local shard lives in the chunk
        # Read as a plain tensor's: a tensor subclass's own handling must not run here (another
        # engine's stage-3 placeholder refuses any use; this only looks for a storage).
        with torch._C.DisableTorchFunctionSubclass():
            if t.layout is not torch.strided or t.is_meta:
                return
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage of its own
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
