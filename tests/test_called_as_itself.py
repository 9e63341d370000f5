"""The wrapped model called as itself (`model(x)` in a plain loop, as the README shows it) runs the
engine's forward (engine_forward.py), in a world of one: config `compile` compiles it, the chunk
layout is made final by its first training forward, a forward that raised (an Exception, or a
KeyboardInterrupt, which passes torch's always-called hooks by) leaves the engine able to go on, and
the root called inside its own forward is part of that forward (test_called_directly.py: a loop
calling the model's modules). Tolerance: fp32 SGD with momentum,
1e-5 against plain torch (contract_call_scenarios.py has the spawned half: chunks released at stage 3).
"""
from __future__ import annotations

import logging

import pytest
import torch

import zeroshard
from contract_call_scenarios import WIDTH, Stack
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
    silently. Every stage compiles the whole forward here (runtime/compiled.py's Notes: compile
    scope; one unit: stage 3 with an unlimited rCache makes the root its one unit)."""
    model, engine, ref, opt = engine_and_reference(stage, compile={"backend": "aot_eager"})
    for x in data():
        step(model, x, engine.optimizer)
        step(ref, x, opt)
    assert engine.compiled == [model], engine.compiled
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
