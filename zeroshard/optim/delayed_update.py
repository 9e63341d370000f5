"""The delayed update (ZeRO-Offload's DPU, config `delay_update_after`; the lifecycle is in
optimizer.py's docstring): the host step of step t runs in a background thread and lands at step
t+1's step(). DelayedUpdate is the part of ShardedOptimizer (optimizer.py, the one class built on
it) that launches and lands it; its attributes are set by ShardedOptimizer.__init__.
"""
from __future__ import annotations

import enum
import threading

import torch

from ..errors import DivergedError, EngineCallError, PeerLostError, invariant
from ..runtime.offload import fold_host_grad
from .grad_agreement import sum_across


class UpdateState(enum.Enum):
    """The delayed update's lifecycle (optimizer.py's docstring)."""

    IDLE = "idle"
    IN_FLIGHT = "in flight"


def write_lost(names: list[str]) -> EngineCallError:
    """The error for parameters (`names`) written in place while a delayed update was in flight."""
    more = f" and {len(names) - 1} more parameters" if len(names) > 1 else ""
    return EngineCallError(
        f"zeroshard: {names[0]}{more} written in place while the delayed update (delay_update_after) was in "
        "flight: the update lands over the write, which is not kept. Write between engine.step() and the next "
        "forward inside `with engine.full_parameters():` (it lands the update first), or turn delay_update_after off")


class DelayedUpdate:
    """Launching and landing the delayed update (uses ShardedOptimizer's _update and _account,
    and Publishing's _gather_updated)."""

    def _launch(self) -> None:
        """IDLE -> IN_FLIGHT: hand this step's gradients to a background thread that steps the
        masters and writes the 16-bit result into staging; `land()` publishes it."""
        invariant(self.update is UpdateState.IDLE, lambda: f"a delayed update launched in {self.update}")
        self._state_bytes_at_launch = self.state_bytes()
        for c in self.chunks:  # pinned allocation takes seconds per GiB: once, here, not in the next forward
            if id(c) not in self._delay_staging:
                self._delay_staging[id(c)] = [c.transfer.host_empty(c.owned_numel, self.dtype).zero_(), None]
        grads = [c.take_host_grad() for c in self.chunks]
        if self.shards.hybrid:  # summed across the groups here, in chunk order, as step() does
            grads = [(g, None) for g in sum_across(self.shards, self.chunks, [fold_host_grad(h, p) for h, p in grads])]
        seen = self._grads_seen()
        # By value: an LR scheduler changes a tensor lr in place, possibly while the thread runs.
        hyper = [{k: v.clone() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
                 for g in self.optimizer.param_groups]
        inv = self._inv_scale()
        self.update = UpdateState.IN_FLIGHT
        # Not a daemon: one killed inside a torch kernel at interpreter exit aborts the process;
        # exit waits for the last update instead.
        self._thread = threading.Thread(target=self._run_delayed, args=(grads, seen, hyper, inv), daemon=False,
                                        name="zeroshard-delayed-update")
        self._thread.start()

    def _run_delayed(self, grads, seen, hyper, inv: float) -> None:
        """The background thread: everything of one host step but the upload."""
        try:
            if self.comm.device.type == "cuda":  # a new thread starts on device 0
                torch.cuda.set_device(self.comm.device)
            with torch.no_grad():
                opt = self.optimizer
                # A view of the optimizer with its own param groups (hyperparameters as at step());
                # it shares the state and every other attribute, changed ones are copied back on landing.
                view = object.__new__(type(opt))
                view.__dict__.update(opt.__dict__)
                view.param_groups = [dict(h, params=list(g["params"])) for h, g in zip(hyper, opt.param_groups)]
                # and its own step pre-hooks (the tiled step registers one per step: not in the user's
                # dict, where the main thread may register at the same time)
                view._optimizer_step_pre_hooks = type(opt._optimizer_step_pre_hooks)(opt._optimizer_step_pre_hooks)
                before = dict(view.__dict__)

                def to_staging(c, target):
                    if not self._all_copied(c, view):
                        target.copy_(c.master)

                outcome = self._update([fold_host_grad(h, p) for h, p in grads], seen, inv, self.side_comm, view,
                                       self._delay_target, to_staging)
                changed = {k: v for k, v in view.__dict__.items()
                           if k != "param_groups" and before.get(k, view) is not v}
                self._outcome = (*outcome, changed)
        except BaseException as e:  # re-raised in the main thread by land()
            self._outcome = e

    def _delay_target(self, c) -> torch.Tensor:
        """Chunk c's host staging buffer in the compute dtype, once the upload that last read it is
        done (called in the background thread: it waits, the main thread does not)."""
        slot = self._delay_staging[id(c)]
        if slot[1] is not None:
            slot[1].sync()
            slot[1] = None
        return slot[0]

    def land(self) -> bool | None:
        """IN_FLIGHT -> IDLE: wait for the delayed update and publish it (upload each chunk's new
        16-bit shard; at stages 1-2, all-gather it). Returns whether it was applied (False: fp16
        overflow skipped it), or None when no update was in flight: then the masters take the user's
        writes into the parameters since they last did (optim/user_writes.py). A write made while
        the update was in flight is lost under the update: EngineCallError, once that landed."""
        if self.update is UpdateState.IDLE:
            self.user_writes.carry()
            return None
        self._thread.join()
        self._thread, outcome, self._outcome = None, self._outcome, None
        self.update = UpdateState.IDLE
        if isinstance(outcome, (PeerLostError, DivergedError)):  # named already, for every rank alike
            raise outcome
        if isinstance(outcome, BaseException):  # raised as it is (its type is what callers catch), and said where
            outcome.add_note("zeroshard: raised by the delayed optimizer step, in its background thread")
            raise outcome
        applied, overflow, norm, changed = outcome
        self.optimizer.__dict__.update(changed)
        self._account(applied, overflow, norm)
        if not applied:
            return False
        self.applied_updates += 1
        for c in self.chunks:
            slot = self._delay_staging[id(c)]
            slot[1] = c.expect_arrival(c.transfer.to_device(slot[0], out=c.shard))  # waited for at first use
        self._gather_updated(compare=True)  # a rank whose background step failed raised above
        lost = self.user_writes.written()
        if lost:
            self.user_writes.forget()
            raise write_lost(lost)
        return True
