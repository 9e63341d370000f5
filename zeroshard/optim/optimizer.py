"""The sharded optimizer step: the user's torch optimizer runs over the fp32 master of each chunk's
owned range, then the updated values are pushed back into the compute parameters.

One step, in order:
1. master grad = reduced gradient of the owned range, in fp32, times 1/(world * accumulation steps *
   loss scale). Gradients are always reduced with SUM; this is the only place that divides.
2. One small all-reduce agrees on which parameters got a gradient on any rank, on fp16 overflow (if
   any rank's gradient is not finite, every rank skips the step and halves the loss scale) and on
   the squared global L2 norm for clipping.
3. Clipping by that norm.
4. The optimizer step; then the 16-bit copy of the owned range is refreshed from the master, and at
   stages 1-2 every chunk's all-gather starts, so each rank again holds all parameters once it
   arrives: step() does not wait for it; the next forward waits per chunk (arrival.ArrivalHooks).
   Stage 3 gathers lazily when modules run; stage 0 updated everything everywhere.

The optimizer steps master pieces (chunks.py): per parameter, the part of its fp32 master this rank
owns, so param groups, per-parameter state and step counts are torch's; a parameter that got no
gradient on any rank since the last step is not stepped. Chunks whose optimizer lives on the host
(offload.py) step one chunk at a time, in the order the next forward needs them, and each updated
shard starts its upload while the next chunk steps (at stages 1-2 the all-gathers follow the whole
update: publish.py). An optimizer that can write the 16-bit copy in the same pass as the update
(zeroshard.CPUAdamW) is given the copy's destination, saving a pass over the master.

Delayed update (ZeRO-Offload's DPU, config `delay_update_after`): the host step of step t runs in a
background thread while the device runs step t+1's forward and backward, and lands (is uploaded and
published) at step t+1's step(). States of one update, in order: IDLE -> IN_FLIGHT (launched with
its gradients, loss scale and hyperparameters as they were at step()) -> IDLE (landed). Everything
the thread touches is its own while it runs: the masters and the optimizer's state (stepped through
a view of the optimizer with its own param groups, so an LR schedule set between steps is not
raced), one 16-bit staging buffer per chunk, and a side process group for its norm and overflow
all-reduces. Whatever reads or writes those from the main thread lands the update first. A landed
update's uploads are waited for by the compute stream at each chunk's first use (its module's forward,
its stage-3 gather), not all before the forward starts.
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..errors import InternalError, NonFiniteError, TierFileError
from .grad_views import GradViews
from .grad_agreement import agree_grads, replicated_grads, scale_in_place, start_agreeing
from .loss_scale import LossScaler
from ..distributed.shard_groups import ShardGroups
from .param_groups import ParamGroups, as_factory
from .state_dicts import StateDicts
from .tiered_states import TieredStates, agree_on_tier, state_bytes_by_side
from .tiled_step import TiledStep
from .user_writes import UserWrites
from .delayed_update import DelayedUpdate, UpdateState
from .window_gradients import WindowGradients, clipped
from .publish import Publishing


class ShardedOptimizer(DelayedUpdate, Publishing, WindowGradients):
    def __init__(self, optimizer, comm, *, param_names: dict[int, str], stage: int, dtype: torch.dtype,
                 accumulation: int, clip_grad_norm: float | None, scaler: LossScaler | None,
                 delay_after: int | None = None, side_comm=None, nonfinite: str = "ignore",
                 measure_norm: bool = True, shards: ShardGroups, tier=None, gather_next=None, tp_norm=None):
        """optimizer: a torch.optim.Optimizer over the model's parameters, or a callable taking a
        list of tensors and returning one. param_names: id(parameter) -> name, for the model's.
        nonfinite: what a NaN or inf gradient on any rank does (Config.nonfinite). measure_norm:
        compute the global gradient norm of every step even without clipping (Config.grad_norm).
        comm: the data-parallel group (the gradient's divisor, the step's flags and norm); shards:
        the chunks' groups, over which updated chunks are all-gathered and (hybrid) gradient
        shards summed across the groups. tier: the disk tier (runtime/disk_tier.py) of the chunks
        placed there, or None. gather_next: stage 3, called when the step's own update raised after
        every rank agreed to apply it: the rCache releases its stale chunks and gathers the next
        forward's first ones, as the engine has the other ranks do (ChunkCache.after_update).
        tp_norm: tensor parallelism's TensorParallelNorm (grad_agreement.py), or None."""
        self.groups = ParamGroups(optimizer, param_names)
        self.make_opt = as_factory(optimizer)
        self.applied_updates = 0
        # every rank agreed to apply the last update step() ran here (it applied, or raised after
        # that point and called gather_next): stage 3's engine then gathers the next forward's first chunks
        self.update_agreed = False
        self.gather_next = gather_next
        self.comm = comm
        self.shards, self.tp_norm = shards, tp_norm
        self.stage = stage
        self.dtype = dtype
        self.accumulation = accumulation
        self.clip = clip_grad_norm
        self.measure_norm = measure_norm or clip_grad_norm is not None
        self._ready = None  # this window's gradients once summed across shard groups and scaled (_ready_grads)
        self._user_clip = None  # (the window's norm, the max norms asked) of torch's clip_grad_norm_ calls
        self.scaler = scaler
        self.nonfinite = nonfinite
        self.optimizer = None
        self.chunks = []
        self._views = GradViews()  # the pieces' .grad
        self._tiles = TiledStep()  # which pieces step as cache-sized tiles (tiled_step.py)
        self.user_writes = UserWrites()  # the user's writes into parameters, for the masters (user_writes.py)
        self.last_grad_norm = None
        self.skipped_steps = 0
        self._staging = [(None, None), (None, None)]  # (host buffer, upload reading it)
        self._staging_turn = 0
        self._staging_slot_of: dict[int, int] = {}
        self.boundaries = 0  # step() calls, applied or skipped
        # delayed update: from step() number `delay_after` on (None: never)
        self.delay_after = delay_after
        self.side_comm = side_comm  # its thread's collectives (None at world 1 is fine: no collectives)
        self.update = UpdateState.IDLE
        self._thread = None
        self._outcome = None  # (applied, overflow, grad norm) or the exception the thread raised
        self._delay_staging: dict[int, list] = {}  # id(chunk) -> [host 16-bit buffer, upload reading it]
        self._state_bytes_at_launch = None
        self._state_bytes_key, self._state_bytes = None, None  # state_bytes' last count, and what it counted
        self.tier = tier
        self._tiered = TieredStates(tier, lambda: self.optimizer) if tier is not None else None
        self._state_dicts = None  # the hooks translating optimizer.state_dict() (state_dicts.py)
        self._before_state_load = lambda: None

    def attach(self, chunks) -> None:
        """(Re)bind the optimizer to the trainable chunks' master pieces, each in the param group of
        its parameter (param_groups.py). Before the first update the optimizer holds no state (or
        only what it made when built), so re-packing chunks only swaps the tensors it updates."""
        self.chunks = [c for c in chunks if c.trainable]
        self._views.retain(self.chunks)
        pieces = [pc for c in self.chunks for pc in c.pieces]
        if self.optimizer is None:
            self.optimizer = self.groups.build(pieces)
            if self._tiered is not None:
                self._tiered.guard(self.optimizer)
            self._state_dicts = StateDicts(self.optimizer, lambda: self.chunks, self.groups, self.comm,
                                           lambda: self._before_state_load(), tiered=self.tier is not None,
                                           before_save=self._take_groups_when_idle)
        elif self.applied_updates and self.optimizer.state:
            raise InternalError("zeroshard: cannot re-pack the chunks of an optimizer that has state")
        self.groups.assign(self.optimizer, pieces)
        self._build_tiles(self.optimizer)
        self.user_writes.watch(self.chunks)
        if self.tier is not None:  # the masters go to disk now: host memory holds a few at a time from here on
            on_disk = [c for c in chunks if c.placement.optimizer_on_disk]
            self.tier.attach(on_disk)
            for c in on_disk:
                c.keep_master_in(self.tier)
                if c.trainable:
                    self.tier.adopt(c)

    def take_built(self, c) -> None:
        """A chunk just built (ChunkLayout.when_built): a disk-tier one gets its record and its
        master goes to disk now, before the next chunk is built, so host memory never holds every
        master while the model is packed (attach keeps these records)."""
        if self.tier is not None and c.placement.optimizer_on_disk:
            self.tier.extend(c)
            c.keep_master_in(self.tier)
            if c.trainable:
                self.tier.adopt(c)

    def adopt(self, chunks, thawed) -> None:
        """Start stepping the chunks in `thawed`, made trainable since the optimizer was built
        (parameters unfrozen after initialize): their master pieces join their parameters' param
        groups with no state, as torch starts a parameter it has not stepped; the others keep
        theirs. `chunks`: every chunk, in layout order. No delayed update may be in flight."""
        if self.update is not UpdateState.IDLE:
            raise InternalError("zeroshard: land the delayed update before adopting chunks")
        self.chunks = [c for c in chunks if c.trainable]
        self._views.retain(self.chunks)
        self.groups.assign(self.optimizer, [pc for c in self.chunks for pc in c.pieces],
                           new=[pc for c in thawed for pc in c.pieces])
        self._build_tiles(self.optimizer)
        self.user_writes.watch(self.chunks)
        for c in thawed:
            if c.tier is not None:
                c.tier.adopt(c)

    def on_state_load(self, before) -> None:
        """Call `before()` whenever the user's optimizer.load_state_dict is about to load a state."""
        self._before_state_load = before

    def own_load(self):
        """A context for zeroshard's own optimizer.load_state_dict calls (state_dicts.py)."""
        return self._state_dicts.own_load() if self._state_dicts is not None else contextlib.nullcontext()

    def _take_groups_when_idle(self) -> None:
        if self.has_added_groups and self.update is UpdateState.IDLE:
            self.take_added_groups()

    @property
    def has_added_groups(self) -> bool:
        """The user added param groups (`optimizer.add_param_group`) that take_added_groups has not
        taken yet."""
        return self.groups.added(self.optimizer)

    def take_added_groups(self) -> None:
        """Groups the user added with `optimizer.add_param_group` since the optimizer was bound
        (a body unfrozen with its own learning rate): their parameters' master pieces step in them
        from the next step on, starting with no state, as torch starts them (or with a
        checkpoint's, loaded after this). A parameter frozen at initialize joins once unfrozen
        (adopt), its chunk being frozen until then. No delayed update may be in flight."""
        if self.update is not UpdateState.IDLE:
            raise InternalError("zeroshard: land the delayed update before taking added param groups")
        self.groups.assign(self.optimizer, [pc for c in self.chunks for pc in c.pieces], new=[])
        self._build_tiles(self.optimizer)

    @property
    def replicated(self) -> bool:
        """Stage 0 without clipping: every rank holds the same summed gradient, so the step agrees
        on nothing over the group (replicated_grads); with no delayed update or disk tier either,
        it issues no collective at all (issues_no_collective: ordering.py's STEP)."""
        return (self.stage == 0 and self.clip is None and self._user_clip is None and not self.shards.hybrid
                and self.tp_norm is None and all(c.presence_tail for c in self.chunks))

    issues_no_collective = property(lambda self: self.replicated and self.delay_after is None and self.tier is None)

    @torch.no_grad()  # the masters are Parameters: copies from them must not record history
    def step(self) -> bool:
        """Run one optimizer step over the reduced gradients; False if fp16 overflow skipped it.
        Delayed: land the update in flight, launch this one, and return True (an fp16 overflow found
        in the background is counted in `skipped_steps` when it lands)."""
        self._take_groups_when_idle()
        self.boundaries += 1
        self.update_agreed = False  # a delayed update's (below) is agreed when it lands
        if self.delay_after is not None and self.boundaries > self.delay_after:
            self.land()  # if it raises, the engine drops this step's gradients with the rest
            self._take_groups_when_idle()
            self._launch()
            return True
        self.user_writes.carry()
        agreed = []  # _update appends to it once every rank agreed to apply this update
        try:
            applied, overflow, norm = self._update(self._ready_grads(), self._grads_seen(), self._inv_scale(),
                                                   self.comm, self.optimizer, self._copy_target, self._publish,
                                                   agreed, ready=True)
        except BaseException:
            if agreed:
                try:
                    self._gather_after_failure()
                except BaseException:  # the update's own failure is the one to report
                    pass
            raise
        finally:
            self.update_agreed = bool(agreed)
        if applied:
            self.applied_updates += 1
            self._gather_updated(compare=False)
        self._account(applied, overflow, norm)
        return applied

    def _account(self, applied: bool, overflow: bool, norm: float | None) -> None:
        """Record an update's outcome: the loss scale follows overflows, skips are counted, the
        norm is kept (with clipping) when the update applied. A non-finite gradient with nonfinite
        'raise' raises NonFiniteError (on every rank: they all saw the same flag); under fp16 only
        once the loss scale is down to 1, where no lower scale could make the gradient finite."""
        if overflow and self.nonfinite == "raise" and (self.scaler is None or self.scaler.scale <= 1.0):
            raise NonFiniteError(f"zeroshard: a gradient is NaN or inf at optimizer step {self.boundaries} "
                                 "(config nonfinite='raise'); the step was not applied")
        if self.scaler is not None:
            self.scaler.update(overflow)
        self.skipped_steps += int(overflow)
        self.last_grad_norm = norm if applied else None

    def _inv_scale(self) -> float:
        scale = self.scaler.grads_scale if self.scaler else 1.0
        return 1.0 / (self.comm.world * self.accumulation * scale)

    @property
    def arrival_scale(self) -> float:
        """What each gradient arriving in a chunk that scales on arrival (Chunk.scales_on_arrival)
        is multiplied by: the step's divisor, world size x micro-batches, so the step makes no
        pass to scale those chunks. 1.0 under fp16 loss scaling: the step scales (the scale that
        made a window's gradients is settled only at its step)."""
        return self._inv_scale() if self.scaler is None else 1.0

    def _scaled_on_arrival(self, c) -> bool:
        return c.scales_on_arrival and self.scaler is None

    def _grads_seen(self) -> list[set[int]]:
        """Per chunk, the slots that got a gradient on this rank since the last step (a copy)."""
        return [set(c.slots_with_grad) for c in self.chunks]

    def _update(self, grads, seen, inv: float, comm, opt, target_of, finish, agreed: list | None = None,
                ready: bool = False) -> tuple[bool, bool, float | None]:
        """One update from the chunks' reduced gradients (compute dtype, summed over ranks and
        micro-batches) and the slots that got one on this rank (`seen`, per chunk): which
        parameters got a gradient on any rank, fp16 overflow check, clipping, the step, and
        `finish(chunk, 16-bit target)` for each stepped chunk. Chunks whose optimizer lives on the
        host step one at a time, each with its fp32 gradient made just before and dropped just after
        (ZeRO-R's constant buffers: never the whole model's fp32 gradient at once), in the order the
        next forward needs them. Returns (applied, overflow, global norm or None); not applied when
        no parameter got a gradient on any rank (torch's step then changes nothing). `agreed`: a
        list that gets an item once every rank agreed to apply the update and no collective of it
        is left (it then applies or raises). `ready`: the gradients are scaled (_ready_grads)."""
        if not ready:
            scale_in_place([None if self._scaled_on_arrival(c) else g for c, g in zip(self.chunks, grads)], inv)
        caps = [*(self._user_clip[1] if self._user_clip else ()), *(() if self.clip is None else (self.clip,))]
        exact, measure = bool(caps), self.measure_norm or bool(caps)
        share, norm_here = self._norm_share(comm, exact)
        finite_check = self.scaler is not None or self.nonfinite != "ignore"
        # Stage 0 with peers (the step in the training thread) needs no collective but for the
        # clipping norm, which rank 0 measures for all (a norm measured on each rank could differ
        # in its last bits between ranks that sum in different orders, and so could the replicas).
        squared_later = None  # reads the global squared norm after the step (start_agreeing)
        if comm is self.comm and self.replicated:
            present, overflow, sq = replicated_grads(self.chunks, grads, seen, inv, finite_check=finite_check,
                                                     measure_norm=measure)
        elif (comm is self.comm and not caps and not finite_check and not self.shards.hybrid and self.tp_norm is None
              and self.tier is None and all(len(got) == len(c.slots) for c, got in zip(self.chunks, seen))):
            present, overflow, sq = [[True] * len(c.slots) for c in self.chunks], False, 0.0
            squared_later = start_agreeing(comm, self.chunks, grads, inv, measure_norm=measure,
                                           share=share, norm_here=norm_here)
        else:
            present, overflow, sq = agree_grads(
                comm, self.chunks, grads, seen, inv, finite_check=finite_check,
                measure_norm=measure, exact_norm=exact, share=share, norm_here=norm_here, tp=self._tp_for(comm))
        if overflow or not any(any(p) for p in present):
            if squared_later is not None:  # no slot at all: its all-reduce is read all the same
                squared_later()
            self._drop_grads()
            return False, overflow, None
        one_by_one = [i for i, c in enumerate(self.chunks) if c.placement.optimizer_on_host]
        together = [i for i, c in enumerate(self.chunks) if not c.placement.optimizer_on_host]
        disk = [i for i in one_by_one if self.chunks[i].placement.optimizer_on_disk]
        # Agreed once no collective of the update is left: a disk tier's chunks agree on their
        # files after stepping, and a rank failing before that agreement must not gather.
        if agreed is not None and not disk:
            agreed.append(True)
        norm = math.sqrt(sq) if measure else None
        coef, _ = clipped(norm, caps)  # the clipping factor, None when the gradient is left as it is

        read_16bit = getattr(opt, "grad_inputs", None)  # CPUAdamW: scales a 16-bit gradient as it reads it

        def load(c, g, has_grad):
            if g is None:  # no backward reached this chunk (cannot happen after a flush): zero grad
                g = torch.zeros(c.master.numel(), dtype=c.grad_dtype, device=c.master.device)
            lo = c.owned_range[0]
            if read_16bit is not None and g.dtype != torch.float32 and g.device.type == c.master.device.type == "cpu":
                for pc in [pc for pc in c.pieces if has_grad[pc.index]]:
                    read_16bit[id(pc.param)] = (g[pc.lo - lo:pc.hi - lo].view(pc.param.shape), inv,
                                                1.0 if coef is None else coef)
                return
            lasting = self.stage <= 1 and g.dtype == torch.float32 and not c.placement.optimizer_on_host
            if g.dtype != torch.float32:  # fp32 ones were scaled (scale_in_place, or as they arrived)
                g = g.float().mul_(inv)
            if coef is not None:
                g.mul_(coef)
            self._views.bind(c, g, has_grad, lasting)

        # Disk tier: chunk k is open while k+1 and k+2 are read ahead and k-1 is written behind.
        ahead = {i: [self.chunks[j] for j in disk[n + 1:n + 3]] for n, i in enumerate(disk)}
        failure = None
        # offload_params='disk': the step overwrites each shard's record whole (shard_values(fresh))
        shard_tiers = list({id(c.shard_tier): c.shard_tier for c in self.chunks if c.shard_tier is not None}.values())
        try:
            if together:
                for i in together:
                    load(self.chunks[i], grads[i], present[i])
                chunks = [self.chunks[i] for i in together]
                for c, target in zip(chunks, self._step_chunks(opt, chunks, target_of)):
                    finish(c, target)
            for c in [self.chunks[j] for j in disk[:2]]:
                self.tier.read_ahead(c)
            for i in one_by_one:
                c = self.chunks[i]
                with self.tier.opened(c, write=True, adopt=True) if c.placement.optimizer_on_disk \
                        else contextlib.nullcontext(), c.shard_values(write=True, fresh=True):
                    for d in ahead.get(i, ()):
                        self.tier.read_ahead(d)
                    load(c, grads[i], present[i])
                    grads[i] = None
                    (target,) = self._step_chunks(opt, [c], target_of)
                    for pc in c.pieces:
                        pc.param.grad = None
                    finish(c, target)
            if disk:
                self.tier.flush()
            for t in shard_tiers:
                t.flush()
        except Exception as e:
            # With a disk tier the other ranks wait in agree_on_tier for this rank's word: any
            # failure goes there (the user's optimizer raising, an allocation), not only the tier's.
            if not disk:
                raise
            failure = e
            for t in [self.tier, *shard_tiers]:
                t.fail(e)
        if disk:
            try:
                agree_on_tier(comm, failure)
            except TierFileError as e:  # every rank's records are now a step apart from some other's
                for t in [self.tier, *shard_tiers]:
                    t.fail(e)
                raise
            if agreed is not None:
                agreed.append(True)
        self._drop_grads(keep_lasting=True)
        if squared_later is not None:
            sq = squared_later()
            norm = math.sqrt(sq) if measure else None
        return True, False, norm

    def _step_chunks(self, opt, chunks, target_of) -> list:
        """opt.step() over these chunks' master pieces only (all of them: one plain step). Returns
        each chunk's 16-bit target (see _copy_target), which an optimizer that can (CPUAdamW) has
        written in the same pass, piece by piece."""
        fused_copy = getattr(opt, "copy_targets", None)
        targets = [target_of(c) for c in chunks]
        for c, target in zip(chunks, targets):
            if target is not None and fused_copy is not None and target.dtype != torch.float32:
                lo = c.owned_range[0]
                for pc in c.pieces:
                    fused_copy[id(pc.param)] = target[pc.lo - lo:pc.hi - lo].view(pc.param.shape)
        # The user's optimizer is stepped through its own step (an LR scheduler wraps that to
        # count calls); the delayed update's view of it through the class's.
        run = opt.step if opt is self.optimizer else (lambda: type(opt).step(opt))
        if not self._tiles.current(opt):  # the groups were given other lists since (ParamGroups.assign)
            self._build_tiles(opt)
        with self._tiles.stepping(opt, chunks, self._views.bound):
            run()
        return targets

    def _build_tiles(self, opt) -> None:
        """The spans the tiled step may step (tiled_step.py): none with a disk tier, whose open
        records move the masters."""
        self._tiles.build(opt, self.chunks if self.tier is None else [])

    def zero_grads(self) -> None:
        """Clear the chunks' gradients (after a step, or a failed one)."""
        self._ready = self._user_clip = None
        for c in self.chunks:
            c.zero_grad()

    def _drop_grads(self, keep_lasting: bool = False) -> None:
        self._views.drop(self.chunks, keep_lasting)
        for name in ("copied", "grad_inputs", "copy_targets"):  # CPUAdamW's per-step side channels
            if hasattr(self.optimizer, name):
                getattr(self.optimizer, name).clear()

    def restore_counters(self, skipped_steps: int, boundaries: int) -> None:
        """A checkpoint's step counters: steps skipped, and step() calls (applied or skipped)."""
        self.skipped_steps, self.boundaries = skipped_steps, boundaries

    def state_bytes(self) -> dict[bool, int]:
        """Bytes of the optimizer's own state tensors (moments etc.) on this rank, by whether they
        are on the host (the disk tier's are in neither: they are meta tensors between steps)."""
        if self.update is UpdateState.IN_FLIGHT:  # the thread may be creating state: as at launch
            return dict(self._state_bytes_at_launch)
        # Counted again only when the state gains parameters or is replaced (stats() asks at every
        # step, and a Python pass over every parameter's state is a visible part of a small step):
        # torch's optimizers make a parameter's state at its first step and keep its tensors'
        # sizes; load_state_dict makes a new state dict. The disk tier's swap in and out: always.
        key = (id(self.optimizer.state), len(self.optimizer.state))
        if self.tier is not None or self._state_bytes_key != key:
            self._state_bytes_key, self._state_bytes = key, state_bytes_by_side(self.chunks, self.optimizer)
        return dict(self._state_bytes)
