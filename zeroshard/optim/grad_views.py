"""The master pieces' .grad: views of the chunks' reduced gradients, which the user's optimizer
reads. Where the gradient is a buffer that outlives the step (stages 0-1, fp32, optimizer on the
device: the chunk's grad_full), the views are made once and stay on the pieces between steps, as
a plain model's .grad stays between steps: a step then makes no tensor and sets no .grad (at
gpt2-tiny's 52 pieces, 0.2-0.3 ms of an 11 ms step here). Any other gradient (a 16-bit one's fp32
copy, a stage 2-3 shard made anew each step) is viewed for one step and let go after it."""
from __future__ import annotations

import torch


class GradViews:
    """Sets and clears the master pieces' .grad; owns the views kept between steps."""

    def __init__(self):
        self._kept: dict[int, tuple[object, int, list[torch.Tensor]]] = {}  # id(chunk) -> (chunk, data_ptr, views)
        self._bound: dict[int, torch.Tensor] = {}  # id(chunk) -> the gradient bound this step

    def bound(self, c) -> torch.Tensor:
        """The fp32 gradient of chunk c's owned range that its pieces' .grad view this step."""
        return self._bound[id(c)]

    def bind(self, c, g: torch.Tensor, has_grad: list[bool], lasting: bool) -> None:
        """Point the .grad of chunk c's pieces that got a gradient (`has_grad`, per slot) at their
        part of `g` (the owned range), the others' at None. `lasting`: g is a buffer that outlives
        the step (its views may stay)."""
        lo = c.owned_range[0]
        self._bound[id(c)] = g
        entry = self._kept.get(id(c))
        if lasting and entry is not None and entry[0] is c and entry[1] == g.data_ptr():
            views = entry[2]
        else:
            views = [g[pc.lo - lo:pc.hi - lo].view(pc.shape) for pc in c.pieces]
            if lasting:
                self._kept[id(c)] = (c, g.data_ptr(), views)
            else:
                self._kept.pop(id(c), None)
        for pc, view in zip(c.pieces, views):
            want = view if has_grad[pc.index] else None
            if pc.param.grad is not want:
                pc.param.grad = want

    def drop(self, chunks, keep_lasting: bool = False) -> None:
        """Clear the pieces' .grad, but, with `keep_lasting`, those of chunks whose views stay."""
        for c in chunks:
            self._bound.pop(id(c), None)
            if keep_lasting and id(c) in self._kept:
                continue
            self._kept.pop(id(c), None)
            for pc in c.pieces:
                pc.param.grad = None

    def retain(self, chunks) -> None:
        """The optimizer steps `chunks` from now on: let go of the views of any other chunk (a
        re-pack or a thaw made new ones) and clear their pieces' .grad."""
        ids = {id(c) for c in chunks}
        for key in [k for k in self._kept if k not in ids]:
            for pc in self._kept.pop(key)[0].pieces:
                pc.param.grad = None
