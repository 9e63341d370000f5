"""What a training loop watches (issue 17): stats()'s loss, learning rate, step time, samples and
tokens per second and grad norm (also without clipping), the step hook, config log_every, and the
zeroshard logger's messages carrying one prefix (the logger's name), not two."""
import json
import logging

import pytest
import torch

import zeroshard
from distributed import WorldResults
from models import batches, make_sgd, reference, tiny_gpt2


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 5, 1))


def _train(engine, steps, accumulation=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        window = []
        for _ in range(accumulation):
            loss = engine(torch.randint(0, 16, (3, 5), generator=g)).pow(2).mean()
            window.append(float(loss))
            engine.backward(loss)
        engine.step()
        losses.append(window)
    return losses


def test_stats_report_the_loss_learning_rates_and_rates_of_the_step():
    engine = zeroshard.initialize(_mlp(), lambda ps: torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.02}],
                                                                     lr=0.05), {"stage": 2, "gradient_accumulation_steps": 2})
    losses = _train(engine, 3, accumulation=2)
    stats = engine.stats()
    assert stats["loss"] == pytest.approx(sum(losses[-1]) / 2, rel=1e-6)
    assert stats["lr"] == 0.05 and stats["lrs"] == [0.05, 0.02]
    assert stats["step_time_s"] > 0
    assert stats["samples_per_s"] == pytest.approx(6 / stats["step_time_s"])  # 2 micro-batches of 3
    assert stats["tokens_per_s"] == pytest.approx(30 / stats["step_time_s"])  # the integer input's elements
    assert stats["grad_norm"] > 0 and stats["skipped_steps"] == 0


def test_grad_norm_is_measured_without_clipping_and_can_be_turned_off():
    x = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))
    ref = _mlp()
    ref(x).pow(2).mean().backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    on = zeroshard.initialize(_mlp(), make_sgd, {"stage": 1})
    on.backward(on(x).pow(2).mean())
    on.step()
    assert on.stats()["grad_norm"] == pytest.approx(expected, rel=1e-5)
    off = zeroshard.initialize(_mlp(), make_sgd, {"stage": 1, "grad_norm": False})
    off.backward(off(x).pow(2).mean())
    off.step()
    assert off.stats()["grad_norm"] is None


def test_a_skipped_step_reports_no_grad_norm():
    engine = zeroshard.initialize(_mlp(), make_sgd, {"stage": 2, "nonfinite": "skip"})
    x = torch.randint(0, 16, (3, 5))
    engine.backward(engine(x).pow(2).mean() * float("nan"))
    assert engine.step() is False
    assert engine.stats()["grad_norm"] is None and engine.stats()["skipped_steps"] == 1


def test_the_step_hook_sees_every_boundary_until_removed():
    engine = zeroshard.initialize(_mlp(), make_sgd, {"stage": 3, "gradient_accumulation_steps": 2})
    seen = []
    handle = engine.register_step_hook(lambda e, stats: seen.append((e is engine, stats["step"], stats["loss"])))
    losses = _train(engine, 2, accumulation=2)
    handle.remove()
    _train(engine, 1, accumulation=2)
    assert [(same, step) for same, step, _ in seen] == [(True, 1), (True, 2)]
    assert [loss for _, _, loss in seen] == pytest.approx([sum(w) / 2 for w in losses], rel=1e-6)


def test_log_every_logs_the_main_figures_with_one_prefix(caplog, tmp_path):
    engine = zeroshard.initialize(_mlp(), make_sgd, {"stage": 2, "log_every": 2})
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        _train(engine, 4)
        engine.save_checkpoint(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "zeroshard"]
    steps = [m for m in lines if m.startswith("step ")]
    assert [m.split(":")[0] for m in steps] == ["step 2", "step 4"]
    assert all(k in steps[0] for k in ("loss", "lr", "grad norm", "tokens/s", "skipped 0", "model states"))
    assert any(m.startswith("saved checkpoint") for m in lines)
    assert not any(m.startswith("zeroshard") for m in lines)  # the record's name says it once


def _grad_norms_at_world(rank, world, out):
    data = batches(3, world, 2)
    results, counts = {}, {}
    for name, cfg in (("0", {"stage": 0}), ("2", {"stage": 2}), ("3", {"stage": 3}),
                      ("0clip", {"stage": 0, "clip_grad_norm": 1e6}), ("1", {"stage": 1})):
        engine = zeroshard.initialize(tiny_gpt2(), make_sgd, cfg)
        norms, per_step = [], []
        for step in data:
            x = step[0, rank]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            stats = engine.stats()
            norms.append(stats["grad_norm"])
            per_step.append([stats["control_collectives"], stats["order_checks"]])
        results[name] = norms
        counts[name] = {"steps": per_step, "chunks": sum(c.trainable for c in engine.chunks)}
    results["counts"] = counts
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


_norms = WorldResults(_grad_norms_at_world, "metrics", worlds=(3,))


def test_grad_norm_without_clipping_is_the_global_norm_at_world_3(tmp_path_factory):
    """Uneven shards (world 3): every stage reports the norm of the global batch's gradient."""
    got = _norms.get(3, tmp_path_factory)
    ref_norms = []

    def norm_then_sgd(ps):
        opt = make_sgd(ps)
        step = opt.step

        def stepped(*a, **k):
            ref_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in ps if p.grad is not None])))
            return step(*a, **k)
        opt.step = stepped
        return opt
    reference(tiny_gpt2(), batches(3, 3, 2), norm_then_sgd)
    for stage in ("0", "2", "3", "0clip", "1"):
        assert got[stage] == pytest.approx(ref_norms, rel=1e-5), stage


def test_stage_0_steps_without_a_collective_of_its_own(tmp_path_factory):
    """World 3: a stage-0 step issues no collective (which parameters got a gradient anywhere rides
    on the gradient's all-reduce; the norm and finite check are each rank's own, the gradient being
    the same on every rank) and no comparison of its own (its STEP tag rides in the next gradient
    reduction's); with clipping, one control all-reduce (rank 0's exact norm), which needs no
    comparison of its own after STEP's. Stages 1-3: one control all-reduce per step (flags and
    norm), likewise without a comparison of its own."""
    counts = _norms.get(3, tmp_path_factory)["counts"]
    for name, control in (("0", 0), ("0clip", 1), ("1", 1), ("2", 1), ("3", 1)):
        chunks = counts[name]["chunks"]
        for collectives, checks in counts[name]["steps"][1:]:  # the first step's counts hold set-up
            assert collectives == control, (name, counts[name])
            if name == "0":  # one REDUCE comparison per chunk; STEP's tag rides on the next one
                assert checks == chunks, (name, counts[name])
            elif name == "0clip":  # ... and STEP's own, beside which the control all-reduce goes out
                assert checks == chunks + 1, (name, counts[name])
