"""Every multi-process scenario, run inside one process group per world size.

`run_all(rank, world, out_path)` runs each scenario on every rank and rank 0 writes a JSON dict
{scenario name: figures}. A scenario that raises records {"error": "<Type>: <message>"} (on every
rank alike: scenarios that raise do so before or at the same collective on all ranks).
"""
from __future__ import annotations

import functools
import shutil
import tempfile

import torch
import torch.distributed as dist

import zeroshard
from distributed import WorldResults, record
from models import (Quirky, batches, delayed_reference, inputs, make_adamw, make_sgd, max_diff, parity,
                    quirky_data, quirky_loss, reference, tiny_gpt2, train)

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def gpt2_case(rank, world, opt, stage, accumulation=1, clip=None, extra=None, steps=5, model=tiny_gpt2):
    data = batches(steps, world, 2, accumulation)
    ref, _, norms = reference(model(), data, opt, clip)
    cfg = {"stage": stage, "chunk_size": 20000, "gradient_accumulation_steps": accumulation,
           "clip_grad_norm": clip, **(extra or {})}
    engine = zeroshard.initialize(model(), opt, cfg)
    train(engine, data, rank)
    out = {"diff": max_diff(engine.full_state_dict(), ref), **engine.stats()}
    if clip is not None:
        out["ref_norms"] = norms
    return out


def _add_gpt2_parity():
    for opt in (make_adamw, make_sgd):
        for mode, kw in (("plain", {}), ("accum2", {"accumulation": 2}), ("clip", {"clip": 0.5})):
            for stage in range(4):
                def fn(rank, world, opt=opt, stage=stage, kw=kw):
                    return gpt2_case(rank, world, opt, stage, **kw)
                SCENARIOS[f"gpt2_{opt.__name__[5:]}_{mode}_stage{stage}"] = fn


_add_gpt2_parity()


@scenario
def gpt2_stage3_cache2(rank, world):
    return gpt2_case(rank, world, make_sgd, 3, extra={"cache_chunks": 2})


@scenario
def ddp_adamw_accum2(rank, world):
    """torch DDP on the same AdamW case: how far an exact-by-construction engine lands."""
    data = batches(5, world, 2, 2)
    ref, _, _ = reference(tiny_gpt2(), data, make_adamw)
    if world == 1:
        return {"diff": None}
    model = torch.nn.parallel.DistributedDataParallel(tiny_gpt2())
    opt = make_adamw(list(model.parameters()))
    for step in data:
        for i, micro in enumerate(step):
            x = micro[rank]
            loss = model(input_ids=x, labels=x).loss / len(step)
            if i < len(step) - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {"diff": max_diff(model.module.state_dict(), ref)}


def _add_quirky():
    for ckpt in (None, False, True):
        for stage in range(4):
            for cache in (None, 1):
                def fn(rank, world, ckpt=ckpt, stage=stage, cache=cache):
                    data = quirky_data(3, world)
                    loss = lambda m, x: m(x, checkpoint=ckpt).pow(2).mean()  # noqa: E731
                    ref, _, _ = reference(Quirky(), data, make_sgd, loss_fn=loss)
                    engine = zeroshard.initialize(Quirky(), make_sgd,
                                                  {"stage": stage, "chunk_size": 600, "cache_chunks": cache})
                    train(engine, data, rank, loss_fn=loss)
                    return {"diff": max_diff(engine.full_state_dict(), ref),
                            "first_chunk": [s.name for s in engine.chunks[0].slots]}
                SCENARIOS[f"quirky_ckpt{ckpt}_stage{stage}_cache{cache}"] = fn


_add_quirky()


@scenario
def hf_gradient_checkpointing_stage3(rank, world):
    def model():
        m = tiny_gpt2()
        m.gradient_checkpointing_enable()
        return m
    return gpt2_case(rank, world, make_sgd, 3, extra={"cache_chunks": 2}, steps=3, model=model)


