"""The tiled step: the user's optimizer steps runs of consecutive master pieces as a few cache-sized
tensors instead of one tensor per piece, with exactly the per-piece results (words:
docs/vocabulary.md, "span" and "tile").

Why tiles. torch's optimizers on the CPU run one tensor at a time (foreach and fused are opt-in
there): per piece a handful of Python-dispatched kernels, each making a temporary the piece's size.
One flat tensor per chunk would cut the Python work but makes every temporary the chunk's size:
out of cache, each kernel then streams every operand from memory, and the step gets 2-3x slower
(gpt2-tiny's 3.3M elements: 6.2 ms per piece, 17.9 ms flat). Tiles of TILE elements keep both:
a few calls per tile, temporaries that stay in cache. Measured here (AdamW, one thread, 2.13
CPU): gpt2-tiny 6.25 -> 5.50 ms, gpt2-small-cpu (23M elements) 50.8 -> 34.6 ms. On a GPU a span
is one tensor (no cache to fit; fewer launches).

The exact kernel. torch's Adam still makes seven passes over each tile; for torch's Adam and
AdamW on fp32 CPU spans, exact_adam.py's kernel makes one, with torch's bits, over the whole span.
It runs from a step pre-hook registered last for the step (`_step_exact`), so the user's
pre-hooks come first (an LR they set is the one used) and opt.step() still runs once: the spans
it steps lose their tiles' gradients, torch's step leaves them out and steps everything else.

Why exact. The optimizers stepped this way (ELEMENTWISE: torch's SGD, Adam and AdamW, exact
classes) compute each element from that element alone and from scalars (the step count, the
group's hyperparameters) that are equal across the span, so cutting the same elements into other
tensors changes no bit. A span holds only whole pieces whose lengths are multiples of VECTOR
elements, back to back, so each element also falls at the same place of a vector loop as it does
when its piece is stepped alone (a kernel's scalar tail could round differently where it uses no
fused multiply-add; none did on AVX512 here, but the rule costs nothing on real models).

Per-parameter semantics stay torch's: each piece keeps its own state entries (views of the span's
flat state, so state_dict, checkpoints and a user's reads see per-parameter tensors), its own step
count and its param group. A span steps as tiles only when every piece of it got a gradient and
their states agree (same keys, equal scalars); otherwise its pieces step one by one, as before,
and a span whose pieces' step counts came apart (a parameter skipped at some step) stays that way.
A piece's first step is always its own (torch makes its state), the span's flat state is made at
the next one by copying the pieces' states in; state replaced from outside (load_state_dict, a
checkpoint) is noticed and copied in again.
"""
from __future__ import annotations

import contextlib
import operator

import torch

from . import exact_adam

ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
TILE = 1 << 18  # elements (1 MiB of fp32): each kernel's operands and temporary stay in a core's cache
VECTOR = 64  # elements: a multiple of every CPU vector loop's stride (2 x 512 bits of fp32 is 32)


