"""Scenarios around engine.step(), part of scenarios.SCENARIOS: loss.backward() in place of
engine.backward(loss), weights read while the step's all-gathers are in flight, the chunks stage 3
gathers at the step's end, a branch only one rank takes, and ranks that fall out of step (every rank
gets DivergedError, never a hang).
"""
from __future__ import annotations

import functools

import torch

import zeroshard
from distributed import every_rank
from models import batches, digest, inputs, make_adamw, make_sgd, max_diff, parity, reference, tiny_gpt2

SCENARIOS = {}


# -- loss.backward() instead of engine.backward(loss) ----------------------------------------------
def _add_plain_backward():
    for stage in range(4):
        def fn(rank, world, stage=stage):
            data = batches(4, world, 2, accumulation=2)
            ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
            engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": stage, "chunk_size": 20000,
                                                                  "gradient_accumulation_steps": 2})
            for step in data:
                for micro in step:
                    engine(input_ids=micro[rank], labels=micro[rank]).loss.backward()
                    engine.step()
            return {"diff": max_diff(engine.full_state_dict(), ref), "micro_steps": engine.micro_steps}
        SCENARIOS[f"plain_backward_stage{stage}"] = fn


_add_plain_backward()


def plain_backward_fp16_raises(rank, world):
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 2, "precision": "fp16", "chunk_size": 20000})
    x = batches(1, world, 1)[0, 0, rank]
    try:
        engine(input_ids=x, labels=x).loss.backward()
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"raised": None}


SCENARIOS["plain_backward_fp16_raises"] = plain_backward_fp16_raises


def _add_reads_after_step():
    for stage in (1, 2):
        def fn(rank, world, stage=stage):
            """Stages 1-2 leave each chunk's all-gather in flight when step() returns. Weights read
            right after step() (a logging or EMA line, state_dict()) must be the updated ones: rank
            1 steps late, so rank 0's gathers cannot have finished when it reads."""
            import time
            data = batches(3, world, 2)
            ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
            engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": stage, "chunk_size": 4000})
            in_flight = []
            for step in data:
                x = step[0][rank]
                engine.backward(engine(input_ids=x, labels=x).loss)
                if rank == 1:
                    time.sleep(0.5)
                engine.step()
                in_flight.append(sum(c.arriving is not None for c in engine.chunks))
                sums = {n: p.detach().double().sum().item() for n, p in engine.module.named_parameters()}
            state = engine.module.state_dict()
            return {"in_flight_after_step": in_flight,
                    "diff_sums": max(abs(sums[n] - float(ref[n].double().sum())) for n in sums),
                    "diff_state_dict": max_diff(state, ref)}
        SCENARIOS[f"reads_right_after_step_stage{stage}"] = fn


_add_reads_after_step()


def gathers_at_the_step_end(rank, world, cache_chunks=None):
    """Stage 3: when step() returns, the rCache holds the chunks the next forward starts with,
    already gathering (runtime/cache.py's Note: gathers at the step's end), within its
    cache_chunks; the model trained and a state dict read right after a step (while those gathers
    are in flight) are plain PyTorch's."""
    data = batches(4, world, 2)
    ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 3, "chunk_size": 4000,
                                                          "cache_chunks": cache_chunks})
    held = []
    for step in data:
        x = step[0][rank]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        held.append({"cached": list(engine.cache.cached), "schedule": engine.cache.schedule[:6],
                     "gathering": sum(c.state.value == "gathering" for c in engine.chunks)})
    return {"held": held, "diff": max_diff(engine.full_state_dict(), ref)}