@scenario
def mlp_stage3_minimal_cache(rank, world):
    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                     for _ in range(6)])
    engine = zeroshard.initialize(mlp(), make_sgd, {"stage": 3, "chunk_size": 1100, "cache_chunks": 1})
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        engine.backward(engine(torch.randn(4, 32, generator=g)).pow(2).mean())
        engine.step()
    return engine.stats()


@scenario
def memory_bf16_adamw(rank, world):
    out = {}
    data = batches(2, world, 2)
    for stage in range(4):
        engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": stage, "precision": "bf16"})
        train(engine, data, rank)
        out[stage] = engine.stats()
    return out


def _add_precision():
    for prec in ("bf16", "fp16"):
        for stage in (0, 2, 3):
            def fn(rank, world, prec=prec, stage=stage):
                data = batches(5, world, 2)
                ref, _, _ = reference(tiny_gpt2(), data, make_adamw)
                engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": stage, "precision": prec})
                train(engine, data, rank)
                sd = engine.full_state_dict()
                d = torch.cat([(sd[k] - ref[k]).abs().flatten() for k in ref])
                return {"max": d.max().item(), "mean": d.mean().item(), **engine.stats()}
            SCENARIOS[f"precision_{prec}_stage{stage}"] = fn


_add_precision()


def _gather(obj, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


@scenario
def fp16_overflow_skips_everywhere(rank, world):
    """Huge initial scale: the first step overflows on every rank."""
    x = batches(1, world, 2)[0, 0, rank]
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "precision": "fp16",
                                                           "initial_loss_scale": 2.0**40})
    before = engine.full_state_dict()
    engine.backward(engine(input_ids=x, labels=x).loss)
    applied = engine.step()
    return {"applied": _gather(applied, world), "scale": _gather(engine.stats()["loss_scale"], world),
            "unchanged": max_diff(engine.full_state_dict(), before) == 0.0}


@scenario
def fp16_overflow_on_one_rank(rank, world):
    """Only rank 0 produces an inf, in one parameter's gradient (so in one rank's shard at most):
    every rank must skip, and a normal step must follow."""
    data = batches(2, world, 2)
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 2, "precision": "fp16"})
    applied = []
    for i, step in enumerate(data):
        x = step[0][rank]
        loss = engine(input_ids=x, labels=x).loss
        if i == 0 and rank == 0:
            loss = loss + engine.module.transformer.ln_f.bias.sum() * 1e30
        engine.backward(loss)
        applied.append(engine.step())
    return {"applied": _gather(applied, world), "scale": engine.stats()["loss_scale"]}


def _add_diverge():
    def second_loss(m, x, r):  # rank 0 alone also runs a module the others skip
        out = m(x)
        if r == 0:
            out = out + m.unused(torch.zeros(24)).sum()
        return out.pow(2).mean()

    for stage in (2, 3):
        def fn(rank, world, stage=stage):
            xs = quirky_data(1, world)[0, 0]
            # Plain PyTorch on the global batch: the mean of every rank's loss.
            ref = Quirky()
            opt = make_sgd(list(ref.parameters()))
            for loss in (lambda r: quirky_loss(ref, xs[r]), lambda r: second_loss(ref, xs[r], r)):
                (sum(loss(r) for r in range(world)) / world).backward()
                opt.step()
                opt.zero_grad()
            engine = zeroshard.initialize(Quirky(), make_sgd, {"stage": stage, "chunk_size": 600})
            engine.backward(quirky_loss(engine, xs[rank]))
            engine.step()
            engine.backward(second_loss(engine, xs[rank], rank))
            engine.step()
            return {"error": None, "diff": max_diff(engine.full_state_dict(), ref.state_dict())}
        SCENARIOS[f"diverged_order_stage{stage}"] = fn


_add_diverge()


