"""Calls that do not keep their object alive: hooks on modules and in autograd call the engine and
its parts through these, so a dropped engine does not live on in them (autograd keeps hooks in C++,
where the garbage collector cannot see a cycle through them)."""
from __future__ import annotations

import weakref


def weak_method(method):
    """A function that calls `method` while its object lives, and returns None after."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        m = ref()
        return m(*args) if m is not None else None
    return call
