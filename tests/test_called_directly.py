"""A loop calling the wrapped model's modules directly rather than the model (`h = model.backbone(x);
out = model.head(h)`) runs the engine's forward as the model called as itself does
(engine_forward.py's Notes: a module called directly, forwards of one pass, training in eval mode),
in a world of one: unfreezing followed, config compile applied between passes, a module that raised
closed, stage 3's schedule followed by every forward of a pass and left alone by forwards outside
it. Tolerance: fp32 SGD with momentum, 1e-5 against plain torch (contract_call_scenarios.py has the
spawned half: chunks released at stage 3).
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

from contract_call_scenarios import LAYERS, WIDTH, Stack, through_layers
from models import max_diff
from test_called_as_itself import data, engine_and_reference, step


def through_modules(model, x):
    """A loop calling the model's modules directly: its layers, but the last one's parameters read
    by a functional call (as a fused loss reads `model.lm_head.weight` after `model.model(ids)`)."""
    for layer in model.layers[:-1]:
        x = torch.tanh(layer(x))
    last = model.layers[-1]
    return torch.tanh(torch.nn.functional.linear(x, last.weight, last.bias))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_layer_unfrozen_trains_where_the_loop_calls_the_modules_directly(stage):
    """A layer frozen at initialize and unfrozen after the first step trains from then on, as in
    torch, where the loop calls the model's modules rather than the model. Before, only the model's
    own forward followed unfreezing: the layer never trained (1.2e-2 off torch after 4 steps, every
    stage). The layout is made final by the first such forward, as by the model's."""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=2)
    for m in (model, ref):
        m.layers[1].requires_grad_(False)
    for i, x in enumerate(data(4)):
        if i == 1:
            for m in (model, ref):
                m.layers[1].requires_grad_(True)
        step(lambda x: through_modules(model, x), x, engine.optimizer)
        step(ref, x, opt)
        assert engine.layout.final
    assert not (stage == 3 and engine.cache.recording)
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_an_evaluation_of_a_module_called_directly_leaves_training_as_torchs(stage):
    """A module called directly under no_grad between steps (an evaluation of the backbone) gives
    torch's output, and training through the model goes on as torch's."""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1)
    for x in data():
        with torch.no_grad():
            assert torch.allclose(model.layers[0](x), ref.layers[0](x), atol=1e-6, rtol=0)
        step(model, x, engine.optimizer)
        step(ref, x, opt)
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_called_directly_that_raised_leaves_the_engine_able_to_go_on(stage, caplog):
    """A layer called directly raises (an input of the wrong width): its forward closes, and training
    goes on as torch's. (A first version left it open, its saved-tensor hooks pushed, until the next
    entry point: with its engine dropped, for good.)"""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1)
    xs = data(3)
    with pytest.raises(RuntimeError):
        through_layers(model, xs[0][:, :3])
    assert engine._open is None and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        engine.optimizer.zero_grad()
        for x in xs:
            step(lambda x: through_layers(model, x), x, engine.optimizer)
            step(ref, x, opt)
    assert "interrupted" not in caplog.text
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class HeadFirst(torch.nn.Module):
    """Its head is declared before the layers it follows: the first training forward re-packs the
    chunks in order of use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(2))

    def forward(self, x):
        return self.head(through_layers(self, x))


@pytest.mark.parametrize("how", ["model", "modules", "model_twice"])
def test_a_pass_of_several_forwards_follows_the_schedule(how):
    """Stage 3, a layer a chunk, a 1-chunk rCache: a pass of several forwards (the head called after
    the layers, each directly; the model called twice for one loss) follows the schedule recorded
    over such a pass, departing from it nowhere. Before, each forward replayed it from its start and
    the first pass's re-pack left it recorded over two layouts: 5 departures a step through the
    modules, 2 through the model twice."""
    model, engine, ref, opt = engine_and_reference(3, make=HeadFirst, cache_chunks=1)
    calls = {"model": lambda m: m, "modules": lambda m: lambda x: m.head(through_layers(m, x)),
             "model_twice": lambda m: lambda x: m(x) + m(x)}[how]
    for x in data(4):
        step(calls(model), x, engine.optimizer)
        step(calls(ref), x, opt)
    assert not engine.cache.recording and engine.stats()["schedule_departures"] == 0, engine.stats()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_a_model_trained_in_eval_mode_makes_its_layout_final_and_compiles(stage):
    """model.eval() (dropout off, BatchNorm's statistics kept) and training as ever: the first forward
    makes the layout final, stage 3 records the schedule over the next step, config compile compiles
    (stage 3 the blocks, stage 0 the whole forward), and the samples count. Before, only a forward in
    train mode did any of it."""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1, compile={"backend": "aot_eager"})
    model.eval()
    ref.eval()
    for x in data():
        step(model, x, engine.optimizer)
        step(ref, x, opt)
        assert engine.layout.final
    assert not (stage == 3 and engine.cache.recording)
    assert engine.compiled == ([model] if stage < 3 else list(model.layers)), engine.compiled
    assert engine.stats()["samples_per_s"] is not None, engine.stats()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class CheckpointedBackbone(torch.nn.Module):
    """A backbone whose layers each run under a non-reentrant checkpoint, and a head: the loop calls
    the two directly."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = Stack()
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.features(x))

    def features(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.backbone.layers:
            x = torch.tanh(checkpoint(layer, x, use_reentrant=False))
        return x


def backbone_then_head(model, x):
    model.backbone.forward = functools.partial(CheckpointedBackbone.features, model)
    return model.head(model.backbone(x))


@pytest.mark.parametrize("how", ["layers", "checkpointed_backbone_then_head"])
@pytest.mark.parametrize("stage", [0, 3])
def test_config_compile_compiles_the_modules_called_directly(stage, how):
    """Config compile compiles the layer blocks once the first forward of a module called directly
    made the layout final (before: nothing compiled, silently), and between passes, not inside one:
    with checkpointed layers and the backbone and head called directly, the backward recomputes the
    blocks as its forward ran them. The first version of this bracket compiled them as the head's
    forward opened, after the backbone's had run them eager: the first backward raised
    CheckpointError (recomputed values of other metadata)."""
    make, call = {"layers": (Stack, through_layers),
                  "checkpointed_backbone_then_head": (CheckpointedBackbone, backbone_then_head)}[how]
    model, engine, ref, opt = engine_and_reference(stage, make=make, compile={"backend": "aot_eager"})
    for x in data():
        step(lambda x: call(model, x), x, engine.optimizer)
        step(ref, x, opt)
    assert engine.compiled is not None and len(engine.compiled) == LAYERS, engine.compiled
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_that_raised_between_forward_and_backward_leaves_both_working(stage):
    """A forward of the model, then a module called directly that raises (caught), then the backward
    of the first forward's loss: it trains as torch, and full_parameters() opens. The first version
    left the module's forward open (its forward hook is not always called), so the backward raised
    EngineCallError, as did full_parameters() (and at stage 3 a unit left pinned)."""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1)
    for x in data():
        loss = model(x).pow(2).mean()
        with pytest.raises(RuntimeError):
            model.layers[0](x[:, :3])
        loss.backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        step(ref, x, opt)
        with pytest.raises(RuntimeError):
            model.layers[0](x[:, :3])
        with engine.full_parameters():
            pass
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("how", ["model", "modules"])
@pytest.mark.parametrize("look", ["eval_without_no_grad", "no_grad_half_way"])
def test_forwards_outside_a_training_pass_leave_its_schedule(how, look):
    """Stage 3, a layer a chunk, a 1-chunk rCache: an evaluation that forgot no_grad (eval mode, its
    graph dropped unused) after each step, or a look at the head under no_grad between the layers'
    forwards and the head's, leaves the training passes on their schedule: no departure, and the
    model trains as torch."""
    model, engine, ref, opt = engine_and_reference(3, make=HeadFirst, cache_chunks=1)
    call = (lambda m: m) if how == "model" else (lambda m: lambda x: m.head(through_layers(m, x)))
    for x in data(4):
        if look == "no_grad_half_way":
            h = through_layers(model, x)
            with torch.no_grad():
                model.head(x)
            model.head(h).pow(2).mean().backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        else:
            step(call(model), x, engine.optimizer)
            model.eval()
            call(model)(x)  # a graph recorded, never differentiated
            model.train()
        step(ref, x, opt)
    assert engine.stats()["schedule_departures"] == 0 and not engine.cache.off_schedule, engine.stats()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, feats):
        feats.append(x)
        return torch.tanh(self.lin(x))


class Collecting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head = Encoder(), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.enc(x, []))


def test_a_module_called_directly_gets_its_inputs_as_given():
    """A list the caller hands a module called directly is the one its forward appends to (the
    first version rebuilt its inputs, as the root's are moved and cast), and a pass's samples count
    once (the first version counted the encoder's and then the model's)."""
    model, engine, ref, opt = engine_and_reference(3, make=Collecting)
    for x in data():
        feats = []
        model(model.enc(x, feats)).pow(2).mean().backward()
        assert len(feats) == 1 and engine.meter.samples == 4, (feats, engine.meter.samples)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        ref(ref.enc(x, [])).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5