@scenario
def param_read_outside_forward(rank, world):
    engine = zeroshard.initialize(Quirky(), make_sgd, {"stage": 3, "chunk_size": 600})
    x = quirky_data(1, world)[0, 0, rank]
    out = engine(x)
    loss = out.pow(2).mean() + engine.module.head.weight.pow(2).sum()
    engine.backward(loss)
    return {"error": None}


@scenario
def eval_no_grad_stage3(rank, world):
    data = batches(3, world, 2)
    ref_model = tiny_gpt2()
    reference(ref_model, data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {"stage": 3, "cache_chunks": 2, "chunk_size": 20000})
    train(engine, data, rank)
    x = data[0, 0].reshape(-1, data.shape[-1])
    engine.eval()
    with torch.no_grad():
        got = engine(input_ids=x, labels=x).loss.item()
        want = ref_model(input_ids=x, labels=x).loss.item()
    return {"diff": abs(got - want)}


@scenario
def prefetch_issued_on_one_rank_then_another_engine(rank, world):
    """A forward raises on every rank at the same module, after a prefetch was handed over; one rank
    had polled its comparison back and issued the gather, the others had not (the poll comes at the
    next hook). The engine is let go of, and another one, made before, trains on the same process
    group: its gathers must not pair with the orphan's messages (ordering.py's Note: prefetches
    handed over)."""
    import time
    cfg = {"stage": 3, "cache_chunks": 2, "chunk_size": 20000}
    data = batches(3, world, 2)
    ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
    first = zeroshard.initialize(tiny_gpt2(), make_sgd, cfg)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, cfg)  # set up before the orphan exists
    train(first, data[:2], rank)  # its values now differ from the other engine's; it prefetches

    def late(module, inputs, out):
        if rank == 0:  # the others hand block 1's prefetch over first: theirs wait for rank 0's comparison
            time.sleep(0.3)

    def stop(module, inputs, out):
        if rank == 0:
            time.sleep(0.3)  # every comparison handed over is back by now
            first.shards.progress()
        raise RuntimeError("planted failure in forward")
    first.module.transformer.h[0].register_forward_hook(late)
    first.module.transformer.h[1].register_forward_hook(stop)
    x = data[2][0][rank]
    try:
        first(input_ids=x, labels=x)
    except RuntimeError:
        pass
    sequencer = first.shards.inside.sequencer
    unissued = _gather(len(sequencer._queue) if sequencer is not None else 0, world)
    del first
    train(engine, data, rank)
    return {"unissued": unissued, "diff": max_diff(engine.full_state_dict(), ref)}


def _hf_model(kind):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                     num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                                     attention_dropout=0.0, word_embed_proj_dim=32)
        return transformers.OPTForCausalLM(cfg)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _add_hf():
    for kind in ("opt", "llama"):
        for stage in (2, 3):
            def fn(rank, world, kind=kind, stage=stage):
                return gpt2_case(rank, world, make_sgd, stage, steps=3, model=lambda: _hf_model(kind),
                                 extra={"chunk_size": 5000, "cache_chunks": 2 if stage == 3 else None})
            SCENARIOS[f"{kind}_stage{stage}"] = fn


_add_hf()



# -- offload (ZeRO-Offload, ZeRO-R P_a+cpu) ------------------------------------------------------
OFFLOAD_FLAGS = {
    "opt": {"offload_optimizer": True},
    "params": {"offload_params": True},
    "act": {"offload_activations": True},
    "all": {"offload_optimizer": True, "offload_params": True, "offload_activations": True},
}
OFFLOAD_CASES = {  # name: (precision, optimizer factory, extra config)
    "fp32_sgd_clip": ("fp32", make_sgd, {"clip_grad_norm": 0.5}),
    "fp32_adamw": ("fp32", make_adamw, {}),
    "bf16_cpuadamw": ("bf16", zeroshard.CPUAdamW, {}),
    "fp16_cpuadamw": ("fp16", zeroshard.CPUAdamW, {}),
}


