"""A collective's work, wrapped: what Comm (collectives.py) hands back for a collective that needs
more than torch's work object (a step after it, a timeout named, several messages as one). Each has
wait() and is_completed(), as torch's works do."""
from __future__ import annotations

import torch

from .ordering import wait_for


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
    """Several works (the messages of one collective) as one."""

    def __init__(self, works):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def staged(work, host: torch.Tensor, dest: torch.Tensor) -> Then:
    """A collective on host copies of CUDA tensors (gloo group): `wait()` copies the result back."""
    return Then(work, lambda: dest.copy_(host))
