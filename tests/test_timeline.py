"""The memory timeline: its figures against independent counts, its effect on training (none), and
the stage-3 model states at 1/N of stage 0's over world sizes 2 and 3."""
from __future__ import annotations

import json

import pytest
import torch

import zeroshard
from zeroshard.distributed.collectives import default_device
from zeroshard.runtime.reducer import MAX_REDUCING
from zeroshard.planning.profiler import measure
from zeroshard.telemetry.timeline import plot

from distributed import WorldResults
from models import batches, make_adamw, tiny_gpt2, train

pytest.importorskip("matplotlib")  # a declared test dependency; the import is what plot() needs


def recorded(stage, world=1, rank=0, config=None, steps=2):
    """Train 3 steps, recording steps 2-3. Returns (engine, timeline)."""
    model = tiny_gpt2()
    numels = [p.numel() for p in model.parameters()]
    # Several chunks, so a 2-chunk cache and constant-size gradient buffers mean something (the
    # default chunk size packs a model this small into one).
    chunk = max(max(numels), sum(numels) // 8)
    engine = zeroshard.initialize(model, make_adamw, {"stage": stage, "cache_chunks": 2, "chunk_size": chunk,
                                                      **(config or {})})
    data = batches(3, world, 1)
    train(engine, data[:1], rank)
    timeline = engine.record_memory(steps=steps)
    train(engine, data[1:], rank)
    return engine, timeline


@pytest.mark.parametrize("stage", [0, 3])
def test_activations_match_the_profilers_measurement(stage):
    # profiler.measure counts saved-for-backward bytes with its own hooks on a plain copy of the model.
    # Both count whole storages: the input is a view of the 3-step data tensor in both runs.
    # Measured on the engine's device: attention saves other tensors on CUDA (its fused kernel keeps a
    # logsumexp, 1024 bytes here) than on the CPU (the math kernel keeps the score matrices).
    x = batches(3, 1, 1)[1, 0, 0]
    expected = measure(tiny_gpt2().to(default_device()), {"input_ids": x, "labels": x})["saved_bytes"]
    # The timeline files saved tensors that live on the host under host_activations: on CUDA the
    # fused attention saves its random seed and offset there (32 bytes here); measure counts all.
    engine, tl = recorded(stage, steps=1)
    assert max(s.activations + s.host_activations for s in tl.samples) == expected
    end_of_forward = [s for s in tl.samples if s.phase == "forward" and s.where == "end"]
    end_of_backward = [s for s in tl.samples if s.phase == "backward" and s.where == "end"]
    assert [s.activations + s.host_activations for s in end_of_forward] == [expected]
    assert [s.activations + s.host_activations for s in end_of_backward] == [0]  # autograd let go of everything
    assert tl.samples[-1].phase == "step"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_recording_stops_and_changes_nothing(stage):
    plain = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": stage, "cache_chunks": 2})
    train(plain, batches(4, 1, 1), 0)
    engine, tl = recorded(stage, steps=1)
    n = len(tl.samples)
    assert not tl.recording
    train(engine, batches(4, 1, 1)[3:], 0)
    assert len(tl.samples) == n  # nothing sampled after the requested step
    a, b = plain.full_state_dict(), engine.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert tl.samples[-1].device_states == engine.stats()["model_state_bytes"]


@pytest.mark.parametrize("stage", [0, 3])
def test_forward_without_backward_frees_its_activations(stage):
    engine, tl = recorded(stage, steps=None)
    x = batches(1, 1, 1)[0, 0, 0]
    out = engine(input_ids=x, labels=x)  # gradients on, no backward: an evaluation that forgot no_grad
    assert tl._activations[False] > 0
    del out
    assert tl._activations[False] == 0  # freed by reference counting: no cycle through saved outputs
    tl.stop()


def test_inplace_change_of_a_saved_tensor_raises():
    engine, tl = recorded(0, steps=None)

    class Tanh(torch.nn.Module):
        def forward(self, h):
            y = torch.tanh(h)  # tanh saves its output
            y.add_(1)  # ... which this changes: autograd's own check would raise
            return y
    engine.module.transformer.h[0].mlp.act = Tanh()
    x = batches(1, 1, 1)[0, 0, 0]
    loss = engine(input_ids=x, labels=x).loss
    with pytest.raises(RuntimeError, match="inplace"):
        engine.backward(loss)


def test_plot_and_json(tmp_path):
    _, a = recorded(0, steps=1)
    _, b = recorded(3, steps=1)
    plot({"stage 0": a, "stage 3": b}, tmp_path / "m.png", suptitle="test")
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    a.to_json(tmp_path / "m.json")
    rows = json.loads((tmp_path / "m.json").read_text())
    assert len(rows) == len(a.samples) and rows[0]["phase"] == "forward"


def _per_rank(rank, world, out):
    import torch.distributed as dist
    got = {}
    for name, stage, config in [("stage 0", 0, {}), ("stage 3", 3, {}),
                                ("stage 3 offload", 3, {"offload_optimizer": True, "offload_params": True,
                                                        "offload_activations": True})]:
        engine, tl = recorded(stage, world, rank, config)
        s = tl.samples
        got[name] = {
            "states": max(v.device_states + v.host_states for v in s),
            "host_states": max(v.host_states for v in s),
            "stats": engine.stats()["model_state_bytes"],
            "cache_peak": tl.peak("cache"), "cache_after_step": s[-1].cache,
            "grad_peak": tl.peak("grad_buffers"), "grad_after_step": s[-1].grad_buffers,
            "kept_peak": tl.peak("kept_buffers"), "kept_after_step": s[-1].kept_buffers,
            "activations": tl.peak("activations"), "host_activations": tl.peak("host_activations"),
            "grad_total": sum(c.padded_numel * 4 for c in engine.chunks if c.trainable),
            "chunk_max": max(c.padded_numel * 4 for c in engine.chunks),
        }
    everyone = [None] * world
    dist.all_gather_object(everyone, got)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)


