"""Multi-process halves of tests/test_nonfinite.py (issue 16): config `nonfinite` at every stage and
precision. One rank's micro-batch of step 2 (of 3) is NaN, so its gradient is NaN on that rank only.

`run(rank, world, out_path)` runs every scenario on each rank of a spawned group (rank 0 writes
{name: figures} as JSON; a scenario that raises records its error).
"""
from __future__ import annotations

import torch
import torch.nn as nn

import zeroshard
from models import inputs, make_sgd, max_diff
from distributed import every_rank
from scenarios import run_all

SCENARIOS = {}
BAD_STEP = 1  # 0-based: the second of three steps


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def data(world):
    x = inputs(3, world, 4, 6)
    x[BAD_STEP, world - 1, 0, 0] = float("nan")
    return x


def reference(world, skip: int | None):
    """Plain PyTorch on the global batch, step `skip` left out (None: every step, NaN and all)."""
    m = model()
    opt = make_sgd(list(m.parameters()))
    for k, step in enumerate(data(world)):
        if k == skip:
            continue
        m(step.reshape(-1, 6)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m.state_dict()


def train(rank, world, cfg, steps=None):
    """Returns (engine, each step's result: True/False, or the error raised on this rank)."""
    engine = zeroshard.initialize(model(), make_sgd, {"chunk_size": 64, **cfg})
    results = []
    for k, step in enumerate(data(world)):
        if steps is not None and k not in steps:
            continue
        try:
            engine.backward(engine(step[rank]).pow(2).mean())
            results.append(engine.step())
        except zeroshard.NonFiniteError as e:
            results.append(f"NonFiniteError: {e}")
    return engine, results


def case(rank, world, stage, precision, mode):
    cfg = {"stage": stage, "precision": precision, "nonfinite": mode}
    engine, results = train(rank, world, cfg)
    got = engine.full_state_dict()
    out = {"results": every_rank(results), "skipped": engine.stats().get("skipped_steps")}
    if mode == "ignore":
        out["all_nan"] = all(bool(v.isnan().all()) for v in got.values())
        out["torch_all_nan"] = all(bool(v.isnan().all()) for v in reference(world, None).values())
        return out
    # The step that saw NaN changed nothing: the same as a run without that step's data, exactly,
    # and (fp32) as plain PyTorch without it.
    clean, _ = train(rank, world, cfg, steps=[k for k in range(3) if k != BAD_STEP])
    out["vs_without_step"] = max_diff(got, clean.full_state_dict())
    out["vs_torch"] = max_diff(got, reference(world, BAD_STEP))
    return out


for _stage in range(4):
    for _precision in ("fp32", "bf16"):
        for _mode in ("skip", "raise", "ignore"):
            SCENARIOS[f"{_mode}_{_precision}_stage{_stage}"] = (
                lambda rank, world, s=_stage, p=_precision, m=_mode: case(rank, world, s, p, m))


def fp16_raise(rank, world):
    """fp16 with nonfinite='raise': the first NaN step is an overflow (skipped, loss scale 2 -> 1);
    at scale 1 a NaN gradient raises."""
    x = data(world)
    x[BAD_STEP + 1, world - 1, 0, 0] = float("nan")
    engine = zeroshard.initialize(model(), make_sgd, {"stage": 2, "precision": "fp16", "nonfinite": "raise",
                                                      "initial_loss_scale": 2.0})
    results = []
    for step in x:
        try:
            engine.backward(engine(step[rank]).pow(2).mean())
            results.append(engine.step())
        except zeroshard.NonFiniteError as e:
            results.append(f"NonFiniteError: {e}")
    return {"results": every_rank(results), "scale": engine.scaler.scale}


SCENARIOS["fp16_raise"] = fp16_raise


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
