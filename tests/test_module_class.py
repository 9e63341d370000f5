"""The wrapped module's class (issue 31): zeroshard.initialize swaps each affected module's class for a
subclass made once per class (as torch's fully_shard does) that overrides zero_grad, generate and
_apply, instead of patching methods onto the instance. World 1, in this process."""
from __future__ import annotations

import copy
import functools
import gc
import pickle
import weakref

import pytest
import torch

import zeroshard
from zeroshard import ModuleCopyError
from zeroshard.runtime.module_state import sync_generation


class Net(torch.nn.Module):
    """A user's module with a class of its own."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.act(self.inp(x)))


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def wrap(model, stage):
    return zeroshard.initialize(model, sgd, {"stage": stage})


def tiny_gpt2():
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def snapshot(engine):
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def assert_same_values(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train_once(engine, x):
    engine.backward(engine(x).float().pow(2).mean())
    return engine.step()


def assert_keeps_class(module, cls):
    t = type(module)
    assert t is not cls and t.__bases__ == (cls,), t.__mro__
    assert isinstance(module, cls) and issubclass(t, cls)
    assert (t.__name__, t.__qualname__, t.__module__) == (cls.__name__, cls.__qualname__, cls.__module__)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_class_is_a_subclass_with_the_users_names(stage):
    model = Net()
    wrap(model, stage)
    assert_keeps_class(model, Net)
    assert_keeps_class(model.inp, torch.nn.Linear)
    assert type(model.inp) is type(model.out)  # one subclass per class, shared by its instances
    assert type(model.act) is torch.nn.ReLU  # no parameters and not the root: left alone
    assert repr(model).startswith("Net(") and "(inp): Linear(" in repr(model)
    assert type(Net()) is Net  # the user's class itself is unchanged


@pytest.mark.parametrize("stage", [2, 3])
def test_model_zero_grad_drops_the_engines_gradients(stage):
    model = Net()
    engine = wrap(model, stage)
    x = torch.randn(3, 4)
    before = snapshot(engine)
    engine.backward(engine(x).pow(2).mean())
    model.zero_grad()
    assert engine.step() is False  # nothing left to apply
    assert_same_values(before, snapshot(engine))
    assert train_once(engine, x) is True  # without model.zero_grad() the same step applies
    after = snapshot(engine)
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_move_or_cast_raises_and_puts_the_parameters_back(stage):
    model = Net()
    engine = wrap(model, stage)
    x = torch.randn(3, 4)
    train_once(engine, x)
    # stage 3: the module holds placeholders, which refuse the cast's result as their .data
    # (placeholder.py), before the class's _apply check runs
    for move in (lambda: model.to(torch.float64), lambda: model.half(), lambda: model.inp.double()):
        with pytest.raises(zeroshard.ModuleMovedError, match=r"was moved.*cast.* after zeroshard.initialize"):
            move()
        before = snapshot(engine)
        assert all(v.dtype == torch.float32 for v in before.values())
        assert train_once(engine, x) is True  # the parameters are the ones the engine trains
        after = snapshot(engine)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert torch.equal(engine(x), model(x))  # the module's forward reads what trained
    model.to(torch.float32)  # to where the parameters are: nothing moves, nothing raises


def test_two_engines_in_turn_do_not_stack_subclasses():
    model = Net()
    first = wrap(model, 2)
    cls, inp_cls = type(model), type(model.inp)
    x = torch.randn(3, 4)
    assert train_once(first, x) is True
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # the module's class and state keep no engine alive

    second = wrap(model, 2)
    assert type(model) is cls and type(model.inp) is inp_cls
    assert_keeps_class(model, Net)
    before = snapshot(second)
    second.backward(second(x).pow(2).mean())
    model.zero_grad()  # reaches the second engine
    assert second.step() is False
    assert_same_values(before, snapshot(second))
    with pytest.raises(zeroshard.ModuleMovedError):  # checked against the second engine's chunks
        model.double()
    assert train_once(second, x) is True
    del second  # one engine at a time over a module
    gc.collect()

    third = wrap(model, 3)
    assert type(model) is cls and type(model.inp) is inp_cls
    before = snapshot(third)
    third.backward(third(x).pow(2).mean())
    model.zero_grad()
    assert third.step() is False
    assert_same_values(before, snapshot(third))
    assert train_once(third, x) is True


@pytest.mark.parametrize("stage", [2, 3])
def test_pickling_or_copying_a_wrapped_module_raises_a_zeroshard_error(stage, tmp_path):
    model = Net()
    engine = wrap(model, stage)
    for target in (model, model.inp):
        for name, do in (("pickled", lambda: pickle.dumps(target)), ("deep-copied", lambda: copy.deepcopy(target)),
                         ("copied", lambda: copy.copy(target)),
                         ("pickled", lambda: torch.save(target, tmp_path / "m.pt"))):
            with pytest.raises(ModuleCopyError, match=f"cannot be {name}.*full_state_dict") as info:
                do()
            assert isinstance(info.value, zeroshard.ZeroShardError) and isinstance(info.value, TypeError)
    assert train_once(engine, torch.randn(3, 4)) is True  # nothing was left half done
    # what the message points to works, and modules zeroshard never wrapped still pickle and copy
    fresh = Net()
    fresh.load_state_dict(engine.full_state_dict())
    again = pickle.loads(pickle.dumps(fresh))
    assert type(again) is Net and type(copy.deepcopy(fresh)) is Net
    x = torch.randn(2, 4)
    torch.testing.assert_close(again(x), model(x))


def test_gpt2_keeps_its_class_and_trains():
    from transformers import GPT2LMHeadModel
    model = tiny_gpt2()
    engine = wrap(model, 2)
    assert_keeps_class(model, GPT2LMHeadModel)
    assert type(model).can_generate() and model.can_generate()
    assert model.config_class is GPT2LMHeadModel.config_class
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    before = snapshot(engine)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    model.zero_grad()
    assert engine.step() is False
    assert_same_values(before, snapshot(engine))
    with pytest.raises(zeroshard.ModuleMovedError):
        model.to(torch.float64)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    assert engine.step() is True
    with pytest.raises(ModuleCopyError):
        copy.deepcopy(model)


def test_gpt2_stage3_generate_passes_synced_gpus(monkeypatch):
    from transformers import GPT2LMHeadModel
    seen = []
    original = GPT2LMHeadModel.generate

    @functools.wraps(original)
    def spy(self, *args, **kwargs):  # records what reached the user's class, then generates on this rank
        seen.append(kwargs.get("synced_gpus"))
        kwargs.pop("synced_gpus", None)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(GPT2LMHeadModel, "generate", spy)

    model = tiny_gpt2()
    ids = torch.tensor([[1, 2, 3, 4]])

    def generate(**kwargs):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, **kwargs)
        assert out.shape == (1, 7) and torch.equal(out[:, :4], ids)
        return seen.pop()

    engine = wrap(model, 2)  # first a stage-2 engine, then a stage-3 one over the same model
    model.eval()
    assert generate() is None
    del engine
    gc.collect()
    engine = wrap(model, 3)
    model.eval()
    # world 1 does not need it: initialize leaves generate as it is
    assert generate() is None
    # what initialize does at stage 3 over several ranks (assembly.install_hooks)
    assert sync_generation(model) == [""]
    assert generate() is True
    assert generate(synced_gpus=False) is False  # the caller's choice stands
    assert generate(synced_gpus=True) is True
    assert_keeps_class(model, GPT2LMHeadModel)  # one subclass, whatever the engines before
    # what a later engine whose forward is no collective does (assembly passes on=False)
    assert sync_generation(model, on=False) == [""]
    assert generate() is None
    assert not seen and engine.stage == 3


class Reparametrized(torch.nn.Module):
    """A forward that parametrizes its child's weight for the call and removes it after, as peft's
    LoRA of a parameter (around a fused MoE's router and experts) does at every forward: torch's
    parametrize moves the parameter into a ParametrizationList (after setting it to itself) and
    swaps the child's class, and back."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base = torch.nn.Linear(4, 4)
        self.delta = torch.nn.Parameter(torch.full((4, 4), 0.1))
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x):
        class Plus(torch.nn.Module):
            def forward(_, w):
                return w + self.delta
        torch.nn.utils.parametrize.register_parametrization(self.base, "weight", Plus())
        try:
            with torch.nn.utils.parametrize.cached():
                h = self.base(x)
        finally:
            torch.nn.utils.parametrize.remove_parametrizations(self.base, "weight", leave_parametrized=False)
        return self.head(h)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_parametrized_inside_a_forward_trains_as_in_torch(stage):
    """Stage 3 raised ShardedParameterError: the placeholder's set_ to itself reached its dispatch
    guard (set_ skips __torch_function__), and, not being a Parameter, it came back a buffer."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    ref = Reparametrized()
    opt = sgd(ref.parameters())
    for _ in range(2):
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    engine = wrap(Reparametrized(), stage)
    for _ in range(2):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    got = engine.full_state_dict()
    assert sorted(got) == sorted(ref.state_dict())
    assert max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items()) <= 1e-6
    assert [n for n, _ in engine.module.named_parameters()] == [n for n, _ in ref.named_parameters()]


class Scaled(torch.nn.Module):
    """A layer whose scales live in a ParameterDict, read by the layer's own forward (peft's IA3,
    and LoRA's embedding adapters, keep theirs so): a ParameterDict has no forward of its own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scales = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))})

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scales["a"]


class CheckpointedScaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Scaled() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x.pow(2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_dict_read_by_its_parents_forward_under_checkpointing(stage):
    """Stage 3 raised ShardedParameterError in the recomputation: the dict's parameters were lent
    to whichever forward ran, and none runs there. They now belong to their parent's unit."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    ref = CheckpointedScaled()
    opt = sgd(ref.parameters())
    for _ in range(2):
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    engine = zeroshard.initialize(CheckpointedScaled(), sgd, {"stage": stage, "chunk_size": 64, "cache_chunks": 2}
                                  if stage == 3 else {"stage": stage})
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    got = engine.full_state_dict()
    assert max((got[k] - v).abs().max().item() for k, v in ref.state_dict().items()) <= 1e-6


def twin(make):
    """Two models with the same initial values: one for zeroshard, one for plain torch."""
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    return a, make()


def train_plain(model, opt, x):
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_new_parameter_or_module_after_initialize_raises_and_changes_nothing(stage):
    """A parameter, or a module holding one, assigned after initialize would be read by the forward
    and trained by nothing (the chunks hold the old ones): refused on the assigning line. What
    brings no new parameter passes and trains as in torch."""
    model, ref = twin(Net)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    old = model.out
    with pytest.raises(zeroshard.ParameterReplacedError, match=r"out = a Linear holding parameters .*\(weight, bias\)"):
        model.out = torch.nn.Linear(8, 2)
    with pytest.raises(zeroshard.ParameterReplacedError, match=r"inp.bias = a new parameter of shape \(8,\)"):
        model.inp.bias = torch.nn.Parameter(torch.zeros(8))
    assert model.out is old
    model.act = ref.act = torch.nn.Tanh()  # no parameters: passes, and is what the forward runs
    train_once(engine, x)
    train_plain(ref, opt, x)
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


class _Symmetric(torch.nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).transpose(-1, -2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_parametrization_after_initialize_raises_and_changes_nothing(stage):
    """torch's register_parametrization after initialize moved the held parameter under
    parametrizations.weight.original: full_state_dict kept the old key (a dict the parametrized
    model refused), and at stage 3 a forward after full_parameters() read the stale entry ("mat2
    must be a matrix"). Refused before torch changes the module, which trains on as in torch."""
    import torch.nn.utils.parametrize as parametrize
    model, ref = twin(Net)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    before = dict(model.inp._parameters)
    with pytest.raises(zeroshard.ParameterReplacedError, match="parametrization registered on inp.weight"):
        parametrize.register_parametrization(model.inp, "weight", _Symmetric())
    assert not parametrize.is_parametrized(model.inp) and all(model.inp._parameters[n] is p for n, p in before.items())
    train_once(engine, x)
    train_plain(ref, opt, x)
    got = engine.full_state_dict()
    assert sorted(got) == sorted(ref.state_dict())
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


def _with(edit):
    def make():
        net = Net()
        if edit is not None:
            edit(net.inp)
        return net
    return make


_RENAMES = {  # name: (applied before initialize, applied after it, what the refusal names)
    "prune": (None, lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.3),
              "inp.weight registered again as inp.weight_orig"),
    "spectral_norm": (None, torch.nn.utils.spectral_norm, "inp.weight registered again as inp.weight_orig"),
    "weight_norm": (None, torch.nn.utils.weight_norm, r"inp.weight_g = a new parameter of shape \(8, 1\)"),
    "remove_weight_norm": (torch.nn.utils.weight_norm, torch.nn.utils.remove_weight_norm,
                           r"inp.weight = a new parameter of shape \(8, 4\)"),
}


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("edit", sorted(_RENAMES))
def test_a_held_parameter_renamed_after_initialize_raises_and_changes_nothing(stage, edit):
    """torch.nn.utils.prune and the old spectral_norm after initialize moved `weight` to
    `weight_orig` in its own module, computing `weight` at each forward: at stages 0-2 nothing was
    said (spectral_norm trained another model: 1.0e-2 off torch; the full_state_dict of both had
    `inp.weight`, a dict the edited model refuses), stage 3 raised a raw TypeError. Refused on the
    line; a parameter the edit had deleted first (spectral_norm; weight_norm, whose new parameter
    was refused after `weight` was gone) is put back, and the module trains on as in torch."""
    import torch.nn.utils.prune  # noqa: F401  (torch.nn.utils.prune is not imported by torch.nn)
    before_init, after_init, named = _RENAMES[edit]
    model, ref = twin(_with(before_init))
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    before = dict(model.inp._parameters)
    with pytest.raises(zeroshard.ParameterReplacedError, match=named):
        after_init(model.inp)
    assert model.inp._parameters.keys() == before.keys() and all(model.inp._parameters[n] is p for n, p in before.items())
    for _ in range(2):
        train_once(engine, x)
        train_plain(ref, opt, x)
    got, want = engine.full_state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-6


@pytest.mark.parametrize("stage", [0, 2])
def test_a_model_whose_engine_is_gone_trains_as_plain_torch(stage):
    """The watch over a model (new parameters, renames, other optimizers' steps) lives while its
    engine does: a plain torch optimizer over the model after the engine is dropped steps as torch
    (a first version refused it with EngineCallError)."""
    model, ref = twin(Net)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    del engine
    gc.collect()
    own = sgd(model.parameters())
    for _ in range(2):
        train_plain(model, own, x)
        train_plain(ref, opt, x)
    assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), ref.parameters())) <= 1e-6


