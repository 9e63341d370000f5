"""Single-process tests of the engine in a world of one process without torchrun: training as plain
torch does, a tied head's chunk let go, a dropped engine collected, and what initialize and the
wrapped model refuse (a bad optimizer, a step inside backward, torch's clip_grad_norm_ on the
trained parameters, moving the model)."""
import pytest
import torch

import zeroshard
from zeroshard.config import Config


# -- a world of one process, no torchrun environment ---------------------------------------------------
def test_single_process_without_torchrun(monkeypatch):
    from models import batches, make_sgd, max_diff, reference, tiny_gpt2, train
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    data = batches(3, 1, 2)
    ref, _, _ = reference(tiny_gpt2(), data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(), make_sgd, Config(stage=3, cache_chunks=2))
    train(engine, data, 0)
    assert engine.stats()["world_size"] == 1 and engine.stats()["comm_elements"] == 0
    assert max_diff(engine.full_state_dict(), ref) <= 1e-6


def test_a_tied_output_head_lets_go_of_its_chunk_once_its_own_backward_is_done():
    """GPT-2's lm_head shares wte's weight: that gradient is whole only at the embedding's backward,
    the last, so a hold ended by it kept wte's chunk pinned through the whole backward (a 2-chunk
    rCache then had one slot for every other chunk, and could prefetch none). The hold ends where
    the gradient reaches lm_head's input, and training matches plain torch."""
    from models import batches, make_sgd, max_diff, reference, tiny_gpt2, train
    data = batches(2, 1, 2)
    ref, _, _ = reference(tiny_gpt2(n_layer=4), data, make_sgd)
    engine = zeroshard.initialize(tiny_gpt2(n_layer=4), make_sgd, Config(stage=3, cache_chunks=2, chunk_size=20000))
    pinned_at_backward_uses = []
    acquire = engine.cache.acquire

    def recording(chunk, recorded=True):
        if engine.hooks.in_backward:  # the layout is packed anew after the first step: look each time
            tied = next(c.index for c in engine.layout.chunks if "transformer.wte.weight" in [s.name for s in c.slots])
            pinned_at_backward_uses.append(tied in engine.cache.pins)
        acquire(chunk, recorded)
    engine.cache.acquire = recording
    train(engine, data, 0)
    assert len(engine.layout.chunks) > 2 and pinned_at_backward_uses
    assert not any(pinned_at_backward_uses[1:-1])  # after lm_head's, before the embedding's own
    assert max_diff(engine.full_state_dict(), ref) <= 1e-6


def test_bad_optimizer_argument():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="callable"):
        zeroshard.initialize(model, optimizer="adamw")
    with pytest.raises(ValueError, match="not a parameter of the model"):  # built over another model
        zeroshard.initialize(model, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="not a parameter of the model"):  # a factory that builds its own
        zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=lambda ps: torch.optim.SGD([torch.nn.Parameter(
            torch.ones(2))], lr=0.1))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already has state"):
        zeroshard.initialize(model, optimizer=stepped)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=lambda ps: ps)
    engine = zeroshard.initialize(torch.nn.Linear(2, 2), optimizer=torch.optim.SGD)  # a class works
    assert isinstance(engine.optimizer, torch.optim.SGD)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_dropped_engine_is_collected(stage):
    """Its chunks, masters and optimizer states come back: nothing outside it keeps it alive (the
    gradient hooks autograd holds in C++ reach it only weakly)."""
    import gc
    import weakref

    from models import batches, make_adamw, tiny_gpt2, train
    engine = zeroshard.initialize(tiny_gpt2(), make_adamw, {"stage": stage})
    engine.record_memory(1)
    train(engine, batches(2, 1, 1), 0)
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, pair, extra):
        return (self.lin(pair.x) * pair.scale).sum() + self.lin(extra["k"][0]).sum() * extra["k"][1]


