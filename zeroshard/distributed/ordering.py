"""Divergence detection: every rank must issue the same collectives in the same order.

Ranks diverge when their modules run differently (data-dependent control flow) or when one rank
caught an exception mid-step and carried on, a micro-batch or a step behind the others. Unchecked,
divergence is the worst kind of failure: gloo aborts the process when ranks pair collectives of
different sizes, waits out its timeout (config collective_timeout_s) when they pair different
kinds, and silently mixes data when they pair equal-sized ones (a rank a micro-batch behind trains
out of step). A rank that stops altogether shows as a timeout: CollectiveTimeoutError on every
rank waiting for it, naming the collective (`wait_for`).

So every collective on the engine's group is named by a *tag* (kind, chunk index, the rank's
micro-batch count), and the ranks compare tags before it is issued: the same tag everywhere issues
it; any difference raises DivergedError on every rank, and nothing further is issued. Comparisons
travel on a small gloo group of their own (the *check group*), where every message has the same
size, so they complete even when the tags differ.

Which collectives compare what:
- those a module hook drives (a stage-3 gather, a gradient reduction): their own tag, through the
  `Sequencer`: the comparison is an async all-reduce, and the collective behind it is issued once
  that comparison has come back, in the order handed over. The training thread polls at each hook
  (`progress`) and waits only where it needs a collective's result, as it would anyway
  (`Ticket.wait`): no barrier per chunk, so ranks may run a few modules apart (Note: prefetches
  handed over).
- a step and a checkpoint: a tag of their own on entry (STEP, CHECKPOINT). The all-gathers of an
  update go out at once, with no comparison: a rank whose update raises after the step's control
  all-reduce (once every rank agreed to apply it) issues the same all-gathers and marks its next
  comparison (FAILED_STEP, where a deferred tag goes), so no rank waits for gathers that never
  come and every rank raises at the next comparison; comparing a tag for them first (PUBLISH)
  cost every step a round trip (gpt2-tiny, 2 ranks on 2 cores: the step phase 14 -> 12 ms). A
  delayed update, which lands a step after it ran, still compares PUBLISH. Stage 3 gathers the
  next forward's first chunks the same way, at the step's end (runtime/cache.py's Note: gathers at
  the step's end). STEP is compared without waiting (`Sequencer.announce`): the comparison is
  finished before the result of the step's first collective is read. A step without a collective
  (stage 0, no clipping) sends no comparison of its own: its tag rides in the next comparison's
  message (`OrderCheck.defer`; every message carries a deferred tag, 0 where there is none), so a
  rank out of step applies its update and raises at its next collective, on every rank, and each
  step saves a round trip.
- blocking ones issued by the training thread (norms, flags, objects): a tag of their own (OTHER),
  except the first one after a phase tag with nothing handed over between (the step's control
  all-reduce): every rank that agrees on the phase runs the same code up to it, so the phase's
  comparison is its check, and it is issued at once, beside that comparison, which is finished
  before its result is read (`Sequencer.phase_alone`): one round trip per step instead of three.
  Where nothing in the step depends on its answer (no clipping, no finite check, every slot's
  gradient on this rank), it is read after the optimizer's step (`Comm.start_control_all_reduce`),
  the comparison finished at that read or at the update's first all-gather: the step overlaps the
  round trip, and a disagreement raises after this rank stepped (its ranks are out of step then).
  Issuing before the comparison is back pairs nothing wrongly: a rank elsewhere sends a
  comparison of its own first, which meets the phase's and raises there, and never issues a
  collective to pair with this one; a rank in the same phase at another micro-batch issues the
  same control all-reduce, whose mixed result no rank reads, as both raise at the comparison.
Untagged collectives first let everything handed over be issued (`drain`), so every rank issues
one sequence on the group. With CUDA tensors each comparison is made before issuing, on host
tensors: a host round trip per collective, never a host-device synchronisation.

Note: prefetches handed over. A prefetched gather may never be waited for (a forward that ends
before the chunk's use, an engine let go of), and may then be issued on one rank and not on
another. It is issued as any other collective, when a poll finds its comparison back, and
`issue_handed_over` issues whatever is left at points every rank reaches alike: a forward's start,
and its end when no backward follows (the engine); a backward's end waits for its reductions,
handed over after it. So that a gather issued on one rank only takes no later gather's messages,
its message tag is fixed when it is handed over (Comm.all_gather), and an engine's set-up takes the
group's tags past any a rank used (Comm.enable_order_checks: a divergence leaves ranks apart).
Issuing it only at a chunk use, as before, made every chunk use wait for the other ranks to reach
it: gpt2-small-cpu, 2 ranks on 2 cores, stepped in 1.112 -> 1.067x DDP's time with a 2-chunk rCache
and 1.040 -> 1.025x with an unlimited one (interleaved, the old issue patched back into one engine).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import datetime

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError, DivergedError, PeerLostError

TIMEOUT = datetime.timedelta(minutes=10)  # the default of config collective_timeout_s
_timeout = [TIMEOUT]  # what the groups zeroshard makes wait for the other ranks


def collective_timeout() -> datetime.timedelta:
    """How long a collective on a group zeroshard made waits for the other ranks."""
    return _timeout[0]


def set_collective_timeout(seconds: float) -> None:
    """Config collective_timeout_s, for the groups made from now on (collectives.init_process_group)."""
    _timeout[0] = datetime.timedelta(seconds=seconds)


# Kinds of tags. A tag is (micro-batch mod 2^20) << 40 | kind << 32 | chunk index.
GATHER, REDUCE, STEP, CHECKPOINT, OTHER, PUBLISH, SHARD_READ, FAILED_STEP = 1, 2, 3, 4, 5, 6, 7, 8
_WHAT = {GATHER: "gather chunk {i}", REDUCE: "reduce the gradients of chunk {i}",
         STEP: "run the optimizer step", CHECKPOINT: "save or load a checkpoint or state dict",
         OTHER: "issue a blocking collective (a norm, a flag, a checkpoint's objects)",
         PUBLISH: "all-gather the updated parameters",
         FAILED_STEP: "carry on after its optimizer step raised",
         SHARD_READ: "tell whether chunk {i}'s shard was read from the parameter tier"}


def order_tag(kind: int, chunk_index: int = 0, micro_batch: int = 0) -> int:
    return (micro_batch & 0xFFFFF) << 40 | kind << 32 | chunk_index


def describe_tag(tag: int) -> str:
    if tag == 0:  # what a comparison carries where no phase was deferred, or a deferred one goes alone
        return "go on with no step or collective there"
    n, kind, index = tag >> 40, (tag >> 32) & 0xFF, tag & 0xFFFFFFFF
    return _WHAT.get(kind, "op {k} on chunk {i}").format(i=index, k=kind) + f" in micro-batch {n}"


# How gloo and NCCL say that the other end of a connection is gone.
_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
         "ncclremoteerror", "socket closed")
_TIMED_OUT = ("timed out", "timeout caused pair closure")


def peer_lost(e: BaseException, what, timeout_s: float) -> PeerLostError | None:
    """The named error for a collective's failure `e` while waiting to do `what` (a string, or a
    callable giving one), or None when `e` is not about a peer."""
    text = str(e).lower()
    if any(s in text for s in _TIMED_OUT):
        return CollectiveTimeoutError(
            f"zeroshard: waited {timeout_s:g} s (config collective_timeout_s) for the other ranks to "
            f"{what() if callable(what) else what}: one of them is stopped, hung or far behind, or did not make "
            "the call that needs this (at stage 3 whatever reads the parameters outside a forward gathers them: "
            "model.state_dict(), save_pretrained(), generate() run on every rank)")
    if any(s in text for s in _GONE):
        said = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        said = said.split("] ", 1)[-1].split(". This is typically")[0][:160]  # without gloo's location and advice
        return PeerLostError(
            f"zeroshard: another rank is gone (it died, was killed or exited) while this rank waited for the "
            f"other ranks to {what() if callable(what) else what} ({said})")
    return None


def wait_for(work, what, timeout_s: float) -> None:
    """work.wait(), a lost or stopped peer raised as PeerLostError (CollectiveTimeoutError for a
    timeout) naming `what` (a string, or a callable giving one: made only on failure)."""
    with waiting(what, timeout_s):
        work.wait()


@contextlib.contextmanager
def waiting(what, timeout_s: float):
    """Around a collective's issue or a blocking one: a lost or stopped peer raised as
    PeerLostError naming `what`; anything else as it is."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, PeerLostError):
            raise
        named = peer_lost(e, what, timeout_s)
        if named is None:
            raise
        raise named from e


