"""The parity scenarios: every stage, precision, accumulation, clipping and offload setting against
plain PyTorch on the global batch, and SCENARIOS, the registry that also runs step_scenarios',
delayed_update_scenarios' and offload_memory_scenarios' scenarios, inside one process group per
world size.

`run_all(rank, world, out_path)` runs each scenario on every rank and rank 0 writes a JSON dict
{scenario name: figures}. A scenario that raises records {"error": "<Type>: <message>"} (on every
rank alike: scenarios that raise do so before or at the same collective on all ranks).
"""
from __future__ import annotations

import functools

import torch

import zeroshard
import delayed_update_scenarios
import offload_memory_scenarios
import step_scenarios
from distributed import WorldResults, every_rank, record
from models import (Quirky, batches, make_adamw, make_sgd, max_diff, parity, quirky_data, quirky_loss, reference,
                    tiny_gpt2, train)

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


@scenario
def fp16_overflow_skips_everywhere(rank, world):
    """Huge initial scale: the first step overflows on every rank."""
    x = batches(1, world, 2)[0, 0, rank]
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": 3, "precision": "fp16",
                                                           "initial_loss_scale": 2.0**40})
    before = engine.full_state_dict()
    engine.backward(engine(input_ids=x, labels=x).loss)
    applied = engine.step()
    return {"applied": every_rank(applied), "scale": every_rank(engine.stats()["loss_scale"]),
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
    return {"applied": every_rank(applied), "scale": engine.stats()["loss_scale"]}


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
    """An L2 penalty on one weight, read by the loss outside every forward (it raised
    ShardedParameterError at stage 3): trained as in torch, also through a 1-chunk rCache."""
    def loss(m, x, *_):
        return m(x).pow(2).mean() + m.head.weight.pow(2).sum()
    data = quirky_data(3, world)[:, 0]
    return {f"cache{n}": parity(rank, world, Quirky, loss, data, make_sgd,
                                {"stage": 3, "chunk_size": 600, "cache_chunks": n})[1] for n in (None, 1)}


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


def _evaluating_in_inference_mode(engine, data, rank) -> None:
    """Training with an evaluation under torch.inference_mode() after every step, as Lightning's
    validation loop runs it with NCCL, and a generation from the model itself (not the engine)."""
    for step in data:
        for micro in step:
            engine.train()
            engine.backward(engine(input_ids=micro[rank], labels=micro[rank]).loss)
            engine.step()
            engine.eval()
            with torch.inference_mode():
                engine(input_ids=micro[rank], labels=micro[rank])
                engine.module.generate(micro[rank][:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    engine.train()


INFERENCE_MODE_CONFIGS = {"stage3": {"stage": 3}, "stage3_cache1": {"stage": 3, "cache_chunks": 1},
                          "stage3_offload_params": {"stage": 3, "offload_optimizer": True, "offload_params": True},
                          "stage2": {"stage": 2}}


@scenario
def eval_in_inference_mode(rank, world):
    """Evaluations under torch.inference_mode() between steps leave training as it was: at stage 3
    the next training forward raised "Inference tensors cannot be saved for backward" (the chunks
    gathered in the evaluation, kept in the rCache, were inference tensors). The evaluations are no
    part of the recorded schedule: recorded, every later step departed from it. A forward of the
    model itself (generate) follows the schedule from its start, as the engine's do."""
    data = batches(3, world, 1)
    want, _, _ = reference(tiny_gpt2(), data, make_sgd)
    out = {}
    for label, cfg in INFERENCE_MODE_CONFIGS.items():
        engine = zeroshard.initialize(tiny_gpt2(), make_sgd, {**cfg, "chunk_size": 20000})
        _evaluating_in_inference_mode(engine, data, rank)
        out[label] = max_diff(engine.full_state_dict(), want)
        out[f"{label}_departures"] = engine.stats().get("schedule_departures", 0)
    return out


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
            time.sleep(1.0)  # long enough for a loaded machine's other ranks to raise first (0.3 was not)

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
    unissued = every_rank(len(sequencer._queue) if sequencer is not None else 0)
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


# The registry runs the parity scenarios above, then these modules' scenarios, in this order.
for _module in (step_scenarios, delayed_update_scenarios, offload_memory_scenarios):
    SCENARIOS.update(_module.SCENARIOS)


def run_all(rank, world, out_path, only=None, registry=None):
    """Run the scenarios of `registry` (default SCENARIOS; only those named in `only`, if given)."""
    chosen = SCENARIOS if registry is None else registry
    record(rank, out_path, [(name, functools.partial(fn, rank, world)) for name, fn in chosen.items()
                            if not only or name in only], traceback_limit=-3)


# The parity scenarios' results at worlds 1-3, for every test module that reads them (test_parity,
# test_auto, test_offload, ...): each names it as its RESULTS (conftest.py's `res` fixture).
PARITY = WorldResults(run_all, "parity")
