"""The one module that talks to torch.distributed.

Every collective zeroshard issues goes through `Comm`, which
- counts payload elements the way the ZeRO paper counts volume: an all-reduce of M elements counts
  2M, a reduce-scatter or all-gather counts M, M being the full (unsharded) size;
- handles gloo's quirks once: reduce-scatter always uses SUM (callers divide), equal-size shards;
  on gloo it is an all-to-all as messages and a local sum (see `reduce_scatter_sum`);
- turns a world of one process (no process group) into local copies, so world size 1 runs the same
  code path as world size N;
- runs CUDA tensors over a gloo group (ranks sharing one GPU: NCCL refuses that) by staging them
  through host copies, so the engine's code is the same whatever the backend;
- with order checks on (ordering.py), issues each collective a module hook drives only after every
  rank handed over the same tag, so a divergent call order raises DivergedError instead of hanging.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import warnings
import weakref

import torch
import torch.distributed as dist

from ..numerics import sum_rows
from . import p2p
from .buffers import BufferPool
from .works import Then, Timed, finish_held, staged
from .ordering import (FAILED_STEP, OTHER, OrderCheck, Sequencer, check_group, collective_timeout,
                       describe_tag, forget_check_groups, has_check_group, order_tag, set_collective_timeout,
                       wait_for, waiting)
from ..errors import EngineCallError

# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases (the CUDA images in use
# carry 2.11) have only the old names, with the same arguments.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_device() -> torch.device:
    """cuda:LOCAL_RANK with CUDA (ranks beyond the GPU count wrap around and share), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def ranks_per_node() -> int:
    """Processes on this node, from torchrun's environment (LOCAL_WORLD_SIZE; WORLD_SIZE if unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def shares_gpus() -> bool:
    """More processes on this node than visible GPUs: some must share one."""
    return torch.cuda.is_available() and ranks_per_node() > torch.cuda.device_count()


def init_process_group(device: torch.device | None = None, timeout_s: float | None = None) -> None:
    """Join torchrun's process group if its environment is set and none exists yet, with
    collectives that wait `timeout_s` (config collective_timeout_s) for the other ranks; a group
    the user made keeps its own timeout, with a warning when that is longer.

    gloo for CPU tensors, NCCL for CUDA, except where several ranks share one GPU (NCCL needs a
    device per rank): then gloo, with CUDA tensors staged through the host (slow; for tests and
    debugging on a single-GPU machine). Without torchrun's environment the world is one process and
    no group is created.
    """
    if timeout_s is not None:
        set_collective_timeout(timeout_s)
    if dist.is_available() and dist.is_initialized() and timeout_s is not None:
        theirs = _group_timeout(dist.group.WORLD)
        if theirs is not None and theirs > collective_timeout():
            warnings.warn(f"zeroshard: the process group was made with a timeout of {theirs.total_seconds():g} s, "
                          f"longer than collective_timeout_s={timeout_s:g}: a stopped rank keeps the others waiting "
                          "that long (pass timeout= to init_process_group, or let zeroshard make the group)")
    if not _exit_hook[0]:
        atexit.register(_take_down_groups)
        _exit_hook[0] = True
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        cuda = device is not None and device.type == "cuda"
        shared = cuda and shares_gpus()
        if shared:
            warnings.warn(f"zeroshard: {ranks_per_node()} ranks share {torch.cuda.device_count()} GPU(s); NCCL "
                          "needs one GPU per rank, so collectives run over gloo through host memory (slow)")
        backend = "nccl" if cuda and not shared else "gloo"
        dist.init_process_group(backend, timeout=collective_timeout())


_exit_hook = [False]  # _take_down_groups is registered
_comms: weakref.WeakSet = weakref.WeakSet()  # every Comm of this process


def _take_down_groups() -> None:
    """At interpreter exit, while Python is still whole: every process group goes, and with it
    gloo's worker threads. Left to the interpreter's teardown, a worker that drops the last
    reference to a finished collective's tensor a moment late must take the GIL to release its
    Python object; CPython then ends that thread with pthread_exit, whose unwinding through torch's
    C++ frames aborts the process ("terminate called without an active exception", SIGABRT) after
    a finished run. Only a group's destructor joins its workers, so zeroshard's own references go
    first (each Comm's groups, the check groups), then every group (as torch asks a program to do
    before it exits; Lightning does it for NCCL). Registered by the first init_process_group; an
    atexit handler registered earlier (the user's, Lightning's) runs after it and finds no group."""
    for comm in list(_comms):
        comm.close()
    finish_held()
    forget_check_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held in reference cycles: their destructors run now, not in the teardown


def _group_timeout(group) -> datetime.timedelta | None:
    """A process group's timeout, where torch tells it (None elsewhere)."""
    try:
        backend = group._get_backend(torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu"))
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


class Comm:
    """Counted collectives over one process group (or over a single process)."""

    def __init__(self, device: torch.device, group=None):
        self.device = device  # where control tensors live: NCCL needs them on the GPU
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.elements = 0  # payload volume since the last reset, counted as the ZeRO paper does
        self.control_collectives = 0  # small collectives on the group: overflow flags, norms
        self._counting = True  # off inside uncounted()
        self.sequencer: Sequencer | None = None  # with order checks on (enable_order_checks)
        self.pass_index = 0  # forward-backward passes this rank has run: part of every order tag
        self.step = 1  # the optimizer step training is working towards (the engine keeps it), for errors
        self.timeout_s = collective_timeout().total_seconds()
        self.gloo = self.distributed and dist.get_backend(group) == dist.Backend.GLOO
        # gloo carries CUDA tensors through host copies (see init_process_group)
        self.staged = self.gloo and device.type == "cuda"
        self.control_device = torch.device("cpu") if self.staged else device
        self.closed = False  # close() let go of the groups
        self._received = BufferPool(keep=3)  # reduce-scatters' receive buffers (two in flight, one summing)
        _comms.add(self)

    @property
    def leader(self) -> bool:
        """Rank 0 of the group: the source of set-up broadcasts."""
        return self.rank == 0

    def close(self) -> None:
        """Let go of the process groups (at interpreter exit: _take_down_groups); a collective
        after this raises."""
        self.group = self.sequencer = None
        self.closed = True

    def enable_order_checks(self) -> None:
        """Collective, at set-up: from now on a collective given a `tag` is issued only once every
        rank has handed over the same tag (ordering.py)."""
        if self.world > 1 and self.sequencer is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            # A new check group on every rank if any rank lacks one (after a divergence, only the
            # ranks that saw it know that the old one holds unpaired comparisons). And the
            # all-gathers' message tags go on from the highest any rank used: ranks that handed
            # over different gathers (a divergence) must pair none of this engine's with those
            # (ordering.py's Note: prefetches handed over).
            agreed = torch.tensor([0.0 if has_check_group(self.group) else 1.0,
                                   p2p.last_message_tag(self.group)],
                                  dtype=torch.float64, device=self.control_device)
            self.control_all_reduce(agreed, dist.ReduceOp.MAX)
            p2p.go_on_from(self.group, int(agreed[1].item()))
            check = OrderCheck(check_group(self.group, ranks, renew=bool(agreed[0].item())), self.rank,
                               where=self._where, timeout_s=self.timeout_s)
            self.sequencer = Sequencer(check, inline=self.device.type == "cuda")

    def progress(self) -> None:
        """Issue the tagged collectives whose order check has come back (cheap; hooks call it)."""
        if self.sequencer is not None:
            self.sequencer.progress()

    def issue_handed_over(self) -> None:
        """Issue the tagged collectives handed over so far, waiting for their order checks, at a
        point every rank reaches alike (ordering.py's Note: prefetches handed over)."""
        if self.sequencer is not None:
            self.sequencer.issue_handed_over()

    def agree(self, kind: int) -> None:
        """With order checks on: raise DivergedError on every rank unless every rank is entering
        the same phase (ordering.CHECKPOINT, PUBLISH) at the same micro-batch count."""
        if self.sequencer is not None:
            self.sequencer.agree(order_tag(kind, 0, self.pass_index))

    def mark_failed_step(self) -> None:
        """With order checks on: this rank's optimizer step raised after every rank agreed to apply
        it; its next comparison says so (ordering.FAILED_STEP), and every rank raises DivergedError
        there unless all of them failed alike."""
        if self.sequencer is not None:
            self.sequencer.check.mark(order_tag(FAILED_STEP, 0, self.pass_index))

    def announce(self, kind: int, alone: bool = False) -> None:
        """As agree, without waiting: the DivergedError comes before the result of the next
        collective on this group is read (Sequencer.announce, phase_alone). For a phase that changes
        nothing before its first collective, or has none (ordering.STEP; ordering.py says what a
        step without one means): `alone`, the tag then rides on the next comparison."""
        if self.sequencer is not None:
            self.sequencer.announce(order_tag(kind, 0, self.pass_index), alone)

    def _issue(self, tag: tuple[int, int] | None, collective, async_op: bool, purpose: str = "finish a collective"):
        """Issue `collective()` (async, returns its work). With order checks on: a tagged one once
        every rank handed over the same tag; an untagged blocking one after comparing a tag of its
        own (OTHER); an untagged async one (the all-gathers of an update) after everything handed
        over (ordering.py says why they need no comparison of their own). A lost or stopped
        peer, at the issue or the wait: PeerLostError naming the tag, or `purpose`, and the step."""
        self._refuse_if_closed()
        what = (lambda: describe_tag(order_tag(*tag, self.pass_index)) + self._where()) if tag is not None else \
            (lambda: f"{purpose} in micro-batch {self.pass_index}{self._where()}")
        issue = collective

        def collective():
            with waiting(what, self.timeout_s):
                return issue()
        if self.sequencer is None:
            work = collective()
        elif tag is not None:
            work = self.sequencer.submit(order_tag(*tag, self.pass_index), collective)
        elif async_op:
            self.sequencer.drain()
            work = collective()
        elif self.sequencer.phase_alone():  # issued beside the phase's comparison (ordering.py)
            work = collective()
            self.sequencer.drain()  # a disagreement raises before the result is read
        else:
            self._agree_here()
            work = collective()
        if async_op:
            return work if work is None or self.sequencer is not None and tag is not None \
                else Timed(work, what, self.timeout_s)  # a Ticket names its own timeouts
        if work is not None:
            wait_for(work, what, self.timeout_s)
        return None

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise EngineCallError("zeroshard: a collective after the process groups were taken down at interpreter exit")

    def _where(self) -> str:
        return f" at optimizer step {self.step}"

    def _agree_here(self) -> None:
        """Before an untagged blocking collective (a norm, a flag, objects)."""
        if self.sequencer is not None:
            self.sequencer.agree(order_tag(OTHER, 0, self.pass_index))

    @property
    def order_checks(self) -> int:
        """Tag comparisons since the last reset_counters (ordering.py)."""
        return 0 if self.sequencer is None else self.sequencer.check.comparisons

    def at(self, pass_index: int | None = None, step: int | None = None) -> None:
        """Where training is, for order tags and errors: the forward-backward pass (micro-batch)
        this rank runs, and the optimizer step it works towards."""
        if pass_index is not None:
            self.pass_index = pass_index
        if step is not None:
            self.step = step

    @contextlib.contextmanager
    def uncounted(self):
        """Collectives issued inside are not step traffic (a re-pack, a checkpoint's refresh, a
        fingerprint): `elements` leaves them out."""
        before, self._counting = self._counting, False
        try:
            yield
        finally:
            self._counting = before

    def reset_counters(self) -> None:
        self.elements = 0
        self.control_collectives = 0
        if self.sequencer is not None:
            self.sequencer.check.reset_counters()

    def side_channel(self) -> "Comm":
        """Collective, at set-up: a Comm over a new gloo group of the same ranks, for host tensors,
        for a thread that issues collectives while the main thread issues its own (the delayed
        update's norm and overflow checks). Within one group, two threads' collectives would be
        paired across ranks in whatever order each rank happened to issue them."""
        if self.world == 1:
            return Comm(torch.device("cpu"), self.group)
        ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
        return Comm(torch.device("cpu"), dist.new_group(ranks, backend="gloo", timeout=collective_timeout(),
                                                        use_local_synchronization=ranks is not None))

    def _count(self, n: int) -> None:
        if self._counting and self.world > 1:
            self.elements += n

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   tag: tuple[int, int] | None = None):
        """full[r*s:(r+1)*s] <- shard of rank r, for every r. Counts len(full). `tag`: (kind,
        chunk index) for the order check, on a collective a module hook drives."""
        self._count(full.numel())
        if self.world == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return None
        if self.staged:
            def collective():
                host = torch.empty(full.shape, dtype=full.dtype)
                return staged(_all_gather_single(host, shard.cpu(), group=self.group, async_op=True), host, full)
        elif self.gloo:
            message_tag = p2p.next_message_tag(self.group)  # fixed when handed over, not when issued

            def collective():
                return p2p.all_gather(self.group, self.rank, self.world, full, shard, message_tag)
        else:
            def collective():
                return _all_gather_single(full, shard, group=self.group, async_op=True)
        return self._issue(tag, collective, async_op, "all-gather a chunk")

    def reduce_scatter_sum(self, full: torch.Tensor, async_op: bool = False, tag: tuple[int, int] | None = None):
        """In place: this rank's shard of `full` <- the sum over ranks of that shard. Counts len(full).
        (NCCL accepts an output that is the input's own slot.)

        On gloo it is an all-to-all as messages (p2p.exchange_slots: each rank receives every rank's
        copy of its slot, the bytes a reduce-scatter moves) and a local sum in rank order when waited
        for (numerics.sum_rows): for 13 MB between 2 ranks here gloo's own reduce-scatter took
        21 ms, its all-reduce 13 ms, gloo's all-to-all and a sum 12 ms. It holds a receive buffer of
        len(full) until then, kept for the next (buffers.py)."""
        self._count(full.numel())
        if self.world == 1:
            return None
        s = full.numel() // self.world
        shard = full[self.rank * s:(self.rank + 1) * s]

        message_tag = p2p.next_message_tag(self.group) if self.staged or self.gloo else None  # at hand-over

        def exchange(src: torch.Tensor, dest: torch.Tensor, then=None) -> Then:
            received = self._received.take(src.numel(), src.dtype, src.device)
            work = p2p.exchange_slots(self.group, self.rank, self.world, src, received, message_tag)

            def total():  # dest is src's own slot: this rank's row of the sum
                sum_rows(received.view(self.world, s), dest, out_row=self.rank)
                self._received.give(received)  # (an abandoned reduction's is never given back)
                if then is not None:
                    then()
            return Then(work, total)
        if self.staged:
            def collective():
                host = full.cpu()
                host_shard = host[self.rank * s:(self.rank + 1) * s]
                return exchange(host, host_shard, lambda: shard.copy_(host_shard))
        elif self.gloo:
            def collective():
                return exchange(full, shard)
        else:
            def collective():
                return _reduce_scatter_single(shard, full, group=self.group, async_op=True)
        return self._issue(tag, collective, async_op, "reduce-scatter gradients")

    def all_reduce_sum(self, t: torch.Tensor, async_op: bool = False, tag: tuple[int, int] | None = None,
                       counted: int | None = None):
        """t <- sum over ranks of t, in place. Counts 2*len(t), or 2*`counted` (elements of t that
        are model data: a chunk's gradient without the flags riding behind it)."""
        self._count(2 * (t.numel() if counted is None else counted))
        if self.world == 1:
            return None
        if self.staged:
            def collective():
                host = t.cpu()
                return staged(dist.all_reduce(host, group=self.group, async_op=True), host, t)
        else:
            def collective():
                return dist.all_reduce(t, group=self.group, async_op=True)
        return self._issue(tag, collective, async_op, "all-reduce gradients")

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Uncounted: used only at set-up, outside any step."""
        if self.world > 1:
            src = dist.get_global_rank(self.group, src) if self.group else src
            self._in_place(t, lambda x: dist.broadcast(x, src=src, group=self.group, async_op=True),
                           f"receive rank {src}'s values")

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s picklable `obj`, on every rank (set-up and checkpoints, not steps)."""
        if self.world == 1:
            return obj
        self._agree_here()
        box = [obj]
        with waiting(lambda: f"receive rank {src}'s decision in micro-batch {self.pass_index}{self._where()}",
                     self.timeout_s):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src) if self.group else src,
                                       group=self.group)
        return box[0]

    def all_gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        self._agree_here()
        out = [None] * self.world
        with waiting(lambda: f"hear from every rank in micro-batch {self.pass_index}{self._where()}", self.timeout_s):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def control_all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        """A small all-reduce that carries no model data (overflow flag, squared norm)."""
        if self.world > 1:
            self.control_collectives += 1
            self._in_place(t, lambda x: dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=self.group,
                                                         async_op=True),
                           "agree on the step's gradient flags and norm")
        return t

    def start_control_all_reduce(self, t: torch.Tensor):
        """control_all_reduce (a SUM) without waiting for it; returns the call that waits, to make
        before t is read. As a phase's first collective (Sequencer.phase_alone: a step's) it goes
        out beside the phase's comparison, which is finished at that wait or sooner, when the next
        collective goes out, so whatever runs between (the optimizer's step) overlaps the round
        trip. Elsewhere, or through host copies, it is control_all_reduce, done on return."""
        if self.world == 1 or self.staged or self.sequencer is not None and not self.sequencer.phase_alone():
            self.control_all_reduce(t)
            return lambda: None
        self._refuse_if_closed()
        self.control_collectives += 1
        what = lambda: (f"agree on the step's gradient flags and norm in micro-batch "  # noqa: E731
                        f"{self.pass_index}{self._where()}")
        with waiting(what, self.timeout_s):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

        def wait() -> None:
            if self.sequencer is not None:
                self.sequencer.drain()  # a disagreement raises before the result is read
            wait_for(work, what, self.timeout_s)
        return wait

    def _in_place(self, t: torch.Tensor, collective, purpose: str) -> None:
        """A blocking in-place `collective(tensor)` (async, returns its work) on t, through a host
        copy where the group is staged."""
        def run():
            if not self.staged:
                return collective(t)
            host = t.cpu()
            return staged(collective(host), host, t)
        self._issue(None, run, async_op=False, purpose=purpose)