class Branchy(torch.nn.Module):
    """A branch that only rank 0's data takes (`use_b`): its parameters get a gradient on one rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))
        return self.head(h + self.b(h) if use_b else h)


def branch_on_one_rank(rank, world, stage):
    """Stages 1-2: the step's control all-reduce, which a rank with every slot's gradient does not
    wait for (grad_agreement.start_agreeing) and a rank missing one does (agree_grads), pairs
    across both: branch b steps everywhere with rank 0's gradient, as plain PyTorch steps it on the
    global batch (SGD+momentum, then AdamW, fp32, 1e-5)."""
    loss = lambda m, x, k, r, *_: m(x, use_b=(r == 0)).pow(2).mean()  # noqa: E731
    out = {}
    for opt in (make_sgd, make_adamw):
        engine, diff = parity(rank, world, Branchy, loss, inputs(3, world, 4, 8), opt,
                              {"stage": stage, "chunk_size": 80})
        out[opt.__name__] = {"diff": diff, "grad_norm": engine.stats()["grad_norm"]}
    return out


for _stage in (1, 2):  # stage 3 gathers per module: a branch on one rank diverges (DivergedError)
    SCENARIOS[f"branch_on_one_rank_stage{_stage}"] = functools.partial(branch_on_one_rank, stage=_stage)
SCENARIOS["gathers_at_the_step_end"] = gathers_at_the_step_end
SCENARIOS["gathers_at_the_step_end_cache2"] = lambda rank, world: gathers_at_the_step_end(rank, world, 2)


def desync_after_a_caught_backward_error(rank, world, stage=2):
    """Rank 0 raises half-way through a backward (after some chunks were reduced), catches it and
    carries on, a micro-batch behind the others: every rank must get DivergedError, never a hang.
    At stage 0 the others' step issues no collective (its STEP comparison meets rank 0's next
    gradient reduction's); at stages 1-3 the step's control all-reduce goes out beside it."""
    import time
    from zeroshard import DivergedError
    if world == 1:
        return {"raised": "n/a at world 1"}
    data = batches(6, world, 2)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": stage, "chunk_size": 4000})
    fail = {"now": False}

    def planted(grad):
        if fail["now"]:
            raise ValueError("planted failure in backward")
        return grad

    def hook_output(module, inputs, out):
        t = out[0] if isinstance(out, tuple) else out
        if t.requires_grad:
            t.register_hook(planted)
    engine.module.transformer.h[0].register_forward_hook(hook_output)
    t0 = time.perf_counter()
    try:
        for k, step in enumerate(data):
            x = step[0][rank]
            fail["now"] = rank == 0 and k == 2
            try:
                engine.backward(engine(input_ids=x, labels=x).loss)
            except ValueError:
                continue  # what a user's try/except around a step does
            engine.step()
    except DivergedError as e:
        mine = {"raised": "DivergedError", "seconds": time.perf_counter() - t0, "message": str(e)[:300]}
    else:
        mine = {"raised": None}
    return {"ranks": every_rank(mine)}


for _stage in (0, 1, 2):
    SCENARIOS["desync_after_a_caught_backward_error" + ("" if _stage == 2 else f"_stage{_stage}")] = \
        lambda rank, world, stage=_stage: desync_after_a_caught_backward_error(rank, world, stage)


def desync_after_a_skipped_step_stage0(rank, world):
    """Stage 0: the last rank leaves out one engine.step() that the others make (a step issues no
    collective there: its STEP tag rides on the next comparison, ordering.py); every rank must get
    DivergedError at the next gradient reduction, naming the step, never a hang or an update
    applied by some ranks only without a word."""
    import time
    from zeroshard import DivergedError
    if world == 1:
        return {"raised": "n/a at world 1"}
    data = batches(6, world, 2)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 0, "chunk_size": 4000})
    t0 = time.perf_counter()
    try:
        for k, step in enumerate(data):
            x = step[0][rank]
            engine.backward(engine(input_ids=x, labels=x).loss)
            if not (rank == world - 1 and k == 2):
                engine.step()
    except DivergedError as e:
        mine = {"raised": "DivergedError", "seconds": time.perf_counter() - t0, "message": str(e)[:300],
                "at": k}
    else:
        mine = {"raised": None}
    return {"ranks": every_rank(mine)}


SCENARIOS["desync_after_a_skipped_step_stage0"] = desync_after_a_skipped_step_stage0


def desync_after_a_caught_step_error(rank, world, stage=2, clip=1.0):
    """Rank 0's optimizer step raises after the step's first collective (the control all-reduce,
    with the clipping norm); it catches the error and trains on, a step behind the others, which
    went on to the step's all-gathers (stage 3: the next forward's first gathers, rCache's Note:
    gathers at the step's end): every rank must get DivergedError, never a hang."""
    import time
    from zeroshard import DivergedError
    if world == 1:
        return {"raised": "n/a at world 1"}
    data = batches(6, world, 2)
    planted = {"now": False}

    class FailingSGD(torch.optim.SGD):
        def step(self, closure=None):
            if planted["now"]:
                raise ValueError("planted failure in the optimizer step")
            return super().step(closure)

    engine = zeroshard.initialize(tiny_gpt2(), lambda ps: FailingSGD(ps, lr=0.05, momentum=0.9),
                                  {"stage": stage, "chunk_size": 4000, "clip_grad_norm": clip})
    t0 = time.perf_counter()
    guarded = None  # after the failed step: (chunks still arriving, torch function modes on the stack)
    try:
        for k, step in enumerate(data):
            x = step[0][rank]
            engine.backward(engine(input_ids=x, labels=x).loss)
            planted["now"] = rank == 0 and k == 2
            try:
                engine.step()
            except ValueError:
                guarded = (sum(c.arriving is not None for c in engine.chunks), torch._C._len_torch_function_stack())
                if stage == 3:  # no arrivals nor guard: the next forward's first chunks, gathering as the peers'
                    guarded = (len(engine.cache.cached), torch._C._len_torch_function_stack())
                continue
    except DivergedError as e:
        mine = {"raised": "DivergedError", "seconds": time.perf_counter() - t0, "message": str(e)[:300]}
    else:
        mine = {"raised": None}
    mine["guarded"] = guarded
    return {"ranks": every_rank(mine)}