@pytest.mark.parametrize("stage", [0, 3])
def test_a_gradient_the_engine_did_not_see_raises_at_the_step(stage):
    """A parameter frozen at initialize, unfrozen, then given a gradient through a submodule called
    by itself (the engine follows unfreezing when the model is called): the step changed nothing,
    silently. Now EngineCallError, the .grad cleared; so does a .grad set by hand with no backward."""
    model = Net()
    model.inp.requires_grad_(False)
    engine = wrap(model, stage)
    model.inp.requires_grad_(True)
    x = torch.randn(3, 4)
    before = snapshot(engine)
    model.inp(x).pow(2).mean().backward()
    with pytest.raises(zeroshard.EngineCallError, match=r"inp.weight \(2 parameters\) was frozen at initialize and "
                                                        "unfrozen since"):
        engine.step()
    assert all(p.grad is None for p in engine.params)
    model.out.weight.grad = torch.ones(2, 8)
    with pytest.raises(zeroshard.EngineCallError, match=r"out.weight \(1 parameters\) has a .grad set by hand"):
        engine.step()
    assert_same_values(before, snapshot(engine))


class _FusedHead(torch.autograd.Function):
    """A fused kernel's shape: given the head's weight in the root's forward, outside the head's."""

    @staticmethod
    def forward(ctx, h, w):
        ctx.save_for_backward(h, w)
        return h @ w.t()

    @staticmethod
    def backward(ctx, g):
        h, w = ctx.saved_tensors
        return g @ w, g.t() @ h