class Span:
    """Consecutive master pieces of one chunk in one param group, back to back in the master."""

    def __init__(self, chunk, group: int, pieces: list):
        self.chunk, self.group, self.pieces = chunk, group, pieces
        self.master = chunk.master  # the tensor the tiles view; a new master means a new layout
        self.lo, self.hi = pieces[0].lo - chunk.owned_range[0], pieces[-1].hi - chunk.owned_range[0]
        step = TILE if self.master.device.type == "cpu" else self.hi - self.lo
        self.bounds = [(a, min(a + step, self.hi)) for a in range(self.lo, self.hi, step)]
        base = self.master.detach()
        self.tiles = [torch.nn.Parameter(base[a:b]) for a, b in self.bounds]
        self.param_ids = {id(pc.param) for pc in pieces}
        self.tile_states: list[dict] | None = None  # None until the flat state is made (flatten)
        # (piece params, their state dicts, keys, the tensors expected there): one entry per piece and key
        self._checks: tuple[list, list, list, list] = ([], [], [], [])
        self._flats: dict[str, torch.Tensor] = {}  # state key -> the span's flat state of that key
        self._views: dict[tuple[int, str], torch.Tensor] = {}  # (id(piece param), key) -> its view of it
        self._piece_scalars: list[torch.Tensor] = []
        self._tile_scalars: list[torch.Tensor] = []

    @property
    def flat(self) -> bool:
        return self.tile_states is not None

    def intact(self, state) -> bool:
        """The pieces' state entries are still the views and scalars this span made."""
        params, sts, keys, expected = self._checks
        # map and operator.is_ keep the loop in C: it runs every step over every piece and key
        return all(map(operator.is_, map(state.get, params), sts)) and \
            all(map(operator.is_, map(dict.get, sts, keys), expected))

    def flatten(self, state) -> bool:
        """Make the span's flat state from its pieces' states (each piece's elementwise entries
        become views of it, holding the same values); False, and nothing changed, when the pieces'
        states do not agree (keys, shapes, scalar values) or are not made yet."""
        self.tile_states = None
        sts = [state.get(pc.param) for pc in self.pieces]
        if not sts[0] or any(not st or st.keys() != sts[0].keys() for st in sts):
            return False
        elementwise, scalars = [], []
        for k, v0 in sts[0].items():
            if torch.is_tensor(v0) and v0.shape == self.pieces[0].param.shape and v0.dim() > 0:
                if any(not (torch.is_tensor(st[k]) and st[k].shape == pc.param.shape and st[k].dtype == v0.dtype
                            and st[k].device == v0.device) for st, pc in zip(sts, self.pieces)):
                    return False
                elementwise.append(k)
            elif torch.is_tensor(v0) and v0.dim() == 0:
                if any(not (torch.is_tensor(st[k]) and st[k].dim() == 0 and torch.equal(st[k], v0)) for st in sts):
                    return False
                scalars.append(k)
            else:  # a plain number or anything else: not stepped as tiles
                return False
        checks, lo, origin = [], self.lo, self.chunk.owned_range[0]
        for k in elementwise:
            if all(st[k] is self._views.get((id(pc.param), k)) for pc, st in zip(self.pieces, sts)):
                checks += [(pc.param, st, k, st[k]) for pc, st in zip(self.pieces, sts)]
                continue  # still the views of this span's flat state (its pieces stepped one by one)
            v0 = sts[0][k]
            flat = torch.empty(self.hi - self.lo, dtype=v0.dtype, device=v0.device)
            for pc, st in zip(self.pieces, sts):
                view = flat[pc.lo - origin - lo:pc.hi - origin - lo].view(pc.param.shape)
                view.copy_(st[k])
                st[k] = self._views[(id(pc.param), k)] = view
                checks.append((pc.param, st, k, view))
            self._flats[k] = flat
        for k in scalars:
            checks += [(pc.param, st, k, st[k]) for pc, st in zip(self.pieces, sts)]
        self.tile_states = [{**{k: self._flats[k][a - lo:b - lo] for k in elementwise},
                             **{k: sts[0][k].clone() for k in scalars}} for a, b in self.bounds]
        self._checks = tuple(map(list, zip(*checks))) if checks else ([], [], [], [])
        self._piece_scalars = [st[k] for k in scalars for st in sts]
        self._tile_scalars = [self.tile_states[0][k] for k in scalars for _ in sts]
        return True

    def stepped(self) -> None:
        """After the tiles stepped: each piece's scalars (its step count) take the tiles' values."""
        if self._piece_scalars:
            torch._foreach_copy_(self._piece_scalars, self._tile_scalars)

    def exact_tensors(self, grad: torch.Tensor) -> tuple | None:
        """((parameter, gradient, exp_avg, exp_avg_sq) of the whole span as flat fp32 CPU tensors,
        the tiles' step counts) for the exact Adam kernel; None where the flat state is not Adam's
        alone (amsgrad's third moment, another optimizer's keys) or a tensor is not such."""
        if self._flats.keys() != {"exp_avg", "exp_avg_sq"} or self.tile_states[0].keys() != {"step", *self._flats}:
            return None
        tensors = (self.master.detach()[self.lo:self.hi], grad[self.lo:self.hi],
                   self._flats["exp_avg"], self._flats["exp_avg_sq"])
        steps = [st["step"] for st in self.tile_states]
        if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                   for t in (*tensors, *steps)):
            return None
        return tensors, steps


