"""Changes to a wrapped model and its gradients after initialize, as plain PyTorch code makes them:
new parameters or modules, parametrizations, parameters moved to another name (prune,
spectral_norm), new data, resized embeddings, tied weights, gradients the engine never saw and
backward(inputs=...). Each is trained as torch trains it, or refused on the line that made it with
the model as it was.
"""
from __future__ import annotations

import gc

import pytest
import torch

import zeroshard
from test_module_class import Net, assert_same_values, sgd, snapshot, tiny_gpt2, train_once, wrap


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


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


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
    # torch.nn.utils.parametrize: weight_norm's two new tensors left the module without `weight`
    # (stages 0-2: a raw KeyError at the next forward; stage 3: a raw RuntimeError), and removing
    # a parametrization made before initialize raised a raw AttributeError
    "parametrizations.weight_norm": (None, torch.nn.utils.parametrizations.weight_norm,
                                     "a parametrization registered on inp.weight after initialize"),
    "remove_parametrizations": (torch.nn.utils.parametrizations.weight_norm,
                                lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight"),
                                "remove_parametrizations of 'weight' after initialize"),
    # torch deleted the pruning mask (spectral_norm's u and v) before the refusal, and prune.remove
    # gave `weight_orig` the masked values as new data: the next forward raised ModuleMovedError
    # (spectral_norm's: a raw AttributeError), as did full_state_dict. Stage 3's placeholder
    # refuses the new data first (ModuleMovedError)
    "prune.remove": (lambda m: torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.3),
                     lambda m: torch.nn.utils.prune.remove(m, "weight"),
                     "inp.weight_orig registered again as inp.weight|inp.weight_orig was moved or cast"),
    "remove_spectral_norm": (torch.nn.utils.spectral_norm, torch.nn.utils.remove_spectral_norm,
                             r"inp.weight = a new parameter of shape \(8, 4\)"),
    "remove_parametrizations_no_bias": (
        lambda m: (m.register_parameter("bias", None), torch.nn.utils.parametrize.register_parametrization(
            m, "weight", _Doubled())),
        lambda m: torch.nn.utils.parametrize.remove_parametrizations(m, "weight", leave_parametrized=False),
        "remove_parametrizations of 'weight' after initialize"),
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
    before, buffers, cls = dict(model.inp._parameters), dict(model.inp._buffers), type(model.inp)
    with pytest.raises((zeroshard.ParameterReplacedError, zeroshard.ModuleMovedError), match=named):
        after_init(model.inp)
    assert model.inp._parameters.keys() == before.keys() and all(model.inp._parameters[n] is p for n, p in before.items())
    assert model.inp._buffers.keys() == buffers.keys() and all(model.inp._buffers[n] is b for n, b in buffers.items())
    assert type(model.inp) is cls
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
    """A parameter frozen at initialize, unfrozen, then given a gradient outside every forward (read
    by a functional call; the engine follows unfreezing as a forward of the model or of a module of
    it opens): the step changed nothing, silently. Now EngineCallError, the .grad cleared; so does a
    .grad set by hand with no backward. (A submodule called by itself used to be such a use: it now
    opens a forward, and trains: test_called_as_itself.py.)"""
    model = Net()
    model.inp.requires_grad_(False)
    engine = wrap(model, stage)
    model.inp.requires_grad_(True)
    x = torch.randn(3, 4)
    before = snapshot(engine)
    torch.nn.functional.linear(x, model.inp.weight, model.inp.bias).pow(2).mean().backward()
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


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_tying_weights_after_initialize_passes_only_for_weights_tied_then(stage):
    """tie_weights() over weights tied at initialize assigns what the module holds there: it passes.
    Tying two parameters the model held apart (`b.weight = a.weight`) trained the tie, but the
    replaced parameter stayed in the chunks: full_state_dict()['b.weight'] was its old value (0.58
    off torch's tied model). Refused on the line, the model as it was."""
    model = tiny_gpt2()
    engine = wrap(model, stage)
    model.tie_weights()
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    assert engine.step() is True
    model, ref = twin(_TwoHeads)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    with pytest.raises(zeroshard.ParameterReplacedError, match="b.weight = a.weight after initialize leaves b.weight out"):
        model.b.weight = model.a.weight
    with pytest.raises(zeroshard.ParameterReplacedError, match="b = a after initialize leaves b.weight, b.bias out"):
        model.b = model.a
    assert model.b.weight is not model.a.weight and model.b is not model.a
    for _ in range(2):
        train_once(engine, x)
        train_plain(ref, opt, x)
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


class _Bank(torch.nn.Module):
    """A forward that points `lin.weight` at one of two parameters the model holds, in turn."""

    def __init__(self):
        super().__init__()
        self.bank = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)])
        self.lin = torch.nn.Linear(4, 4)
        self.lin.weight = self.bank[0]
        self.calls = 0

    def forward(self, x):
        self.lin.weight = self.bank[self.calls % 2]
        self.calls += 1
        return self.lin(x)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_forward_pointing_a_name_at_another_held_parameter_trains_and_saves_as_torch(stage):
    """Reassigning a name to another parameter the model holds leaves nothing out: it passes (a
    first version of the tie refusal refused it), and full_state_dict()['lin.weight'] is what the
    name holds now, as the model's state_dict() gives (it was the parameter held there at
    initialize: 0.72 off torch)."""
    model, ref = twin(_Bank)
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    for _ in range(2):  # the second forward leaves lin.weight on bank.1
        train_once(engine, x)
        train_plain(ref, opt, x)
    assert model.lin.weight is not model.bank[0]
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_refused_prune_remove_puts_back_the_mask_the_module_had_last(stage):
    """Pruned before initialize and again after it (a new `weight_mask`), then prune.remove (refused):
    the mask put back was the one of initialize, and the module trained on with it, silently (1.0
    off torch's mask). Stage 3's placeholder refuses before anything is deleted."""
    import torch.nn.utils.prune as prune
    model, ref = twin(_with(lambda m: prune.l1_unstructured(m, "weight", amount=0.3)))
    engine, opt = wrap(model, stage), sgd(ref.parameters())
    x = torch.randn(3, 4)
    train_once(engine, x)
    train_plain(ref, opt, x)
    for m in (model, ref):
        prune.l1_unstructured(m.inp, "weight", amount=0.3)
    with pytest.raises((zeroshard.ParameterReplacedError, zeroshard.ModuleMovedError)):
        prune.remove(model.inp, "weight")
    for _ in range(2):
        train_once(engine, x)
        train_plain(ref, opt, x)
    got = engine.full_state_dict()
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6
