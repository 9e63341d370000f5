"""The engine's forward: `engine(...)` and the wrapped model called as itself (`model(x)` in a plain
loop, `generate`, a front end's call) run the same bracket around the model's forward, opened by the
root's forward pre-hook and closed by its always-called forward hook. `EngineForward` is a base of
`Engine` (engine.py).

Note: one bracket. The bracket holds what a forward needs beyond the units' own hooks: inputs on the
device in the compute dtype, gradual unfreezing followed, the layer blocks compiled once the layout
is final, at stage 3 the schedule replayed from its start and the saved-tensor hooks (a saved chunk
view is kept by reference, so the chunk is released between forward and backward), activation
offload and P_a, the re-pack in order of first use after the first training forward, and the
chunks this forward did not use settled at its end. Saved-tensor hooks of the caller
(torch.utils.checkpoint or save_on_cpu around the model) keep what they asked for: the engine's are
not pushed inside them. A call during a backward (a checkpoint's recomputation) opens nothing. The
model called as itself used to get a few of these in a pre-hook: at stage 3 each step then held every gathered chunk from forward to backward
through the tensors autograd saved (the whole model, where engine(...) holds its rCache), never
left recording the schedule (no prefetch), and config `compile` compiled nothing.

Note: a module called directly. A plain loop may call a module of the wrapped model rather than the
model (`h = model.backbone(x); out = model.head(h)`, or `model.model(ids)` before a fused loss over
`model.lm_head.weight`). Every module holding parameters opens the bracket too where none is open,
and closes it as its own call ends, but those inside a layer block (units.layer_blocks; the blocks
themselves do): a hooked module leaves torch's fast call path, about 4 us a call here (a Linear
inside an open forward, 15.5 -> 19.2 us), so gpt2-tiny's 9 such calls add some 35 us a forward,
where its 42 modules with parameters would add 0.16 ms. Before, such a loop got no bracket, so at
stage 3 each step held the whole model from forward to backward (44 of 48 MiB with a layer a
chunk and a 2-chunk rCache, against 2 through the model), a parameter unfrozen after initialize
never trained at any stage (it got no gradient hook: 1.2e-2 off torch after 4 steps), and nothing
compiled. Its forward hook is always called, so a forward that raised closes (a first version's
was not, sparing user-compiled blocks dynamo's guard on each hook id; an open forward kept the
saved-tensor hooks pushed, and once its engine was dropped later engines took them for the caller's
and pushed none). Inside an open forward, a backward or a compiled graph the hooks do nothing.

Note: training in eval mode. A forward recording gradients trains, whatever the module's mode:
fine-tuning code calls model.eval() to turn dropout off or keep BatchNorm's statistics. It used
to count as training only in train mode, so a model trained in eval mode kept its layout
unfinished: at stage 3 the rCache recorded the schedule every step (no prefetch, LRU eviction),
config compile compiled nothing, and its samples went uncounted.

Note: forwards of one pass. A pass is what one backward differentiates: the forwards recording
gradients since the last backward or step. Its first forward in train mode replays the schedule
from its start; a later one (the head after the backbone, called directly; the model called twice
for one loss) goes on from where the one before left it, as the schedule recorded over such a pass
has them one after the other. A forward without autograd replays it from its start where no pass
is under way (an evaluation between steps), and leaves it alone inside one (a look at the head
under no_grad half-way: its uses are not followed, cache.py). Forwards recording gradients in eval
mode make a pass of their own, which the next forward in train mode ends, replaying the schedule
from its start: an evaluation that forgot no_grad drops its graph unused, and would otherwise
leave the next training step going on from its end, off the schedule; inside a training pass
(a teacher in eval mode) they go on with it. A schedule being recorded starts afresh with each
pass: one dropped unused (that evaluation after the first step) was recorded with the next, and
every later step departed from it. The schedule is recorded over a pass whose first forward
found the layout final: before, the second forward of the first pass (the first re-packed the
chunks as it ended) had it recorded over chunk indices of both layouts, and every later step
departed from it (5 departures a step with the head called after the backbone, 2 with the model
called twice; now none). Config compile
compiles only with no pass under way. A pass of modules called directly is re-packed in the order
its first forward used them, the rest in the model's order (not the whole pass's order of use).

Note: a training step function. Lightning's manual optimization runs a whole training step inside
what the engine sees as one call (`run_training_step`): forwards of the model's modules, backwards,
optimizer steps. Each backward, step, zero_grad and gradient clipping inside it closes the open
forward first (its saved-tensor hooks off, the layout fixed after the first) and opens the next
after it (`between_forwards`; a front end puts a user's backward override inside one), which
follows the schedule from its start without prefetching: the next call may be a step, which would
drop what a prefetch gathered.

Note: nested and interrupted calls. The root called inside its own forward (a LightningModule's
training_step calling self(x), run inside the engine's forward) is part of the open forward. A
forward interrupted by a BaseException misses torch's always-called hooks (they run for Exception):
`engine(...)` closes its own forward in a finally; a direct call's is found open at the next call
or entry point, whose stack no longer holds the open one's frame, and closed then, with a warning
(its saved-tensor hooks too, or, where the caller pushed hooks over them since, at the next forward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import weakref

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from .engine_io import TrainingPhase
from .errors import ConfigError, EngineCallError
from .runtime.compiled import compile_forwards
from .runtime.module_state import check_not_moved
from .units import layer_blocks

log = logging.getLogger("zeroshard")

_CALL_IMPL = nn.Module._call_impl.__code__


@dataclasses.dataclass
class OpenForward:
    """A forward the root's pre-hook opened: the frame of the root's call (to tell a nested call
    from one made after an interrupted forward), the contexts it entered, what its end does."""
    frame: object
    recording: bool  # re-pack in order of first use at its end
    tracking: bool  # the memory timeline samples its end
    grad: bool
    exception: BaseException | None  # the one being handled when it opened (a call inside an except block)
    step_function: bool = False  # run_training_step's: backwards and steps inside it (module docstring)
    nested: int = 0
    hooked: bool = False  # the engine's saved-tensor hooks are on for it
    module: nn.Module | None = None  # the module called directly that opened it (Note: a module called directly)


def _root_call_frame():
    """The frame of the innermost Module._call_impl on this thread's stack (the root's call, seen
    from its hooks)."""
    f = sys._getframe(1)
    while f is not None and f.f_code is not _CALL_IMPL:
        f = f.f_back
    return f


def runs_between_forwards(method):
    """An Engine method that runs between forwards (EngineForward.between_forwards)."""
    @functools.wraps(method)
    def between(self, *args, **kwargs):
        with self.between_forwards(f"{method.__name__.strip('_')}()"):
            return method(self, *args, **kwargs)
    return between


def _on_stack(frame) -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


class EngineForward:
    """Engine methods of the forward bracket (module docstring)."""

    def _begin_call(self, call: str) -> None:
        if self.phase is TrainingPhase.BACKWARD:  # a plain loss.backward() raised half-way
            log.warning("the previous backward was interrupted; its reductions are abandoned")
            self._abandon_backward()
        self._expect_idle(call)

    def __call__(self, *args, **kwargs):
        if self.phase is TrainingPhase.FULL_PARAMETERS:  # an evaluation on the whole values, as model(x) runs
            return self.module(*args, **kwargs)
        self._begin_call("forward")
        # before the root's call reads its forward (a root compiled whole; the model called as
        # itself compiles in the root's pre-hook, too late for that call: from the next one). Not as
        # a forward ends: its backward may recompute checkpointed blocks, which must run as they ran.
        self._compile_when_due()
        try:
            with self._waits("run the forward"):
                return self.module(*args, **kwargs)  # the root's hooks open and close the bracket
        finally:
            if self._open is not None:  # a BaseException passed torch's always-called hook by
                self._close_forward(failed=True)

    forward = __call__

    def run_training_step(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)`, a whole training step (forwards of the model or its modules,
        backwards, optimizer steps: Lightning's manual optimization), as one forward of the model
        that each backward, step, zero_grad and gradient clipping inside it closes and opens again
        (module docstring); returns what `fn` returns."""
        self._begin_call("run_training_step()")
        args, kwargs = self._to_device((args, kwargs))
        self._open_forward(args, kwargs, step_function=True)
        try:
            out = fn(*args, **kwargs)
        except BaseException:
            if self._open is not None:
                self._close_forward(failed=True)
            raise
        if self._open is not None:
            self._close_forward(failed=False)
        return out

    @contextlib.contextmanager
    def between_forwards(self, call: str = "this call"):
        """Inside a training step function's forward (run_training_step): close that forward for
        what runs inside this (`call`: its name, for errors), and open the next one after it
        (module docstring). Anywhere else, nothing."""
        opened = self._open
        if opened is None or not opened.step_function:
            yield
            return
        self._suspend_forward(call)
        try:
            yield
        finally:
            if self.phase is TrainingPhase.IDLE:  # not left inside an interrupted backward
                self._resume_forward(opened)

    def _suspend_forward(self, call: str) -> None:
        """Close a training step function's forward for `call` (a backward, a step) made inside it."""
        opened = self._open
        if opened.nested:
            raise EngineCallError(f"zeroshard: {call} inside a forward of the model, inside a training step: call "
                                  "it after the model's forward returns")
        if self.hooks is not None and self.hooks.active:
            raise EngineCallError(f"zeroshard: {call} inside the forward of a module the engine gathers "
                                  f"({type(self.hooks.active[-1]).__name__}): call it after that forward returns")
        self._close_forward(failed=False)

    def _resume_forward(self, closed: OpenForward) -> None:
        """The training step function's next forward, after a call closed the one before."""
        self._open_forward((), {}, step_function=True, frame=closed.frame, prefetch=False)

    def _forward_begins(self, module: nn.Module, args: tuple, kwargs: dict):
        """The root's forward pre-hook: opens the bracket (module docstring) where the engine is
        idle; returns the inputs on the device in the compute dtype."""
        self._close_stale_forward()
        self._root_called = True
        if self._open is not None:  # the root called inside its own forward
            self._open.nested += 1
            return None
        if not self._opens_here():
            return None
        args, kwargs = self._to_device((args, kwargs))
        self._open_forward(args, kwargs)
        return args, kwargs

    def _forward_ends(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """The root's always-called forward hook: closes the bracket its pre-hook opened."""
        opened = self._open
        if opened is None:
            return None
        if opened.nested:
            opened.nested -= 1
            return None
        self._close_forward(failed=sys.exc_info()[1] is not opened.exception)
        return None

    def _opens_here(self) -> bool:
        """Whether a forward opens now, none being open: not inside full_parameters() (the
        parameters hold their whole fp32 values there) nor a backward's recomputation
        (torch.utils.checkpoint). Stages 0-2 check the parameters still view their chunks."""
        if self.phase is not TrainingPhase.IDLE or torch._C._current_graph_task_id() != -1:
            return False
        if self.hooks is None:
            check_not_moved(self.chunks)
        return True

    def _end_pass(self) -> None:
        """A backward or a step ended the pass under way (Note: forwards of one pass)."""
        self._pass_training, self._forward_recorded = None, False

    def _hook_direct_calls(self, model: nn.Module) -> None:
        """Every module of `model` holding parameters, the root and the modules inside a layer block
        aside, opens the bracket where it is called directly (Note: a module called directly): first
        among its forward pre-hooks, last among its forward hooks. The hooks hold the engine weakly
        and, inside a compiled graph, return before reading it (no guard on the engine's state; so
        not runtime.weak_calls, whose call dynamo would trace first)."""
        engine = weakref.ref(self)

        def begins(module, args, kwargs):
            if torch.compiler.is_compiling():
                return None
            e = engine()
            return None if e is None else e._module_forward_begins(module, args, kwargs)

        def ends(module, args, kwargs, output):
            if torch.compiler.is_compiling():
                return None
            e = engine()
            if e is not None:
                e._module_forward_ends(module)
            return None
        inside = {id(m) for b in layer_blocks(model) for m in b.modules() if m is not b}
        for m in model.modules():
            if m is not model and id(m) not in inside and next(m.parameters(), None) is not None:
                m.register_forward_pre_hook(begins, prepend=True, with_kwargs=True)
                m.register_forward_hook(ends, with_kwargs=True, always_call=True)

    def _module_forward_begins(self, module: nn.Module, args: tuple, kwargs: dict):
        """A module's forward pre-hook: opens the bracket for a module called directly, where no
        forward is open and the engine is idle."""
        self._close_stale_forward()
        if self._open is not None or not self._opens_here():
            return None
        # its inputs as given: the root's are cast and moved, a module's called directly are not (a
        # list it appends to stays the caller's; cast_forward_inputs casts those of its parameterised modules)
        self._open_forward(args, kwargs, opener=module)
        return None

    def _module_forward_ends(self, module: nn.Module) -> None:
        """A module's always-called forward hook: closes the bracket its call opened (not one of a
        call of it nested inside that one)."""
        opened = self._open
        if opened is None or opened.module is not module or _root_call_frame() is not opened.frame:
            return
        self._close_forward(failed=sys.exc_info()[1] is not opened.exception)

    def _open_forward(self, args: tuple, kwargs: dict, step_function: bool = False, frame=None,
                      prefetch: bool = True, opener: nn.Module | None = None) -> None:
        grad = torch.is_grad_enabled()
        training = grad and self.module.training
        # Note: forwards of one pass
        rewind = self._pass_training is None or (training and not self._pass_training)
        begins = grad and rewind  # a pass
        first_recorded = grad and not self._forward_recorded
        if grad:
            self._follow_requires_grad()
        self.shards.at(pass_index=self.micro_steps)
        opened = OpenForward(frame or (sys._getframe(1) if step_function else _root_call_frame()),
                             recording=self.layout.recorder is not None and grad,
                             tracking=self.timeline is not None and self.timeline.recording, grad=grad,
                             exception=sys.exc_info()[1], step_function=step_function, module=opener)
        self.phase, self._open = TrainingPhase.FORWARD, opened
        try:
            if first_recorded and frame is None:  # a pass's inputs, once (a training step function's too)
                self.meter.forward(args, kwargs)
            if begins:  # a schedule recorded over the pass is of its first forward's layout
                self._micro_layout_final = self.layout.final
            self._compile_when_due()
            if begins:
                self._pass_training = training
            self._forward_recorded = self._forward_recorded or grad
            if self.hooks is not None:
                self.hooks.close_open_forwards()
                self.shards.issue_handed_over()  # ordering.py's Note: prefetches handed over
                if begins and self.cache.recording:  # over this pass alone, not one dropped unused
                    self.cache.restart_recording()
                if rewind:
                    self.cache.rewind(prefetch)
            if grad and self.saved.needed(self.timeline) and not self._callers_saved_hooks():
                self.saved.begin_forward(self.timeline, by_reference=self.layout.final)
                opened.hooked = True
        except BaseException:
            self._close_forward(failed=True)
            raise

    def _callers_saved_hooks(self) -> bool:
        """Whether saved-tensor hooks of the caller are on (torch.utils.checkpoint around the
        model, torch.autograd.graph.save_on_cpu): then they keep what this forward saves, as they
        asked, and the engine's are not pushed inside them (Note: one bracket)."""
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is None:
            return False
        features = self.saved.features()
        if features and not self._warned_callers_hooks:
            self._warned_callers_hooks = True
            log.warning("zeroshard: a forward under saved-tensor hooks of the caller (torch.utils.checkpoint or "
                        "save_on_cpu around the model): they keep what it saves, without %s", " or ".join(features))
        return True

    def _close_stale_forward(self) -> None:
        """A forward of the model called as itself that a BaseException interrupted (Note: nested
        and interrupted calls): closed, with a warning."""
        opened = self._open
        if opened is None or opened.step_function or _on_stack(opened.frame):
            return
        log.warning("zeroshard: the previous forward of the model was interrupted; it is closed now")
        self._close_forward(failed=True)

    def _expect_idle(self, call: str) -> None:
        self._close_stale_forward()
        super()._expect_idle(call)

    def _close_forward(self, failed: bool) -> None:
        opened, self._open = self._open, None
        try:
            if opened.hooked and not self.saved.end_forward():
                log.warning("zeroshard: saved-tensor hooks pushed after an interrupted forward of the model are "
                            "still on: the engine's stay under them until its next forward")
            if failed:
                if self.hooks is not None:  # units whose forward the exception cut short: unpinned
                    self.hooks.close_open_forwards()
                return
            if opened.recording:  # re-pack in order of first use, rank 0's on every rank
                self.fix_layout(self.layout.first_use_order(self.params))
            if opened.tracking:
                self.timeline.sample("forward")
            if self.hooks is not None and not opened.grad:  # no backward's end issues them
                self.shards.issue_handed_over()
            self._settle()  # chunks this forward did not use
        finally:
            self.phase = TrainingPhase.IDLE
            if self._arrivals is not None:  # a compiled block interrupted by a BaseException
                self._arrivals.resume()

    def _compile_when_due(self) -> None:
        """Config `compile`: compile, as a forward starts, once the layout is final (runtime/compiled.py), with
        no pass under way (Note: forwards of one pass: a backward may recompute checkpointed blocks as they ran).
        Where the root's forward never ran (its modules called directly) it compiles the blocks."""
        if self.layout.final and self._compiler is not None and self.compiled is None and not self._forward_recorded:
            self.compiled = compile_forwards(self.module, self.stage, self.leaves, self.chunks, self._compiler,
                                             self.zeroshard_config.compile_scope if self._root_called else "blocks")
            if not self.compiled:
                log.warning("zeroshard: not compiled: the model is compiled whole at stage 3 (one chunk), a front "
                            "end replaced its forward since initialize, and it has no layer blocks to compile")
            if self._arrivals is not None and self.compiled != [self.module]:
                self._arrivals.wait_per_block(self.compiled)
        if self.compiled == [self.module] and self._arrivals is not None:  # the root's graph cannot wait (compiled.py)
            self._arrivals.settle()

    def compile_with(self, compiler) -> None:
        """Compile with `compiler` (a callable taking a function, returning its compiled form) instead
        of torch.compile with config `compile`'s arguments, which must be on (at stage 3 it chose the
        blocks at initialize); it takes effect where config `compile` would."""
        if self._compiler is None:
            raise ConfigError("zeroshard: compile_with needs config compile on (it picks what is compiled)")
        if self.compiled is not None:
            raise EngineCallError("zeroshard: compile_with after the model was compiled")
        self._compiler = compiler

    def thaw(self, names=frozenset()) -> None:
        """Make trainable the frozen chunks holding a parameter that now requires a gradient, or one
        named in `names` (a checkpoint holding its optimizer state); a delayed update lands first."""
        chunks = self.layout.unfrozen(names)
        if chunks:
            self.apply_delayed_update()
            self.layout.thaw(chunks)
            self.optim.adopt(self.chunks, chunks)

    def _follow_requires_grad(self) -> None:
        """Gradual unfreezing: a parameter set to require a gradient since initialize trains from
        this forward on, as in torch. Its chunk, if frozen, becomes trainable (Chunk.make_trainable;
        a delayed update in flight lands first) and the optimizer starts stepping it with no state;
        its gradients go into the chunk. Freezing again needs nothing: no gradient, no step."""
        new = [p for p in self._unhooked if p.requires_grad]
        if not new:
            return
        self.thaw()
        for p in new:
            p.register_post_accumulate_grad_hook(self._grad_arrived_hook)
        self._unhooked = [p for p in self._unhooked if not p.requires_grad]

    def fix_layout(self, order: list[nn.Parameter] | None = None) -> None:
        """Make the chunk layout final: re-pack the chunks in `order` if that differs, then stop
        recording first use. Re-packing needs an optimizer with no state."""
        if self.layout.final:
            return
        if order is not None and self.layout.differs(order):
            self._quiesce()  # and the user's writes so far into the masters the re-pack reads (user_writes.py)
            self.layout.repack(order)
            self.layout.adopt_shards()
            self.cache.set_chunks(self.chunks)
            self.optim.attach(self.chunks)
        self.layout.finalize()

    def _to_device(self, tree):
        """Inputs onto the device, floating ones in the compute dtype, through any pytree container."""
        cast = lambda x: x.to(self.dtype) if x.is_floating_point() else x  # noqa: E731
        return tree_map_only(torch.Tensor, lambda x: cast(x).to(self.device, non_blocking=True), tree)