@pytest.mark.parametrize("stage", [0, 3])
def test_namedtuple_and_dict_of_tuples_inputs(stage):
    """Inputs go to the device through torch's pytree: a namedtuple (it has no one-argument
    constructor) and a dict of tuples keep their types; non-tensors pass through."""
    import collections
    Pair = collections.namedtuple("Pair", "x scale")
    torch.manual_seed(0)
    ref = _TwoInputs()
    torch.manual_seed(0)
    engine = zeroshard.initialize(_TwoInputs(), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    loss = engine(Pair(x, 2.0), {"k": (y, 3)})
    assert torch.allclose(loss, ref(Pair(x, 2.0), {"k": (y, 3)}), atol=1e-6)
    engine.backward(loss)
    assert engine.step()


def test_step_inside_backward_raises():
    """A step called from inside backward (a gradient hook) is out of order: a named error, not a
    corrupted step."""
    engine = zeroshard.initialize(torch.nn.Linear(4, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": 2})
    out = engine(torch.randn(2, 4)).sum()
    out.register_hook(lambda g: engine.step())
    with pytest.raises(RuntimeError, match="step\\(\\) called while the engine is in backward"):
        engine.backward(out)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("clip", [lambda ps: torch.nn.utils.clip_grads_with_norm_(ps, 1.0, torch.tensor(2.0)),
                                  lambda ps: torch.nn.utils.clip_grad_value_(ps, 0.1)],
                         ids=["clip_grads_with_norm_", "clip_grad_value_"])
def test_torch_gradient_clipping_on_trained_parameters_raises(stage, clip, request):
    """Issue 14, defect 9: torch's clipping functions between backward and step found no .grad
    (gradients live in the chunks) and silently clipped nothing at stages 0-2
    (ShardedParameterError at stage 3). clip_grads_with_norm_ and clip_grad_value_ raise
    GradientsInChunksError, naming the config key (clip_grad_norm_ is the engine's: below); on
    other parameters they are torch's own."""
    name = request.node.callspec.id.split("-")[0]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
    engine.backward(engine(torch.ones(2, 4)).sum())
    with pytest.raises(zeroshard.GradientsInChunksError, match=f"torch.nn.utils.{name} was given .*clip_grad_norm"):
        clip(model.parameters())
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    before = other.weight.grad.clone()
    clip(list(other.parameters()))
    assert not torch.equal(other.weight.grad, before)  # torch's own clipping ran
    assert engine.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_torch_clip_grad_norm_is_the_engines_or_raises(stage):
    """torch.nn.utils.clip_grad_norm_ in a plain loop is the engine's (the trained parameters
    across worlds and stages: test_contract.py's plain loop). Here, as torch: no gradient yet gives
    0 and clips nothing; a second call returns the norm the first left, and the step clips to both;
    error_if_nonfinite raises RuntimeError. Where the engine cannot answer it as torch would, a named error:
    a part of the parameters, another norm than L2, tensors it does not train that hold a gradient,
    a backward after the call (before the step), a delayed update, and inside the config's
    accumulation window; torch's own clip_grad_norm_, bound to a name before initialize, which
    would clip nothing."""
    def make(cfg=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage, **(cfg or {})})
        return model, engine
    from models import max_diff
    clip = torch.nn.utils.clip_grad_norm_
    x = torch.ones(2, 4)
    model, engine = make()
    assert float(clip(model.parameters(), 1.0)) == 0.0
    engine.backward(engine(x).sum())
    other = torch.nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    for given, norm_type, why in [(model[0].parameters(), 2.0, "not every parameter it trains"),
                                  (model.parameters(), float("inf"), "norm_type=inf"),
                                  ([*model.parameters(), *other.parameters()], 2.0, "tensors with a gradient")]:
        with pytest.raises(zeroshard.GradientsInChunksError, match=why):
            clip(given, 1.0, norm_type)
    torch_own = clip.__wrapped__  # what `from torch.nn.utils import clip_grad_norm_` bound before initialize
    with pytest.raises(zeroshard.GradientsInChunksError, match="bound before zeroshard.initialize"):
        torch_own(model.parameters(), 1.0)
    clip(model.parameters(), 1.0)
    with pytest.raises(zeroshard.GradientsInChunksError, match="a backward after torch.nn.utils.clip_grad_norm_"):
        engine.backward(engine(x).sum())
    with pytest.raises(zeroshard.GradientsInChunksError, match="a backward after torch.nn.utils.clip_grad_norm_"):
        model(x).sum().backward()  # raised in autograd's hook: the gradient it got must not stay in .grad
    engine.zero_grad()
    engine.backward(engine(x).sum())
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    ref(x).sum().backward()
    first, second = clip(model.parameters(), 1.0), clip(model.parameters(), 0.5)
    assert first.shape == () and abs(float(first) - float(clip(ref.parameters(), 1.0))) < 1e-5
    assert abs(float(second) - float(clip(ref.parameters(), 0.5))) < 1e-5 and float(second) < 1.0
    assert engine.step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) < 1e-6  # clipped to 0.5, as torch
    engine.backward(engine(x * float("inf")).sum())
    with pytest.raises(RuntimeError, match="not finite"):
        clip(model.parameters(), 1.0, error_if_nonfinite=True)
    engine.zero_grad()
    for cfg, why in [({"delay_update_after": 1, "offload_optimizer": True, "stage": 1}, "delay_update_after"),
                     ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps window")]:
        model, engine = make(cfg)
        engine.backward(engine(x).sum())
        with pytest.raises(zeroshard.GradientsInChunksError, match=why):
            clip(model.parameters(), 1.0)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_moving_the_wrapped_model_raises_and_changes_nothing(stage):
    """Issue 14, defect 9: model.to(...) after initialize pointed parameters at new tensors at stages
    0-2, detached from the chunks the optimizer steps (here: torch's dtype mismatch at the next
    forward; a move the inputs still matched would have trained nothing). A move or cast raises
    (ModuleMovedError; ShardedParameterError at stage 3) and leaves the parameters on their chunks;
    a move to where they already are passes. Training then matches an engine never moved."""
    from models import max_diff
    data = torch.randn(3, 2, 4)
    results = []
    for move in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        engine = zeroshard.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), {"stage": stage})
        for x in data:
            if move:
                model.to(torch.float32)  # already there: nothing happens
                model.float()
                with pytest.raises((zeroshard.ModuleMovedError, zeroshard.ShardedParameterError)):
                    model.to(torch.float64)
            engine.backward(engine(x).pow(2).mean())
            assert engine.step()
        results.append(engine.full_state_dict())
    assert max_diff(results[0], results[1]) == 0.0
