"""The wrapped model called as itself (`model(x)` in a plain loop, as the README shows it) runs the
engine's forward (engine_forward.py), in a world of one: config `compile` compiles it, the chunk
layout is made final by its first training forward, a forward that raised (an Exception, or a
KeyboardInterrupt, which passes torch's always-called hooks by) leaves the engine able to go on, and
the root called inside its own forward is part of that forward; a loop calling the model's modules
directly gets the same forward. Tolerance: fp32 SGD with momentum,
1e-5 against plain torch (contract_call_scenarios.py has the spawned half: chunks released at stage 3).
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch

import zeroshard
from contract_call_scenarios import LAYERS, WIDTH, Stack, through_layers
from models import max_diff


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def engine_and_reference(stage, make=Stack, **config):
    model = make()
    engine = zeroshard.initialize(model, sgd, {"stage": stage, "chunk_size": WIDTH * WIDTH + WIDTH, **config})
    ref = make()
    return model, engine, ref, sgd(ref.parameters())


def step(call, x, opt):
    call(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def data(steps=3):
    return torch.randn(steps, 4, WIDTH, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_config_compile_compiles_the_model_called_as_itself(stage):
    """Before, config compile compiled nothing unless the engine was called: `model(x)` ran eager,
    silently. Stage 3 compiles each layer block (a leaf), stages 0-2 the blocks too."""
    model, engine, ref, opt = engine_and_reference(stage, compile={"backend": "aot_eager"})
    for x in data():
        step(model, x, engine.optimizer)
        step(ref, x, opt)
    assert engine.compiled is not None and len(engine.compiled) == LAYERS, engine.compiled
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_first_forward_of_the_model_called_as_itself_makes_the_layout_final(stage):
    """The first training forward re-packs the chunks in order of first use and makes the layout
    final, as engine(x) does (before: it stayed recording, and at stage 3 the rCache kept recording
    the schedule, prefetching nothing); stage 3 records the schedule over the next step."""
    model, engine, ref, opt = engine_and_reference(stage)
    for x in data():
        step(model, x, engine.optimizer)
        step(ref, x, opt)
        assert engine.layout.final
    assert not (stage == 3 and engine.cache.recording)  # recorded over the first step after the re-pack
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class Raises(Stack):
    """Raises `error` in its forward, after three of its layers, when one is set."""
    error = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 3 and self.error is not None:
                raise self.error
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("error", [RuntimeError("a forward that raised"), KeyboardInterrupt()],
                         ids=["exception", "keyboard_interrupt"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_of_the_model_that_raised_leaves_the_engine_able_to_go_on(stage, error, caplog):
    """A forward that raised half-way: the next call trains as torch does (nothing of the failed
    forward counts). torch runs the always-called hook for an Exception; a KeyboardInterrupt is
    found at the next call or entry point (here zero_grad), with a warning."""
    model, engine, ref, opt = engine_and_reference(stage, make=Raises, cache_chunks=1)
    xs = data(4)
    step(model, xs[0], engine.optimizer)
    step(ref, xs[0], opt)
    model.error = error
    with pytest.raises(type(error)):
        model(xs[1])
    model.error = None
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        engine.optimizer.zero_grad()  # an entry point between forwards (it raised after a KeyboardInterrupt)
        for x in xs[2:]:
            step(model, x, engine.optimizer)
            step(ref, x, opt)
    interrupted = "interrupted" in caplog.text
    assert interrupted == isinstance(error, KeyboardInterrupt), caplog.text
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class CallsItself(Stack):
    """A forward that calls the model itself for each half of the batch (a LightningModule's
    training_step calling self(x) runs so inside the engine's forward)."""

    def forward(self, x, half=False):
        if not half:
            return torch.cat([self(x[:2], half=True), self(x[2:], half=True)])
        return super().forward(x)


@pytest.mark.parametrize("how", ["engine", "model", "model_in_except"])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_model_called_inside_its_own_forward_is_part_of_that_forward(stage, how):
    """The inner calls open no forward of their own; `model_in_except`: the model called inside an
    `except` block (an exception being handled is not one its forward raised)."""
    model, engine, ref, opt = engine_and_reference(stage, make=CallsItself, cache_chunks=1)
    call = engine if how == "engine" else model
    for x in data():
        if how == "model_in_except":
            try:
                raise ValueError("handled by the loop")
            except ValueError:
                step(call, x, engine.optimizer)
        else:
            step(call, x, engine.optimizer)
        step(ref, x, opt)
        assert engine.layout.final
    assert not (stage == 3 and engine.cache.recording)  # recorded over the first step after the re-pack
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("how", ["engine", "model"])
def test_a_checkpoint_around_the_whole_model_recomputes_it(how, reentrant):
    """torch.utils.checkpoint around the wrapped model at stage 3: its forward runs again in
    backward (the checkpoint keeps its inputs, not what the forward saves), and the model trains as
    torch's. The first version of the forward bracket pushed the engine's saved-tensor hooks inside
    the checkpoint's, which then kept nothing to recompute: the activations were held, silently."""
    from torch.utils.checkpoint import checkpoint
    model, engine, ref, opt = engine_and_reference(3)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    call = engine if how == "engine" else model
    for x in data():
        x = x.clone().requires_grad_(reentrant)  # a reentrant checkpoint needs an input that requires grad
        checkpoint(call, x, use_reentrant=reentrant).pow(2).mean().backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        step(ref, x, opt)
    assert len(calls) == 2 * len(data()), calls
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_saved_tensor_hooks_around_the_model_get_what_its_forward_saves(stage):
    """A caller's saved-tensor hooks around model(x) (save_on_cpu, a user's own) get every tensor the
    forward saves, as in torch (the first version of the bracket gave them 1 of 18 at stage 3)."""
    model, engine, ref, opt = engine_and_reference(stage)
    counted = {"model": 0, "torch": 0}

    def counting(name):
        def pack(t):
            counted[name] += 1
            return t
        return pack
    for x in data():
        for name, call, o in (("model", model, engine.optimizer), ("torch", ref, opt)):
            with torch.autograd.graph.saved_tensors_hooks(counting(name), lambda t: t):
                loss = call(x).pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
    assert counted["model"] == counted["torch"] > 0, counted
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_an_evaluation_inside_full_parameters_runs_on_the_whole_values(stage):
    """model(x) under torch.no_grad() inside `with engine.full_parameters():` gives plain torch's
    output, and training goes on as torch's. At stage 3 it raised a RuntimeError at the exit (the
    units' hooks had left the parameters empty where the context had put their whole values); a
    forward recording gradients there raises EngineCallError (the parameters it saves lose their
    values at the exit), and the engine goes on."""
    from zeroshard.errors import EngineCallError
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1)
    xs = data(3)
    step(model, xs[0], engine.optimizer)
    step(ref, xs[0], opt)
    with engine.full_parameters():
        with torch.no_grad():
            out = model(xs[1])
    assert torch.equal(out, ref(xs[1]).detach())
    if stage == 3:
        with pytest.raises(EngineCallError, match="no_grad"):
            with engine.full_parameters():
                model(xs[1])
    for x in xs[1:]:
        step(model, x, engine.optimizer)
        step(ref, x, opt)
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