class _FusedNet(Net):
    def forward(self, x):
        return _FusedHead.apply(self.act(self.inp(x)), self.out.weight)


@pytest.mark.parametrize("stage", [0, 3])
def test_backward_inputs_trains_those_alone_or_names_a_placeholder_leaf(stage):
    """loss.backward(inputs=[...]) of some parameters trains those alone, as in torch (stage 3
    raised ValueError on the placeholders given). At stage 3, a parameter a custom Function took
    outside its module's forward is a leaf autograd records as its placeholder: naming it in
    inputs raises ShardedParameterError (a first version handed autograd the real parameter
    instead, which is not in that graph, and the head silently trained on nothing)."""
    model, ref = twin(Net)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    for _ in range(2):
        for m, o in ((model, None), (ref, opt)):
            m(x).float().pow(2).mean().backward(inputs=[m.inp.weight, *m.out.parameters()])
            if o is not None:
                o.step()
                o.zero_grad()
        engine.step()
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6
    fused = _FusedNet()
    engine = wrap(fused, stage)
    loss = fused(x).pow(2).mean()
    if stage == 3:
        with pytest.raises(zeroshard.ShardedParameterError, match="backward.inputs=.*names out.weight, which a custom"):
            loss.backward(inputs=[fused.out.weight])
    else:
        loss.backward(inputs=[fused.out.weight])
        assert engine.step()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_new_data_for_a_parameter_raises_at_its_gradient_and_puts_it_back(stage):
    """`param.data = ...` after initialize left the chunk behind: the forward read the new tensor
    while the optimizer stepped the chunk. Refused as a forward begins (stage 3's placeholders
    refuse it on the spot)."""
    model, ref = twin(Net)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    before = snapshot(engine)
    model.inp.weight.data = torch.zeros(8, 4)
    with pytest.raises(zeroshard.ModuleMovedError, match="given new data after zeroshard.initialize"):
        model(x)  # the model's own forward, as the engine's
    model.inp.weight.data = torch.zeros(8, 4)
    with pytest.raises(zeroshard.ModuleMovedError, match="given new data after zeroshard.initialize"):
        engine(x)
    assert_same_values(before, snapshot(engine))
    assert torch.equal(model.inp.weight, before["inp.weight"])  # back on its chunk
    train_once(engine, x)
    train_plain(ref, opt, x)
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resizing_token_embeddings_after_initialize_raises_and_changes_nothing(stage):
    """transformers' resize_token_embeddings sets the embedding's .data to a new tensor (keeping the
    Parameter, for DeepSpeed's sake): at stages 0-2 the training went on silently on a resized
    tensor the optimizer never stepped, or raised a shape mismatch from the reduction."""
    model = tiny_gpt2()
    engine = wrap(model, stage)
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    before = snapshot(engine)
    with pytest.raises(zeroshard.ZeroShardError, match="resize"):  # stage 3: ShardedParameterError, on .data
        model.resize_token_embeddings(80)
        engine(input_ids=ids, labels=ids)  # stages 0-2 find it here
    assert_same_values(before, snapshot(engine))
    if stage < 3:
        assert model.get_input_embeddings().weight.shape[0] == 64


@pytest.mark.parametrize("stage", [0, 3])
def test_tying_weights_after_initialize_assigns_what_the_engine_holds(stage):
    model = tiny_gpt2()
    engine = wrap(model, stage)
    model.tie_weights()
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    assert engine.step() is True