class OrderCheck:
    """Compares tags across the ranks of `group`: each rank contributes (tag, -tag) to a MAX
    all-reduce, and the ranks agree iff max == min. Each comparison also carries the phase tag
    deferred since the last one (`defer`; 0 for none) in the same way, so every message has the
    same size. After a disagreement every call raises."""

    def __init__(self, group, rank: int, where=lambda: "", timeout_s: float = 600.0):
        self.group = group
        self.rank = rank
        self.where = where  # words naming where training is (the optimizer step), for timeouts
        self.timeout_s = timeout_s
        self.failure: str | None = None  # the first disagreement's message
        self.comparisons = 0
        self._deferred = 0  # a phase tag that the next comparison carries (defer)

    def reset_counters(self) -> None:
        self.comparisons = 0

    def defer(self, tag: int) -> None:
        """Compare phase tag `tag` with the next comparison, in its message: for a phase that
        issues no collective (a stage-0 step without clipping), which the next one follows on
        every rank that agrees on it. A rank that skipped the phase carries 0 there, and both raise."""
        self.raise_if_failed()
        self.flush()  # two phases with no comparison between: the first goes alone
        self._deferred = tag

    def mark(self, tag: int) -> None:
        """The next comparison carries `tag` where the deferred phase tag goes (replacing any): a
        rank marks a failure of its own that the others must hear of there (FAILED_STEP)."""
        self._deferred = tag

    def start(self, tag: int) -> tuple[torch.Tensor, object, int]:
        """Start comparing `tag` (async), with the deferred phase tag: (buffer, work, that phase
        tag) for `finish`."""
        self.raise_if_failed()
        deferred, self._deferred = self._deferred, 0
        buf = torch.tensor([deferred, -deferred, tag, -tag], dtype=torch.int64)
        self.comparisons += 1
        _unfinished[id(buf)] = buf
        with waiting(lambda: f"compare the order of collectives, to {describe_tag(tag)}{self.where()}", self.timeout_s):
            return buf, dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True), deferred

    def finish(self, tag: int, buf: torch.Tensor, work, deferred: int) -> None:
        wait_for(work, lambda: f"compare the order of collectives, to {describe_tag(tag)}{self.where()}",
                 self.timeout_s)
        _unfinished.pop(id(buf), None)
        mine, hi, lo = tag, int(buf[2]), -int(buf[3])
        if int(buf[0]) != -int(buf[1]):  # the deferred phase tags differ: that came first
            mine, hi, lo = deferred, int(buf[0]), -int(buf[1])
        if hi != lo and self.failure is None:
            # Ranks may have started different numbers of comparisons on this group: an engine
            # made after this one must not pair its comparisons with the leftovers (has_check_group).
            _retire_check_groups()
            self.failure = (
                f"zeroshard: ranks diverged: rank {self.rank} is about to {describe_tag(mine)}, but "
                f"another rank is about to {describe_tag(hi if hi != mine else lo)}. Every rank must "
                "call the same modules in the same order and run the same micro-batches (a rank that "
                "caught an exception inside forward or backward and carried on is out of step with "
                "the others; data-dependent control flow that differs between ranks is not supported; "
                "at stage 3 a parameter read outside a forward is gathered, so code reading one on some "
                "ranks only, as `if rank == 0: model.state_dict()`, diverges: read on every rank, or "
                "use engine.full_state_dict(rank0_only=True)).")
        self.raise_if_failed()

    def agree(self, tag: int) -> None:
        """Compare `tag` now (blocking)."""
        self.finish(tag, *self.start(tag))

    def flush(self) -> None:
        """Compare the deferred phase tag now, if there is one (blocking)."""
        if self._deferred:
            self.agree(0)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise DivergedError(self.failure)