_per_rank_results = WorldResults(_per_rank, "timeline", worlds=(2, 3))


@pytest.mark.parametrize("world", [2, 3])
def test_stage3_model_states_are_a_nth_of_stage0(world, tmp_path_factory):
    for rank, got in enumerate(_per_rank_results.get(world, tmp_path_factory)):
        s0, s3, off = got["stage 0"], got["stage 3"], got["stage 3 offload"]
        for g in got.values():
            assert g["states"] == g["stats"], rank
        # Chunks pad to a multiple of the world size (and 16 elements): a few percent at this size.
        assert s3["states"] / s0["states"] == pytest.approx(1 / world, rel=0.03), rank
        assert s0["cache_peak"] == 0 and s0["grad_peak"] == 0
        assert s3["cache_peak"] > 0 and s3["cache_after_step"] == 0
        assert s3["grad_peak"] > 0 and s3["grad_after_step"] == 0
        # Constant-size gradient buffers: a few chunks' worth (in flight, filling, the tied embedding's
        # chunk, whose gradient completes last), not the model's whole gradient.
        assert s3["grad_peak"] <= (MAX_REDUCING + 3) * s3["chunk_max"] < s3["grad_total"], s3
        # Freed buffers kept for the next backward (distributed/buffers.py): a constant, never
        # more than MAX_REDUCING + 1 of each chunk size (here: the chunks and the smaller last one).
        assert 0 < s3["kept_after_step"] <= s3["kept_peak"] <= 2 * (MAX_REDUCING + 1) * s3["chunk_max"], s3
        assert s0["kept_peak"] == 0, s0
        assert s3["activations"] == s0["activations"] > 0  # same model, same batch shape
        assert off["host_states"] == off["states"] == s3["states"]  # everything offloaded lives on the host
        assert off["host_activations"] > 0 and off["activations"] < s3["activations"]
