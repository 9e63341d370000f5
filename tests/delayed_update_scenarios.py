"""ZeRO-Offload's delayed parameter update (delay_update_after), part of scenarios.SCENARIOS: against
the delayed reference and the exact one, a checkpoint saved with an update in flight, and a failure
in the background step.
"""
from __future__ import annotations

import shutil

import torch

import zeroshard
from distributed import every_rank, shared_temp_dir
from models import batches, delayed_reference, make_adamw, make_sgd, max_diff, reference, tiny_gpt2

SCENARIOS = {}


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


def delayed_checkpoint_resume(rank, world):
    """A checkpoint saved while an update is in flight, resumed by a new engine at another stage,
    continues exactly as the run that saved it."""
    data = batches(6, world, 2)
    cfg = {"stage": 2, "chunk_size": 20000, "offload_optimizer": True, "delay_update_after": 1}
    root = shared_temp_dir()
    whole = zeroshard.initialize(tiny_gpt2(), make_adamw, cfg)
    _train_delayed(whole, data, rank, 0.9, save=(2, root))
    resumed = zeroshard.initialize(tiny_gpt2(), make_adamw, {**cfg, "stage": 3})
    resumed.load_checkpoint(root, tag="mid")  # param groups too: the decayed lr
    _train_delayed(resumed, data, rank, 0.9, start=3)
    out = {"diff": max_diff(whole.full_state_dict(), resumed.full_state_dict()),
           "lr": [whole.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]]}
    every_rank(None)  # every rank is done reading before rank 0 removes the files
    if rank == 0:
        shutil.rmtree(root)
    return out


SCENARIOS["delayed_checkpoint_resume"] = delayed_checkpoint_resume


class _Failing(torch.optim.SGD):
    """SGD that raises once its param group says "fail" (set by the user between steps)."""

    def step(self, closure=None):
        if self.param_groups[0].get("fail"):
            raise ValueError("planted failure")
        return super().step(closure)


def delayed_step_failure(rank, world):
    """An exception in the background step is raised by the next step(), on every rank, as it is (its
    type, with a note saying where it was raised)."""
    data = batches(5, world, 2)
    engine = zeroshard.initialize(tiny_gpt2(), lambda ps: _Failing(ps, lr=0.05),
                                  {"stage": 2, "chunk_size": 20000, "offload_optimizer": True,
                                   "delay_update_after": 1})
    out = {"raised": None}
    for k, step in enumerate(data):
        engine.backward(engine(input_ids=step[0][rank], labels=step[0][rank]).loss)
        try:
            engine.step()
        except ValueError as e:
            out = {"raised": str(e), "type": type(e).__name__, "notes": getattr(e, "__notes__", []), "at_step": k}
            break
        engine.optimizer.param_groups[0]["fail"] = k == 2  # the update launched at step 3 fails
    return out


SCENARIOS["delayed_step_failure"] = delayed_step_failure