class TiledStep:
    """Which pieces step as tiles, and the optimizer's param groups and state swapped to match
    for one step (`stepping`)."""

    def __init__(self):
        self._spans: dict[int, list[Span]] = {}  # id(chunk) -> its spans
        self._loose: dict[tuple, list[list]] = {}  # (chunks stepped, spans tiled) -> other pieces, per group
        self._groups_seen: list[tuple] = []  # _groups_key at build
        self._exact: set[int] = set()  # the groups whose spans the exact kernel may step (exact_adam.py)

    def build(self, opt, chunks) -> None:
        """The spans of `chunks` (the trainable ones the optimizer steps), given the pieces' param
        groups in `opt` now. None for an optimizer that is not ELEMENTWISE (its step may read a
        tensor as a whole) or whose gradients are differentiable, nor for chunks whose master the
        disk tier swaps in and out."""
        self._spans, self._loose, self._exact = {}, {}, set()
        self._groups_seen = _groups_key(opt)
        if type(opt) not in ELEMENTWISE or any(g.get("differentiable") for g in opt.param_groups):
            return
        group_of = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        chunks = [c for c in chunks if c.tier is None and c.master is not None]
        if exact_adam.fits_optimizer(opt):
            self._exact = self._exact_groups(opt, chunks, group_of)
        for c in chunks:
            spans, run = [], []
            for pc in c.pieces:
                g = group_of.get(id(pc.param))
                fits = g is not None and (pc.hi - pc.lo) % VECTOR == 0
                if run and fits and g == run[-1][1] and pc.lo == run[-1][0].hi:
                    run.append((pc, g))
                    continue
                spans += self._span_of(c, run)
                run = [(pc, g)] if fits else []
            spans += self._span_of(c, run)
            if spans:
                self._spans[id(c)] = spans

    @staticmethod
    def _exact_groups(opt, chunks, group_of) -> set[int]:
        """The groups the exact kernel may step spans of: it fits them now, and every tensor in
        them is on the CPU or foreach is off (torch picks foreach from the tensors that have a
        gradient, so spans on the CPU that the kernel took out of a group of CUDA pieces too
        would turn the rest to the foreach step, which rounds otherwise on CUDA). Empty where
        the kernel is not wanted for the elements it could step, or cannot be built."""
        groups = {i for i, g in enumerate(opt.param_groups) if exact_adam.fits_group(g)
                  and (g.get("foreach") is False or all(p.device.type == "cpu" for p in g["params"]))}
        elements = sum(pc.hi - pc.lo for c in chunks if c.master.device.type == "cpu" for pc in c.pieces
                       if group_of.get(id(pc.param)) in groups and (pc.hi - pc.lo) % VECTOR == 0)
        if not elements or not exact_adam.wanted(elements) or exact_adam.ops() is None:
            return set()
        return groups

    def _span_of(self, c, run) -> list[Span]:
        # one small piece alone gains nothing from tiles (a large one does), but one pass of the
        # exact kernel in place of torch's seven it does
        if len(run) > 1 or (run and (run[0][0].hi - run[0][0].lo > TILE or run[0][1] in self._exact)):
            return [Span(c, run[0][1], [pc for pc, _ in run])]
        return []

    def current(self, opt) -> bool:
        """The groups still hold what build() saw (a copy of the lists too: the delayed update
        steps a view of the optimizer whose groups copy the lists)."""
        return self._groups_seen == _groups_key(opt)

    @contextlib.contextmanager
    def stepping(self, opt, chunks, grad_of):
        """Inside: `opt`'s groups hold the tiles of every span of `chunks` whose pieces all got a
        gradient and whose flat state is made (or made now), and every other piece of `chunks`
        as itself; the tiles' states are in its state beside the pieces' own, for the step only.
        `grad_of(chunk)`: the fp32 gradient of the chunk's owned range the pieces' .grad view.
        After a step that did not raise, the pieces' scalars follow the tiles'. With no tile and
        every piece stepping, nothing changes. A step hook the user registered on the optimizer
        sees the groups as they are inside (tiles among the pieces); a post-hook sees no gradient
        on the tiles of spans the exact kernel stepped."""
        state = opt.state
        params = [[] for _ in opt.param_groups]
        tiled: list[Span] = []
        exact: list[tuple[Span, tuple, list]] = []
        for c in chunks:
            for span in self._spans.get(id(c), ()):
                if span.master is not c.master or any(pc.param.grad is None for pc in span.pieces):
                    span.tile_states = None  # its pieces step one by one: their scalars may come apart
                    continue
                if not (span.flat and span.intact(state)) and not span.flatten(state):
                    continue
                g = grad_of(c)
                for t, (a, b) in zip(span.tiles, span.bounds):
                    t.grad = g[a:b]
                params[span.group] += span.tiles
                tiled.append(span)
                tensors = span.exact_tensors(g) if span.group in self._exact else None
                if tensors is not None:
                    exact.append((span, *tensors, [t.grad for t in span.tiles]))
        key = (tuple(id(c) for c in chunks), tuple(id(s) for s in tiled))
        loose = self._loose.get(key)
        if loose is None:  # the same every step while the same spans step as tiles
            if len(self._loose) > 64:  # presence that changes step by step (routed experts)
                self._loose.clear()
            keep = {id(pc.param) for c in chunks for pc in c.pieces}
            in_span = {i for span in tiled for i in span.param_ids}
            loose = self._loose[key] = [[p for p in g["params"] if id(p) in keep and id(p) not in in_span]
                                        for g in opt.param_groups]
        if not tiled and all(len(ls) == len(g["params"]) for ls, g in zip(loose, opt.param_groups)):
            yield  # every piece steps as itself: the optimizer as the user built it
            return
        saved = [g["params"] for g in opt.param_groups]
        for g, ps, ls in zip(opt.param_groups, params, loose):
            g["params"] = ps + ls
        for span in tiled:
            state.update(zip(span.tiles, span.tile_states))
        # Registered last, so it runs after the user's pre-hooks (an LR change there is seen)
        hook = opt.register_step_pre_hook(lambda o, args, kwargs: _step_exact(o, exact)) if exact else None
        try:
            yield
        except BaseException:
            for span in tiled:  # the tiles may have stepped part way: make the flat state again
                span.tile_states = None
            raise
        else:
            for span in tiled:
                span.stepped()
        finally:
            if hook is not None:
                hook.remove()
            for g, ps in zip(opt.param_groups, saved):
                g["params"] = ps
            for span in tiled:
                for t in span.tiles:
                    state.pop(t, None)
                    t.grad = None