class Ticket:
    """A collective handed to the sequencer: `work` once the ranks agreed on its tag and it was issued."""

    __slots__ = ("sequencer", "work", "issued", "tag")

    def __init__(self, sequencer: "Sequencer", tag: int):
        self.sequencer = sequencer
        self.work = None
        self.issued = False
        self.tag = tag

    def is_completed(self) -> bool:
        if not self.issued:
            self.sequencer.progress()
        return self.issued and (self.work is None or self.work.is_completed())

    def wait(self) -> bool:
        if not self.issued:
            self.sequencer.progress(until=self)
        if self.work is not None:
            check = self.sequencer.check
            wait_for(self.work, lambda: describe_tag(self.tag) + check.where(), check.timeout_s)
        return True


class Sequencer:
    """Issues collectives once every rank handed over the same tag, in the order handed over."""

    def __init__(self, check: OrderCheck, inline: bool):
        self.check = check
        self.inline = inline  # compare before issuing, blocking (CUDA)
        self._queue: collections.deque = collections.deque()  # (tag, buf, check work, deferred, issue, ticket)
        self._announced = False  # a phase tag was handed over last (see the module's docstring)
        self._phase_ticket = None  # ... its entry in the queue

    def submit(self, tag: int, issue):
        """`issue()` starts a collective and returns its work; it runs once the ranks agree on
        `tag`. Returns a Ticket (or, inline, the work itself): either has wait()/is_completed()."""
        self._announced = False
        if self.inline:
            self.check.agree(tag)
            return issue()
        ticket = Ticket(self, tag)
        self._queue.append((tag, *self.check.start(tag), issue, ticket))
        self.progress()
        return ticket

    def progress(self, until: Ticket | None = None) -> None:
        """Issue, oldest first, the collectives whose comparison has come back; with `until`, wait
        for comparisons up to that ticket's (the gathers a forward's start hands over together
        then go out together, once the first is waited for). DivergedError on a disagreement
        (nothing after it is issued)."""
        while self._queue:
            tag, buf, work, deferred, issue, ticket = self._queue[0]
            if until is None and not work.is_completed():
                return
            self._queue.popleft()
            try:
                self.check.finish(tag, buf, work, deferred)
            except DivergedError:
                self._queue.clear()
                raise
            ticket.work, ticket.issued = issue(), True
            if ticket is until:  # those behind it whose comparisons are back go out too
                until = None

    def issue_handed_over(self) -> None:
        """Issue everything handed over, waiting for the comparisons (not for the collectives), at
        a point every rank reaches alike (Note: prefetches handed over)."""
        if self._queue:
            self.progress(until=self._queue[-1][-1])

    def drain(self, flush: bool = True) -> None:
        """Issue everything handed over (waiting for its comparisons), and with `flush` compare a
        deferred phase tag. An untagged collective follows: a phase tag no longer stands for the
        next one (agree)."""
        self._announced = False
        if self._queue:
            self.progress(until=self._queue[-1][-1])
        if flush:
            self.check.flush()
        self.check.raise_if_failed()

    def announce(self, tag: int, alone: bool = False) -> None:
        """Compare a phase tag (STEP) without waiting; it is finished, in order, before anything
        handed over later is issued, and before the result of an untagged collective issued beside
        it is read (phase_alone). `alone`: the phase issues no collective, so its tag rides on the
        next comparison instead of one of its own (OrderCheck.defer)."""
        if alone:
            self._announced = False
            self.check.defer(tag)
            return
        self._phase_ticket = self.submit(tag, lambda: None)
        self._announced = True

    def phase_alone(self) -> bool:
        """A phase tag was handed over last and nothing before it waits to be issued: an untagged
        collective may be issued beside its comparison, then `drain()` (the module's docstring)."""
        return self._announced and all(entry[-1] is self._phase_ticket for entry in self._queue)

    def agree(self, tag: int) -> None:
        """After everything handed over is issued: compare `tag` now (blocking), unless a phase
        tag was the last thing handed over (the module's docstring says why that suffices)."""
        announced = self._announced
        self.drain(flush=False)
        if not announced:
            self.check.agree(tag)  # a deferred phase tag rides on it
