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


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_initialize_over_a_wrapped_model_raises_before_anything_changes(stage):
    """initialize over a model an engine still wraps (a notebook cell `engine = zeroshard.initialize(model,
    ...)` run again holds the first engine until the call returns) raised ModuleMovedError at the
    second engine's first forward (stages 0-2: the first engine's hooks found the parameters
    repacked), or at stage 3 as the second packed the first's placeholders. Now EngineCallError at
    the call, the first engine training on as before; once it is dropped, stages 0-2 wrap again,
    and stage 3's shards, which no new engine can read, are named."""
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    first, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    with pytest.raises(zeroshard.EngineCallError, match="another engine still wraps"):
        wrap(model, stage)
    inner = Net()
    inner_engine = wrap(inner.inp, stage)
    with pytest.raises(zeroshard.EngineCallError, match="another engine still wraps"):  # on a submodule
        wrap(inner, stage)
    del inner_engine
    assert train_once(first, x) is True
    ref(x).pow(2).mean().backward()
    opt.step()
    got = first.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6
    del first
    if stage == 3:
        with pytest.raises(zeroshard.EngineCallError, match="wrapped at stage 3.*full_state_dict"):
            wrap(model, stage)
    else:
        assert train_once(wrap(model, stage), x) is True


class _Scaled(Net):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))  # 0-d, as CLIP's logit_scale

    def forward(self, x):
        return super().forward(x) * self.scale


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_one_element_value_loads_into_a_0_d_parameter_as_in_torch(stage):
    """torch loads a value of shape [1] into a 0-d parameter (a rule for old files); stage 3
    reported all keys matched and kept the old value, silently (then 1.7 off torch after 2 steps)."""
    model, ref = _Scaled(), _Scaled()
    ref.load_state_dict(model.state_dict())
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    sd = {**ref.state_dict(), "scale": torch.tensor([5.0])}
    assert str(model.load_state_dict(sd)) == str(ref.load_state_dict(sd))
    x = torch.randn(3, 4)
    for _ in range(2):
        assert train_once(engine, x) is True
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6