def _step_exact(opt, exact: list[tuple[Span, tuple, list, list]]) -> None:
    """The optimizer's step pre-hook: each span whose group the exact kernel takes (exact_adam.py,
    checked now, after the user's pre-hooks) is stepped by it as one tensor, and its tiles lose
    their gradients, so torch's step that follows leaves them out; the rest torch steps, as it
    does a span whose tiles' gradients a user's pre-hook replaced."""
    takes: dict[int, bool] = {}  # group index -> the kernel takes it (asked once per group, not per span)
    for span, tensors, steps, grads in exact:
        group = opt.param_groups[span.group]
        if span.group not in takes:
            takes[span.group] = exact_adam.fits_group(group) and exact_adam.agrees(type(opt), group)
        if not (takes[span.group] and all(map(operator.is_, (t.grad for t in span.tiles), grads))):
            continue
        torch._foreach_add_(steps, 1.0)  # as torch counts: before the update
        exact_adam.step_(*tensors, group, steps[0].item())
        span.stepped()  # now: a failure later in this step leaves the pieces' counts with their moments
        for t in span.tiles:
            t.grad = None


def _groups_key(opt) -> list[tuple[int, int, int]]:
    """Per group: how many tensors, the first's and the last's id (ParamGroups.assign, after which
    build() runs, gives the groups new pieces; a user's change of a group shows here)."""
    return [(len(ps), id(ps[0]), id(ps[-1])) if ps else (0, 0, 0) for ps in (g["params"] for g in opt.param_groups)]
