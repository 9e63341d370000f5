"""Note: writes into parameters (stage 3). A user's in-place write into a parameter (a clamp inside
a forward; between steps `p.clamp_()` as WGAN clips its critic, `nn.init.*`, `p[0] = v`,
`torch._foreach_mul_`) lands in the gathered chunk, a copy that is freed or overwritten at the next
gather: kept nowhere else, it was silently lost (or, outside every forward, refused). Each real
parameter's version counter tells which were written: every in-place op on it bumps it, and nothing
zeroshard does (gathers rebind its data, which keeps the counter). When a unit's forward ends, and
after an operation that read parameters outside every forward (runtime/hooks.py), the written
parameters' values go into this rank's shard and, where it is apart, the fp32 master
(Chunk.keep_written), while the chunk is still gathered. Every rank runs the same write on the same
gathered values, so the shards agree. Not seen: a write through `p.data`, whose counter is its own
(refused outside every forward; inside a forward, lost as before).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


class WrittenParameters:
    """The real parameters' version counters as last seen; `keep(params)` is given those written since."""

    def __init__(self, params: Iterable, keep: Callable[[list], None]):
        self._params = list(params)
        self._keep = keep
        self.rebase()

    def changed(self, params: Iterable | None = None) -> list:
        """The parameters among `params` (default: every one) written since last seen."""
        return [p for p in (self._params if params is None else params) if p._version != self._seen[id(p)]]

    def check(self, params: Iterable | None = None) -> None:
        """Hand the parameters among `params` (default: every one) written since last seen to `keep`."""
        written = self.changed(params)
        if written:
            for p in written:
                self._seen[id(p)] = p._version
            self._keep(written)

    def seen(self, param) -> None:
        """`param`'s version moved with no write (torch's parametrize set it to itself)."""
        if id(param) in self._seen:
            self._seen[id(param)] = param._version

    def rebase(self) -> None:
        """Start from the versions now: what was written so far is kept by other means
        (engine.full_parameters writes every parameter back), or lost (the delayed update landed over it)."""
        self._seen = {id(p): p._version for p in self._params}
