"""ZeRO-Offload's one-step delayed parameter update (config `delay_update_after`): the engine trains
what models.delayed_reference trains in plain PyTorch, at every world size and stage, and not what
the exact (undelayed) reference trains.

Tolerances against the delayed reference: fp32 SGD 1e-5 and fp32 AdamW models.ADAMW_TOL, as in
test_parity. bf16 SGD: 2e-3 (parameters are rounded to bf16 on every upload; SGD is linear, so the
rounding does not grow; measured 3.1e-4 to 3.7e-4 at worlds 1-3, where the delay itself moves
parameters 3.0e-3 to 5.8e-3).
bf16 CPUAdamW: 1e-2, the parity bound for 16-bit AdamW (test_parity), which cannot tell the delay
apart; it is there for the fused 16-bit copy path, which only CPUAdamW takes.
"""
import pytest

from delayed_update_scenarios import DELAYED_CASES
from distributed import ok
from models import ADAMW_TOL
from scenarios import PARITY

RESULTS = PARITY  # read by the `res` fixture (conftest.py)

TOL = {"fp32_sgd_lrdecay": 1e-5, "fp32_adamw_accum2_clip": ADAMW_TOL, "bf16_sgd": 2e-3, "bf16_cpuadamw": 1e-2}
# How far the delayed run must land from the exact one, so that a run that did not delay fails.
APART = {"fp32_sgd_lrdecay": 1e-3, "fp32_adamw_accum2_clip": 5e-4, "bf16_sgd": 2e-3}


# 16-bit cases at stage 2 only (bf16 matmuls are slow on CPUs); fp32 covers stages 1-3.
CASES = [(case, stage) for case in DELAYED_CASES for stage in (1, 2, 3)
         if case.startswith("fp32") or stage == 2]


@pytest.mark.parametrize("case, stage", CASES)
def test_delayed_update_trains_the_delayed_reference(res, case, stage):  # noqa: F811
    r, world = res
    got = ok(r, f"delayed_{case}_stage{stage}")
    assert got["diff"] <= TOL[case], got["diff"]
    if case in APART:
        assert got["vs_exact"] >= APART[case], got["vs_exact"]
    moved = got["transfer_bytes"]
    assert moved["h2d"] > 0 and moved["d2h"] > 0, moved


def test_delayed_checkpoint_resumes_exactly(res):  # noqa: F811
    """Saved with an update in flight (saving lands it), resumed at another stage: bit for bit."""
    r, _ = res
    got = ok(r, "delayed_checkpoint_resume")
    assert got["diff"] == 0.0
    assert got["lr"][0] == got["lr"][1]


def test_delayed_step_failure_raises_at_the_next_step(res):  # noqa: F811
    r, _ = res
    got = ok(r, "delayed_step_failure")
    assert got["raised"] == "planted failure" and got["type"] == "ValueError", got  # the optimizer's own error
    assert any("delayed optimizer step" in n for n in got["notes"]), got
    assert got["at_step"] == 4  # launched by step 3's step(), raised by step 4's


@pytest.mark.parametrize("cfg, needle", [
    ({"stage": 2, "delay_update_after": 2}, "offload_optimizer=True"),
    ({"stage": 3, "offload_optimizer": True, "offload_params": True, "delay_update_after": 2}, "offload_params=False"),
    ({"stage": 2, "offload_optimizer": True, "delay_update_after": -1}, "delay_update_after"),
    ({"stage": 2, "offload_optimizer": True, "delay_update_after": True}, "delay_update_after"),
])
def test_delay_update_after_config_errors(cfg, needle):
    import zeroshard
    with pytest.raises(ValueError, match=needle):
        zeroshard.Config(**cfg)


class _Weights(__import__("torch").nn.Module):
    """loss = sum(w * x): with x all ones every gradient is all ones, so SGD at lr 1 moves each
    weight by exactly -1 per applied update (any mis-scaled gradient shows as a non-integer)."""

    def __init__(self):
        import torch
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64))

    def forward(self, x):
        return (self.w * x).sum()


def _train_weights(cfg, make_opt, steps, after_step=None):
    import torch
    import zeroshard
    engine = zeroshard.initialize(_Weights(), make_opt, {"stage": 2, "offload_optimizer": True, **cfg})
    for _ in range(steps):
        engine.backward(engine(torch.ones(64)))
        engine.step()
        if after_step is not None:
            after_step(engine)
    return engine.full_state_dict()["w"], engine


def test_delayed_fp16_unscales_each_gradient_by_the_scale_it_was_taken_with():
    """The loss scale doubles every 2 clean steps; a landing update changes it before the next
    launch, whose gradients were computed at the old scale (found in review: they were unscaled by
    the new one, so every doubling halved an update)."""
    import torch
    sgd = lambda ps: torch.optim.SGD(ps, lr=1.0)  # noqa: E731
    cfg = {"precision": "fp16", "initial_loss_scale": 16.0, "loss_scale_window": 2}
    exact, _ = _train_weights(cfg, sgd, 6)
    delayed, engine = _train_weights({**cfg, "delay_update_after": 1}, sgd, 6)
    assert torch.equal(exact, torch.full((64,), -6.0)) and torch.equal(delayed, exact)
    assert engine.stats()["loss_scale"] > 16.0  # the scale did change under the delay


def test_delayed_update_uses_the_lr_of_its_step_also_a_tensor_lr():
    """An LR scheduler changes a tensor lr in place right after step(), while the delayed update may
    not have read it yet: the update must use the value it had at its step()."""
    import torch
    lrs = [0.5 ** k for k in range(6)]

    def schedule(engine):
        engine.scheduler.step()

    for lr0 in (1.0, torch.tensor(1.0)):
        def make(ps, lr0=lr0):
            return torch.optim.SGD(ps, lr=lr0)
        import zeroshard
        engine = zeroshard.initialize(_Weights(), make, {"stage": 2, "offload_optimizer": True,
                                                         "delay_update_after": 0})
        engine.scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda k: 0.5 ** k)
        for _ in range(6):
            engine.backward(engine(torch.ones(64)))
            engine.step()
            schedule(engine)
        got = engine.full_state_dict()["w"]
        assert torch.equal(got, torch.full((64,), -sum(lrs))), (lr0, got[0].item())


def test_a_failed_delayed_step_leaves_no_gradient_behind():
    """The update launched at step 3 fails; step 4's step() raises it. Step 4's own gradients are
    dropped with it (found in review: they were added to step 5's). Applied: steps 1 (exact), 2, 5
    and 6, each -1 at lr 1."""
    import torch
    from delayed_update_scenarios import _Failing
    import zeroshard
    engine = zeroshard.initialize(_Weights(), lambda ps: _Failing(ps, lr=1.0),
                                  {"stage": 2, "offload_optimizer": True, "delay_update_after": 1})
    raised = []
    for k in range(1, 7):
        engine.backward(engine(torch.ones(64)))
        try:
            engine.step()
        except ValueError as e:
            raised.append((k, "planted failure" in str(e)))
        engine.optimizer.param_groups[0]["fail"] = k == 2
    assert raised == [(4, True)]
    assert torch.equal(engine.full_state_dict()["w"], torch.full((64,), -4.0))