def _add_offload():
    for case, (prec, opt, extra) in OFFLOAD_CASES.items():
        for stage in (1, 2, 3):
            def fn(rank, world, prec=prec, opt=opt, extra=extra, stage=stage):
                data = batches(3, world, 2, accumulation=2)
                ref, _, _ = reference(tiny_gpt2(), data, opt, extra.get("clip_grad_norm"))
                cfg = {"stage": stage, "precision": prec, "chunk_size": 20000,
                       "gradient_accumulation_steps": 2, **extra}
                base = zeroshard.initialize(tiny_gpt2(), opt, cfg)
                train(base, data, rank)
                base_sd = base.full_state_dict()
                out = {"base_vs_ref": max_diff(base_sd, ref)}
                for flag, kw in OFFLOAD_FLAGS.items():
                    if stage != 3:  # offload_params is stage 3 only: "all" is the other two
                        if flag == "params":
                            continue
                        kw = {k: v for k, v in kw.items() if k != "offload_params"}
                    engine = zeroshard.initialize(tiny_gpt2(), opt, {**cfg, **kw})
                    train(engine, data, rank)
                    sd = engine.full_state_dict()
                    out[flag] = {"diff": max_diff(sd, base_sd), "vs_ref": max_diff(sd, ref),
                                 **engine.stats()}
                return out
            SCENARIOS[f"offload_{case}_stage{stage}"] = fn


_add_offload()


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


@scenario
def plain_backward_fp16_raises(rank, world):
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 2, "precision": "fp16", "chunk_size": 20000})
    x = batches(1, world, 1)[0, 0, rank]
    try:
        engine(input_ids=x, labels=x).loss.backward()
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"raised": None}


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
    return {"ranks": _gather(mine, world)}


for _stage in (0, 1, 2):
    SCENARIOS["desync_after_a_caught_backward_error" + ("" if _stage == 2 else f"_stage{_stage}")] = \
        lambda rank, world, stage=_stage: desync_after_a_caught_backward_error(rank, world, stage)


@scenario
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
    return {"ranks": _gather(mine, world)}


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
    return {"ranks": _gather(mine, world)}


SCENARIOS["desync_after_a_caught_step_error"] = desync_after_a_caught_step_error
SCENARIOS["desync_after_a_caught_step_error_stage1"] = \
    lambda rank, world: desync_after_a_caught_step_error(rank, world, stage=1, clip=None)
SCENARIOS["desync_after_a_caught_step_error_stage3"] = \
    lambda rank, world: desync_after_a_caught_step_error(rank, world, stage=3, clip=None)


# -- delayed parameter update (ZeRO-Offload's DPU) ---------------------------------------------------
DELAYED_CASES = {  # name: (precision, optimizer factory, accumulation, clip, lr decay per step)
    "fp32_sgd_lrdecay": ("fp32", make_sgd, 1, None, 0.8),
    "fp32_adamw_accum2_clip": ("fp32", make_adamw, 2, 0.5, 1.0),
    "bf16_sgd": ("bf16", make_sgd, 1, None, 1.0),
    "bf16_cpuadamw": ("bf16", zeroshard.CPUAdamW, 1, None, 1.0),
}


def _train_delayed(engine, data, rank, lr_decay, start=0, stop=None, save=None):
    """train() with an LR change after every step; `save`: (step, directory) to checkpoint after."""
    for k, step in enumerate(data[start:stop], start):
        for micro in step:
            engine.backward(engine(input_ids=micro[rank], labels=micro[rank]).loss)
            engine.step()
        for g in engine.optimizer.param_groups:
            g["lr"] *= lr_decay
        if save is not None and k == save[0]:
            engine.save_checkpoint(save[1], tag="mid")