SCENARIOS["desync_after_a_caught_step_error"] = desync_after_a_caught_step_error
SCENARIOS["desync_after_a_caught_step_error_stage1"] = \
    lambda rank, world: desync_after_a_caught_step_error(rank, world, stage=1, clip=None)
SCENARIOS["desync_after_a_caught_step_error_stage3"] = \
    lambda rank, world: desync_after_a_caught_step_error(rank, world, stage=3, clip=None)


# -- the exact Adam kernel (optim/exact_adam.py) on each rank's spans -----------------------------
def _grouped_adamw(ps):
    """AdamW with the matrices decayed and the rest not, at another lr (two groups of spans)."""
    ps = list(ps)
    return torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3)


EXACT_ADAM_CONFIGS = {  # the kernel steps masters on the host: stages 0 and 2 keep them on the device (a GPU
    # where there is one), the offloaded stage 3 on the host anywhere, and steps them in the delayed update's thread
    "stage0": {"stage": 0}, "stage2": {"stage": 2},
    "stage3_delayed": {"stage": 3, "offload_optimizer": True, "delay_update_after": 1}}


def exact_adam_kernel(rank, world):
    """Per config, the engine with the exact kernel on for any size and then off: every bit of the
    trained model equal, the elements the kernel stepped on each rank, and the reference's
    distance (the delayed update trains another model: no reference there)."""
    import os

    from zeroshard.optim import exact_adam
    data = batches(4, world, 2)
    ref, _, _ = reference(tiny_gpt2(), data, _grouped_adamw)
    step, counted = exact_adam.step_, []
    out = {"built": exact_adam.ops() is not None, "cuda": torch.cuda.is_available()}
    exact_adam.step_ = lambda p, *a: (counted.append(p.numel()), step(p, *a))
    try:
        for name, cfg in EXACT_ADAM_CONFIGS.items():
            digests = {}
            for mode in ("on", "off"):
                os.environ["ZEROSHARD_EXACT_ADAM"] = mode
                model = tiny_gpt2()
                engine = zeroshard.initialize(model, _grouped_adamw(model.parameters()), {**cfg, "chunk_size": 20000})
                for s in data:
                    engine.backward(engine(input_ids=s[0][rank], labels=s[0][rank]).loss)
                    engine.step()
                with engine.full_parameters():  # lands a delayed update
                    pass
                sd = engine.full_state_dict()
                digests[mode] = digest(sd)
                out[f"{name}_{mode}_diff"] = max_diff(sd, ref)
                if mode == "on":
                    out[f"{name}_kernel_elements"] = every_rank(sum(counted))
                counted.clear()
            out[f"{name}_equal"] = digests["on"] == digests["off"]
    finally:
        exact_adam.step_ = step
        os.environ.pop("ZEROSHARD_EXACT_ADAM", None)
    return out


SCENARIOS["exact_adam_kernel"] = exact_adam_kernel