_check_groups: dict = {}  # process group -> its check group, shared by the engines of the process
# Check groups no longer used, kept alive: a gloo group's destructor waits for every comparison it
# queued, and after a divergence some are never paired.
_retired: list = []
# The buffers of comparisons started and not finished (id -> buffer). See forget_check_groups.
_unfinished: dict = {}


def hold_unfinished(key: int, obj) -> None:
    """Never free `obj` (a collective that did not finish, with the tensors it reads and
    writes): a gloo thread dropping the last reference to them at interpreter exit aborts the
    process (forget_check_groups)."""
    _unfinished[key] = obj


def _retire_check_groups() -> None:
    _retired.extend(_check_groups.values())
    _check_groups.clear()


def forget_check_groups() -> None:
    """Let go of every check group (at interpreter exit: collectives._take_down_groups), except
    those retired after a divergence. Their destructor would wait, up to the collective timeout,
    for comparisons that no peer will ever pair (seen: a rank held 600 s at exit after the desync
    scenarios), so they and the buffers of unfinished comparisons are deliberately never freed:
    no destructor runs, and a gloo worker that gives up on a comparison during the interpreter's
    teardown drops no last reference to a Python tensor (which would need the GIL then, the abort
    that _take_down_groups exists to avoid). The process's exit ends their threads."""
    _check_groups.clear()
    if _retired or _unfinished:
        kept = (list(_retired), list(_unfinished.values()))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # never reaches zero references
        _retired.clear()
        _unfinished.clear()


def has_check_group(group) -> bool:
    """Whether this rank holds a usable check group for `group` (none yet, or one left after a
    divergence, is not)."""
    return (group if group is not None else dist.group.WORLD) in _check_groups


def check_group(group, ranks: list[int] | None, renew: bool):
    """Collective when `renew` (which every rank must pass alike: some rank lacked one): the gloo
    group of the same ranks that carries tag comparisons."""
    key = group if group is not None else dist.group.WORLD
    if renew:
        _retire_check_groups()  # older ones belong to destroyed process groups, or diverged
        # Only the group's own ranks call this (each data-parallel group of a 2D mesh makes its own).
        _check_groups[key] = dist.new_group(ranks, backend="gloo", timeout=collective_timeout(),
                                            use_local_synchronization=ranks is not None)
    return _check_groups[key]