def _add_delayed():
    for case, (prec, opt, accumulation, clip, decay) in DELAYED_CASES.items():
        for stage in (1, 2, 3):
            if prec != "fp32" and stage != 2:
                continue
            def fn(rank, world, prec=prec, opt=opt, accumulation=accumulation, clip=clip, decay=decay,
                   stage=stage):
                data = batches(5, world, 2, accumulation)
                ref = delayed_reference(tiny_gpt2(), data, opt, 2, clip, decay)
                exact, _, _ = reference(tiny_gpt2(), data, opt, clip)
                engine = zeroshard.initialize(tiny_gpt2(), opt, {
                    "stage": stage, "precision": prec, "chunk_size": 20000, "offload_optimizer": True,
                    "gradient_accumulation_steps": accumulation, "clip_grad_norm": clip, "delay_update_after": 2})
                _train_delayed(engine, data, rank, decay)
                sd = engine.full_state_dict()
                return {"diff": max_diff(sd, ref), "vs_exact": max_diff(sd, exact), **engine.stats()}
            SCENARIOS[f"delayed_{case}_stage{stage}"] = fn


_add_delayed()


@scenario
def delayed_checkpoint_resume(rank, world):
    """A checkpoint saved while an update is in flight, resumed by a new engine at another stage,
    continues exactly as the run that saved it."""
    data = batches(6, world, 2)
    cfg = {"stage": 2, "chunk_size": 20000, "offload_optimizer": True, "delay_update_after": 1}
    root = tempfile.mkdtemp() if rank == 0 else None
    root = _gather(root, world)[0]
    whole = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
    _train_delayed(whole, data, rank, 0.9, save=(2, root))
    resumed = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "stage": 3})
    resumed.load_checkpoint(root, tag="mid")  # param groups too: the decayed lr
    _train_delayed(resumed, data, rank, 0.9, start=3)
    out = {"diff": max_diff(whole.full_state_dict(), resumed.full_state_dict()),
           "lr": [whole.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]]}
    _gather(None, world)  # every rank is done reading before rank 0 removes the files
    if rank == 0:
        shutil.rmtree(root)
    return out


class _Failing(torch.optim.SGD):
    """SGD that raises once its param group says "fail" (set by the user between steps)."""

    def step(self, closure=None):
        if self.param_groups[0].get("fail"):
            raise ValueError("planted failure")
        return super().step(closure)


@scenario
def delayed_step_failure(rank, world):
    """An exception in the background step is raised by the next step(), on every rank."""
    data = batches(5, world, 2)
    engine = zeroshard.initialize(tiny_gpt2(), lambda ps: _Failing(ps, lr=0.05),
                                  {"stage": 2, "chunk_size": 20000, "offload_optimizer": True,
                                   "delay_update_after": 1})
    out = {"raised": None}
    for k, step in enumerate(data):
        engine.backward(engine(input_ids=step[0][rank], labels=step[0][rank]).loss)
        try:
            engine.step()
        except RuntimeError as e:
            out = {"raised": str(e), "at_step": k}
            break
        engine.optimizer.param_groups[0]["fail"] = k == 2  # the update launched at step 3 fails
    return out


@scenario
def offload_memory_bf16_adamw(rank, world):
    """Per-rank model-state bytes by device with offload, bf16 + AdamW (one micro-batch per step)."""
    out = {}
    data = batches(2, world, 2)
    for name, cfg in (("s1_opt", {"stage": 1, "offload_optimizer": True}),
                      ("s2_opt", {"stage": 2, "offload_optimizer": True}),
                      ("s3_opt", {"stage": 3, "offload_optimizer": True}),
                      ("s3_params", {"stage": 3, "offload_params": True}),
                      ("s3_all", {"stage": 3, "offload_optimizer": True, "offload_params": True,
                                  "cache_chunks": 2})):
        engine = zeroshard.initialize(tiny_gpt2(), zeroshard.CPUAdamW,
                                      {"precision": "bf16", "chunk_size": 20000, **cfg})
        train(engine, data[:-1], rank)
        gathered = []  # shard bytes of every gather in the last step
        for c in engine.chunks:
            def spy(comm, compare=True, c=c, real=c.start_gather):
                gathered.append(c.shard_numel * 2)
                real(comm, compare)
            c.start_gather = spy
        train(engine, data[-1:], rank)
        s = engine.stats()
        s["shard_bytes"] = sum(c.shard_numel * 2 for c in engine.chunks)
        s["trainable_shard_bytes"] = sum(c.shard_numel * 2 for c in engine.chunks if c.trainable)
        s["gathered_shard_bytes"] = sum(gathered)
        s["gathers"] = len(gathered)
        s["num_chunks"] = len(engine.chunks)
        out[name] = s
    return out