class Whole(torch.nn.Module):
    """No layer blocks: config compile compiles its forward whole."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("how", ["engine", "model"])
def test_a_model_compiled_whole_runs_its_graph_once_compiled(how):
    """The root compiled whole is compiled as a forward starts once the layout is final: engine(x)
    before the root's call, so its second step runs the graph (the first version of the forward
    bracket compiled in the root's pre-hook, too late for the call under way: a 2-step run, as
    tests/test_architectures.py's ResNet at worlds 2-3, ran no graph); the model called as itself
    compiles in that pre-hook, so from its third call. Not as the first forward ends: its backward
    may recompute checkpointed blocks, which must run as they ran (test_compile)."""
    import torch._dynamo
    model, engine, ref, opt = engine_and_reference(2, make=Whole, compile={"backend": "aot_eager"})
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    call = engine if how == "engine" else model
    for x in data(2 if how == "engine" else 3):
        step(call, x, engine.optimizer)
        step(ref, x, opt)
    assert engine.compiled == [model] and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


def test_a_resumed_model_compiled_whole_runs_its_graph_from_the_first_step(tmp_path):
    """A checkpoint fixes the layout before any forward: engine(x) compiles a root compiled whole
    before its call, so the first step already runs the graph, as before the forward bracket."""
    import torch._dynamo
    model, engine, ref, opt = engine_and_reference(2, make=Whole)
    xs = data(2)
    step(engine, xs[0], engine.optimizer)
    step(ref, xs[0], opt)
    engine.save_checkpoint(str(tmp_path))
    resumed = zeroshard.initialize(Whole(), sgd, {"stage": 2, "chunk_size": WIDTH * WIDTH + WIDTH,
                                                  "compile": {"backend": "aot_eager"}})
    resumed.load_checkpoint(str(tmp_path))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step(resumed, xs[1], resumed.optimizer)
    step(ref, xs[1], opt)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert max_diff(resumed.full_state_dict(), ref.state_dict()) <= 1e-5


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
    the blocks, and the samples count. Before, only a forward in train mode did any of it."""
    model, engine, ref, opt = engine_and_reference(stage, cache_chunks=1, compile={"backend": "aot_eager"})
    model.eval()
    ref.eval()
    for x in data():
        step(model, x, engine.optimizer)
        step(ref, x, opt)
        assert engine.layout.final
    assert not (stage == 3 and engine.cache.recording)
    assert engine.compiled is not None and len(engine.compiled) == LAYERS, engine.compiled
    assert engine.stats()["samples_per_s"] is not None, engine.stats()
    assert max_diff(engine.full_state_dict(), ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_evaluation_inside_full_parameters_under_bf16_runs_on_the_fp32_values(stage):
    """bf16 compute: `model(x)` and `engine(x)` under torch.no_grad() inside full_parameters() give a
    plain fp32 model's output over the masters, exactly. Before, at stages 0-2 the model's forward
    raised ModuleMovedError (the parameters held the whole values, not their chunks), at stage 3
    torch's dtype mismatch (16-bit inputs met the fp32 values), and engine(x) EngineCallError."""
    model, engine, ref, opt = engine_and_reference(stage, precision="bf16")
    xs = data(2)
    step(model, xs[0], engine.optimizer)
    plain = Stack()
    plain.load_state_dict(engine.full_state_dict())
    with engine.full_parameters(), torch.no_grad():
        outs = [model(xs[1]), engine(xs[1])]
    expected = plain(xs[1]).detach()
    assert all(torch.equal(out, expected) for out in outs)
    step(model, xs[1], engine.optimizer)  # training goes on


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
