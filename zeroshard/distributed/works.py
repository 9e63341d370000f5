"""A collective's work, wrapped: what Comm (collectives.py) hands back for a collective that needs
more than torch's work object (a step after it, a timeout named, several messages as one). Each has
wait() and is_completed(), as torch's works do."""
from __future__ import annotations

import datetime

import torch

from .ordering import hold_unfinished, wait_for


class Then:
    """A collective's work that runs `then()` once, when first waited for (a copy back from the
    host, the local sum of an all-to-all)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.then()
        return True


class Timed:
    """A collective's work whose wait() raises CollectiveTimeoutError naming it on a timeout."""

    def __init__(self, work, what, timeout_s: float):
        self.work, self.what, self.timeout_s = work, what, timeout_s

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        wait_for(self.work, self.what, self.timeout_s)
        return True


class AllOf:
    """Several works (the messages of one collective) as one. Until waited for or seen completed it
    is held, with `tensors` (what its messages read and write), so a prefetched gather whose
    engine was let go of is never dropped with its messages in flight; `finish_held` settles the
    held ones before the process groups go at exit."""

    _held: dict[int, "AllOf"] = {}  # id -> one not yet seen completed, pruned as new ones start

    def __init__(self, works, tensors=()):
        self.works, self.tensors = works, tuple(tensors)
        for key, held in list(AllOf._held.items()):
            if held.is_completed():  # done: its works (and through them its group) are let go of
                held.works = []
                del AllOf._held[key]
        AllOf._held[id(self)] = self

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        AllOf._held.pop(id(self), None)
        return True


def finish_held(timeout_s: float = 5.0) -> None:
    """At exit, before the process groups are taken down: wait (a few seconds at most) for the
    messages still in flight (or done but never waited for: a chunk prefetched for a forward that
    never came), so no work keeps a group and its threads alive. One that does not
    finish (its peer is gone) leaves its tensors never freed (ordering.hold_unfinished)."""
    for held in list(AllOf._held.values()):
        try:
            held.wait(datetime.timedelta(seconds=timeout_s))
            held.works = []  # whatever still holds it (a chunk's gather) no longer holds a group
        except RuntimeError:
            hold_unfinished(id(held), held)
    AllOf._held.clear()


def staged(work, host: torch.Tensor, dest: torch.Tensor) -> Then:
    """A collective on host copies of CUDA tensors (gloo group): `wait()` copies the result back."""
    return Then(work, lambda: dest.copy_(host))