# -- Elixir: offload="auto" -----------------------------------------------------------------------
AUTO_CASES = {  # name: (precision, optimizer factory)
    "fp32_sgd": ("fp32", make_sgd),
    "fp32_adamw": ("fp32", make_adamw),
    "bf16_cpuadamw": ("bf16", zeroshard.CPUAdamW),
}


def _auto_caps(world, prec, opt, example):
    """Device memory caps for the planner: generous (1 TiB) and tight (between what ZeRO-3 and
    ZeRO-3 offload need on the chunks the planner picks at that cap)."""
    from zeroshard.planning.auto_plan import optimizer_state_bytes
    from zeroshard.distributed.collectives import default_device
    from zeroshard.planning.hardware import probe
    from zeroshard.planning.planner import FRAGMENTATION, Planner, Target

    prof = zeroshard.profile(tiny_gpt2(), example, dtype=prec)
    hw = probe(default_device())  # the engine plans for its own device (on CUDA: with the driver reserve)

    def planner(cap):
        return Planner(prof, Target(hw.with_(device_memory=cap), world=world, accumulation=2,
                                    optimizer_state_bytes=optimizer_state_bytes(opt)))
    base = {b.name: b.device_bytes for b in planner(1 << 40).baselines()}
    tight = int((base["ZeRO-3"] + base["ZeRO-3 offload"]) / 2 / FRAGMENTATION)
    zero3_need = {b.name: b.device_bytes for b in planner(tight).baselines()}["ZeRO-3"] / FRAGMENTATION
    return {"generous": 1 << 40, "tight": tight}, zero3_need


def _add_auto():
    for case, (prec, opt) in AUTO_CASES.items():
        def fn(rank, world, prec=prec, opt=opt):
            data = batches(3, world, 2, accumulation=2)
            ref, _, _ = reference(tiny_gpt2(), data, opt)
            x = data[0, 0, rank]
            example = {"input_ids": x, "labels": x}
            caps, zero3_need = _auto_caps(world, prec, opt, example)
            out = {"zero3_need": zero3_need}
            for name, cap in caps.items():
                cfg = {"stage": "auto", "offload": "auto", "precision": prec, "device_memory": cap,
                       "gradient_accumulation_steps": 2}
                engine = zeroshard.initialize(tiny_gpt2(), opt, cfg, example_inputs=example)
                train(engine, data, rank)
                plan = engine.plan
                out[name] = {"diff": max_diff(engine.full_state_dict(), ref), "cap": cap, **engine.stats(),
                             "plan": plan.describe(), "plan_stage": plan.stage, "plan_fits": plan.fits,
                             "offloaded_chunks": plan.offloaded_chunks,
                             "predicted_device_model_bytes": plan.device_model_bytes,
                             "predicted_device_bytes": plan.device_bytes}
            return out
        SCENARIOS[f"auto_{case}"] = fn


_add_auto()


def run_all(rank, world, out_path, only=None, registry=None):
    """Run the scenarios of `registry` (default SCENARIOS; only those named in `only`, if given)."""
    chosen = SCENARIOS if registry is None else registry
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in chosen.items()
                            if not only or name in only], traceback_limit=-3)


# The parity scenarios' results at worlds 1-3, for every test module that reads them (test_parity,
# test_auto, test_offload, ...): each names it as its RESULTS (conftest.py's `res` fixture).
PARITY = WorldResults(run_all, "parity")
