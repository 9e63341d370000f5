"""The values of what the profiled step computes from its inputs and buffers alone.

A meta tensor has no values, yet models read some: a loss checks its labels (`if labels.max() >=
vocab_size: raise`, as wav2vec2's CTC head does), attention checks its mask (`if mask.all():`, a path
without masking), packed sequences are found from position ids. Where what is read derives from
the example inputs and buffers only (no parameter, no activation), the value is known: each such
meta tensor keeps a real CPU twin ("its value"), computed by the same operator on the twins of its
arguments. A read of a tensor with a value gives that value; any other read is assumed
(meta_counters.py's `_assumed_value`).

Only small tensors get values (at most VALUE_LIMIT elements: a micro-batch's ids and masks, not a
sequence-squared mask), random operators and collectives never do (_pure), and
a tensor written by an operator without values loses its value along with every tensor sharing its
storage (a view written through, a buffer updated from activations).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

VALUE_LIMIT = 1 << 22  # elements of one tensor given a value
STAND_IN_LIMIT = 1 << 24  # elements of zeros an operator without a meta kernel may be run on (instead)


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors `func` writes in place (its schema's mutable arguments)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        t = args[i] if i < len(args) else kwargs.get(a.name)
        flat, _ = tree_flatten(t)
        out.extend(x for x in flat if isinstance(x, torch.Tensor))
    return out


def _pure(func) -> bool:
    """Whether running `func` once more, on CPU twins, does no more than compute: not random (it would
    draw from the user's generator), not a collective (only rank 0 profiles: the others would never
    join it)."""
    tags = getattr(func, "tags", None)
    return (tags is not None and torch.Tag.nondeterministic_seeded not in tags
            and getattr(func, "namespace", "") not in ("_c10d_functional", "c10d", "c10d_functional"))


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class InputValues:
    """Real values of meta tensors computed from the inputs and buffers alone (see the module's
    docstring). `give` seeds one; `follow` runs after each operator of the profiled step;
    `value_of` answers a read."""

    def __init__(self):
        self._values = WeakTensorKeyDictionary()
        self._stale: set[int] = set()  # meta storages written without values since their tensors got one

    def give(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        if meta.device.type == "meta" and real.numel() <= VALUE_LIMIT:
            self._values[meta] = real.detach().to("cpu", meta.dtype)

    def value_of(self, meta: torch.Tensor) -> torch.Tensor | None:
        if _storage_key(meta) in self._stale:
            return None
        return self._values.get(meta)

    def follow(self, func, args, kwargs, out) -> None:
        """After `func(*args, **kwargs)` returned `out` (meta tensors): give its outputs values when
        every meta argument has one, else mark what it wrote as without value."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        got = self._run(func, args, kwargs) if outs and all(t.numel() <= VALUE_LIMIT for t in outs) else None
        reals = None if got is None else _tensors(got)
        if reals is None or len(reals) != len(outs) or any(
                r.shape != m.shape or r.dtype != m.dtype for r, m in zip(reals, outs)):
            for t in _written(func, args, kwargs):
                if t.device.type == "meta":
                    self._stale.add(_storage_key(t))
            return
        for m, r in zip(outs, reals):
            self._values[m] = r
            self._stale.discard(_storage_key(m))

    def instead(self, func, args, kwargs):
        """For an operator without a meta kernel (CTC's loss) or whose output's shape depends on
        values (nonzero, masked_select, unique): its outputs as meta tensors, from a run on the CPU
        on the arguments' values, or zeros where one has none (what the operator computes from them
        is never read, only shaped; at most STAND_IN_LIMIT elements of zeros), those outputs with
        values where every argument had one. None where the operator writes in place, draws random
        numbers, is a collective, its stand-ins would be too large, or it fails on them (a mixture
        of experts whose routing reads its router's output: the profile fails as before)."""
        tensors = _tensors((args, kwargs))
        missing = [t for t in tensors if t.device.type == "meta" and self.value_of(t) is None]
        if (not _pure(func) or _written(func, args, kwargs) or sum(t.numel() for t in missing) > STAND_IN_LIMIT
                or any(t.device.type not in ("meta", "cpu") for t in tensors)):
            return None

        def real(x):
            if isinstance(x, torch.Tensor) and x.device.type == "meta":
                value = self.value_of(x)
                return torch.zeros_like(x, device="cpu") if value is None else value
            return self._real(x)
        try:
            got = func(*tree_map(real, args), **tree_map(real, kwargs))
        except Exception:  # noqa: BLE001 -- the profile raises the meta kernel's own error instead
            return None
        metas = tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, got)
        if not missing:
            for m, r in zip(_tensors(metas), _tensors(got)):
                self.give(m, r)
        return metas

    def _real(self, x):
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return self.value_of(x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    def _run(self, func, args, kwargs):
        """`func` on the values of its arguments (their CPU twins): what it returns, or None where
        an argument has no value, the operator is random or one of its tensors is on a device
        (other than the CPU) that would take the work."""
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" and self.value_of(t) is None for t in tensors) or any(
                t.device.type not in ("meta", "cpu") for t in tensors) or not _pure(func):
            return None
        try:
            got = func(*tree_map(self._real, args), **tree_map(self._real, kwargs))
        except Exception:  # noqa: BLE001 -- an operator the CPU lacks: its outputs simply have no value
            return None
        return got
