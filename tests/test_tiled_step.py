"""The tiled step (optim/tiled_step.py): runs of master pieces stepped as cache-sized tiles train
bit for bit what the same pieces stepped one by one train, with each parameter's own state, step
count and param group, for every optimizer it takes; others step piece by piece.

World 1, in process: the tiles are a rank's own business (the parity suites run them at worlds 1-3
against plain PyTorch). Each case trains once with tiles and once without (ELEMENTWISE emptied),
and counts the tile steps, so a run where no tile stepped fails."""
import copy

import pytest
import torch
import torch.nn as nn

import zeroshard
from zeroshard.optim import exact_adam, tiled_step


class Odd(nn.Module):
    """Pieces that join spans (multiples of 64 elements, back to back) and some that cannot (37
    rows), a parameter in the middle of a span that a step may skip (`side`), and spans larger
    than the test's tile."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 64)
        self.up = nn.Linear(64, 128)
        self.side = nn.Linear(128, 128)
        self.odd = nn.Linear(128, 37)
        self.norm = nn.LayerNorm(37)
        self.head = nn.Linear(37, 1)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.up(self.embed(x)))
        if use_side:
            h = h + 0.1 * self.side(h)
        return self.head(self.norm(self.odd(h))).pow(2).mean()


def groups(model, lr=1e-2, **kw):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr, **kw}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2, **kw}]


OPTIMIZERS = {
    "adamw_groups": lambda m: torch.optim.AdamW(groups(m)),
    "adam_amsgrad_maximize": lambda m: torch.optim.Adam(groups(m, amsgrad=True, maximize=True)),
    "adamw_foreach": lambda m: torch.optim.AdamW(groups(m), foreach=True),
    "adam_maximize": lambda m: torch.optim.Adam(groups(m, maximize=True)),
    "adam_l2_decay": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.1),
    "sgd_nesterov": lambda m: torch.optim.SGD(groups(m, momentum=0.9, nesterov=True)),
    "sgd_dampening": lambda m: torch.optim.SGD(groups(m, momentum=0.9, dampening=0.3)),
}


def data(steps=5):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 100, (steps, 4, 6), generator=g)


def train(make_opt, tiles: bool, monkeypatch, stage=0, skip_at=(), between=None, steps=5, setup=None, cfg=None):
    """Train Odd for `steps` steps; returns (full state dict, optimizer state by parameter name,
    tile steps taken). `skip_at`: steps whose forward leaves `side` out; `between(engine, step)`
    runs after each step; `setup(engine)` before the first; `cfg`: more config."""
    taken = []
    stepped = tiled_step.Span.stepped
    monkeypatch.setattr(tiled_step, "ELEMENTWISE", tiled_step.ELEMENTWISE if tiles else ())
    monkeypatch.setattr(tiled_step, "TILE", 128)  # several tiles per span, cut inside pieces
    monkeypatch.setattr(tiled_step.Span, "stepped", lambda self: (taken.append(1), stepped(self)))
    model = Odd()
    engine = zeroshard.initialize(model, make_opt(model), {"stage": stage, "chunk_size": 1 << 16, **(cfg or {})})
    if setup is not None:
        setup(engine)
    for i, x in enumerate(data(steps)):
        engine.backward(engine(x, use_side=i not in skip_at))
        engine.step()
        if between is not None:
            between(engine, i)
    if (cfg or {}).get("delay_update_after") is not None:
        with engine.full_parameters():  # lands the last step's delayed update, whose thread writes the state
            pass
    names = {id(pc.param): pc.slot.name for c in engine.optim.chunks for pc in c.pieces}  # the pieces' parameters
    opt = engine.optimizer
    state = {}
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                state[f"{names[id(p)]}.{k}"] = v.clone() if torch.is_tensor(v) else v
    return engine.full_state_dict(), state, len(taken)


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.isfinite(a[k]).all() and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("stage", [0, 3])
def test_tiles_train_bit_for_bit_what_pieces_train(monkeypatch, name, stage):
    make = OPTIMIZERS[name]
    sd, st, taken = train(make, True, monkeypatch, stage=stage)
    sd0, st0, taken0 = train(make, False, monkeypatch, stage=stage)
    assert taken > 0 and taken0 == 0, (taken, taken0)
    assert_identical(sd, sd0)
    assert_identical(st, st0)
    # each parameter keeps state in its own shape (views of the span's flat state)
    assert all(v.shape == sd[k.rsplit(".", 1)[0]].shape for k, v in st.items() if torch.is_tensor(v) and v.dim())


def test_a_parameter_skipped_at_a_step_keeps_its_own_step_count(monkeypatch):
    """`side` sits inside a span of one param group: the step that skips it steps the span's other
    pieces one by one, and from then on their step counts differ from its."""
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731
    sd, st, taken = train(make, True, monkeypatch, skip_at=(3,), steps=6)  # steps 1-2 tiled, then a skip
    sd0, st0, _ = train(make, False, monkeypatch, skip_at=(3,), steps=6)
    assert taken > 0
    assert_identical(sd, sd0)
    assert_identical(st, st0)
    assert float(st["side.weight.step"]) == 5 and float(st["up.weight.step"]) == 6, st


def test_an_lr_change_and_state_loaded_between_steps_are_followed(monkeypatch):
    """An LR scheduler's change of a group, and optimizer.load_state_dict of an earlier state
    (new tensors in every entry): the tiles take both, as the pieces do."""
    make = OPTIMIZERS["adam_amsgrad_maximize"]

    def between(engine, step):
        opt = engine.optimizer
        if step == 1:
            between.saved = copy.deepcopy(opt.state_dict())
        if step == 2:
            opt.param_groups[0]["lr"] *= 0.3
        if step == 3:
            opt.load_state_dict(between.saved)
    sd, st, taken = train(make, True, monkeypatch, between=between, steps=6)
    sd0, st0, _ = train(make, False, monkeypatch, between=between, steps=6)
    assert taken > 0
    assert_identical(sd, sd0)
    assert_identical(st, st0)


def test_a_state_entry_replaced_between_steps_is_followed(monkeypatch):
    """A user resetting one parameter's moments by assigning new tensors to its state entries (the
    state dict itself kept): the tiles read the new values, as the pieces do."""
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731

    def between(engine, step):
        if step == 2:
            opt = engine.optimizer
            up = next(pc.param for c in engine.optim.chunks for pc in c.pieces if pc.slot.name == "up.weight")
            opt.state[up]["exp_avg"] = torch.zeros_like(up)
            opt.state[up]["exp_avg_sq"] = torch.full_like(up, 1e-3)
    sd, st, taken = train(make, True, monkeypatch, between=between, steps=6)
    sd0, st0, _ = train(make, False, monkeypatch, between=between, steps=6)
    sd1, _, _ = train(make, True, monkeypatch, steps=6)
    assert taken > 0
    assert_identical(sd, sd0)
    assert_identical(st, st0)
    assert not torch.equal(sd["up.weight"], sd1["up.weight"])  # the reset changed what trained


class Scaled(torch.optim.AdamW):
    """A subclass may step differently (here: not at all past the first step): never tiled."""

    def step(self, closure=None):
        if not self.state:
            return super().step(closure)


@pytest.mark.parametrize("make", [lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1),
                                  lambda m: Scaled(m.parameters(), lr=0.1)], ids=["adagrad", "subclass"])
def test_other_optimizers_step_piece_by_piece(monkeypatch, make):
    sd, st, taken = train(make, True, monkeypatch)
    sd0, st0, _ = train(make, False, monkeypatch)
    assert taken == 0
    assert_identical(sd, sd0)
    assert_identical(st, st0)



class Replacing(torch.optim.SGD):
    """Plain SGD that also replaces each parameter's state dict at every step (a new dict, as an
    optimizer resetting its state does): the optimizer the user built sees its own state."""

    def step(self, closure=None):
        super().step(closure)
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p] = {"steps": self.state.get(p, {}).get("steps", 0) + 1}


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_replacing_its_state_keeps_what_it_wrote(monkeypatch, stage):
    sd, st, taken = train(lambda m: Replacing(m.parameters(), lr=0.1), True, monkeypatch, stage=stage)
    assert taken == 0 and st and all(v == 5 for k, v in st.items() if k.endswith(".steps")), st


# The exact Adam kernel (optim/exact_adam.py): spans of torch's Adam/AdamW stepped in one pass

def exact(monkeypatch, on: bool = True) -> list:
    """The exact kernel on for any size (or off); the returned list gains each kernel step's
    element count. Each test asks the bit probe afresh."""
    if on and exact_adam.ops() is None:
        pytest.skip("the exact Adam kernel is not built here (no compiler, no MKL or another CPU capability)")
    monkeypatch.setenv("ZEROSHARD_EXACT_ADAM", "on" if on else "off")
    monkeypatch.setattr(exact_adam, "_agreed", {})
    counted, step = [], exact_adam.step_
    monkeypatch.setattr(exact_adam, "step_", lambda p, *a: (counted.append(p.numel()), step(p, *a)))
    return counted


KERNEL_CASES = {  # (class, hyperparameters): both lerp branches (|1 - beta1| below and above 0.5), decay on and off
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    "adamw_low_beta1": (torch.optim.AdamW, dict(lr=3e-3, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.0)),
    "adam_decoupled": (torch.optim.Adam, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05,
                                              decoupled_weight_decay=True)),
}


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_exact_kernel_gives_torch_adams_bits(monkeypatch, case):
    """The kernel alone against torch's single-tensor step on the same tensor: parameter and both
    moments equal bit for bit at each of 6 steps (gradients at three scales, some exactly 0)."""
    exact(monkeypatch)
    cls, hyper = KERNEL_CASES[case]
    g = torch.Generator().manual_seed(5)
    n = 5 * 4096 + 48  # several kernel blocks and a short one
    ref = nn.Parameter(torch.randn(n, generator=g))
    mine, m, v = ref.detach().clone(), torch.zeros(n), torch.zeros(n)
    opt = cls([ref], foreach=False, **hyper)
    group = opt.param_groups[0]
    assert exact_adam.fits_group(group)
    for k in range(1, 7):
        grad = torch.randn(n, generator=g) * 10.0 ** (k % 3 - 1)
        grad[::7] = 0
        ref.grad = grad
        opt.step()
        exact_adam.step_(mine, grad, m, v, group, float(k))
        st = opt.state[ref]
        assert torch.equal(mine, ref.detach()) and torch.equal(m, st["exp_avg"]) and torch.equal(v, st["exp_avg_sq"]), k
    assert exact_adam.agrees(cls, group)


# Where the exact kernel steps: masters on the CPU. Stage 0 keeps them on the device (a GPU where
# there is one, then the kernel must not run); offload_optimizer keeps them on the host anywhere.
ON_HOST = {"stage0": ({"stage": 0}, not torch.cuda.is_available()),
           "stage3_offload": ({"stage": 3, "offload_optimizer": True}, True),
           "stage2_delayed": ({"stage": 2, "offload_optimizer": True, "delay_update_after": 1}, True)}


@pytest.mark.parametrize("where", ON_HOST)
def test_the_exact_kernel_trains_bit_for_bit_what_pieces_train(monkeypatch, where):
    """Param groups (one decayed, one not, another lr) and a parameter skipped at a step inside a
    span: the kernel steps the spans, torch the rest, and every bit and step count is the pieces'
    (the delayed update steps in its background thread)."""
    make = OPTIMIZERS["adamw_groups"]
    cfg, on_host = ON_HOST[where]
    counted = exact(monkeypatch)
    sd, st, _ = train(make, True, monkeypatch, skip_at=(3,), steps=6, cfg=cfg)
    assert (sum(counted) > 0) == on_host, counted
    exact(monkeypatch, on=False)
    sd0, st0, _ = train(make, False, monkeypatch, skip_at=(3,), steps=6, cfg=cfg)
    assert_identical(sd, sd0)
    assert_identical(st, st0)
    assert float(st["side.weight.step"]) == 5 and float(st["up.weight.step"]) == 6, st


def test_the_exact_kernel_reads_the_lr_a_users_pre_hook_set(monkeypatch):
    """A step pre-hook the user registered halves the lr at each step: the kernel steps with the
    lr the hook left (its own hook is registered last, at each step)."""
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731

    def setup(engine):
        engine.optimizer.register_step_pre_hook(lambda o, a, k: o.param_groups[0].__setitem__(
            "lr", o.param_groups[0]["lr"] * 0.5))
    counted = exact(monkeypatch)
    sd, st, _ = train(make, True, monkeypatch, setup=setup, cfg=ON_HOST["stage3_offload"][0])
    assert sum(counted) > 0
    exact(monkeypatch, on=False)
    sd0, st0, _ = train(make, True, monkeypatch, setup=setup, cfg=ON_HOST["stage3_offload"][0])
    assert_identical(sd, sd0)
    assert_identical(st, st0)


def test_a_gradient_a_users_pre_hook_replaced_is_stepped_by_torch(monkeypatch):
    """A pre-hook that gives the tiles other gradients (new tensors): the kernel, which read the
    ones the engine set, leaves those spans to torch, which steps the hook's."""
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)  # noqa: E731

    def setup(engine):
        def halve(o, a, k):
            for g in o.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.grad = p.grad * 0.5
        engine.optimizer.register_step_pre_hook(halve)
    counted = exact(monkeypatch)
    sd, st, taken = train(make, True, monkeypatch, setup=setup, cfg=ON_HOST["stage3_offload"][0])
    assert counted == [] and taken > 0
    exact(monkeypatch, on=False)
    sd0, st0, _ = train(make, False, monkeypatch, setup=setup, cfg=ON_HOST["stage3_offload"][0])
    assert_identical(sd, sd0)
    assert_identical(st, st0)


@pytest.mark.parametrize("name", ["adam_amsgrad_maximize", "adam_maximize", "adamw_foreach", "adam_l2_decay",
                                  "probe_disagrees"])
def test_torch_steps_what_the_exact_kernel_does_not_take(monkeypatch, name):
    """amsgrad, maximize, foreach and Adam's L2 decay are not the kernel's; nor a group whose bit
    probe disagrees (as on a machine whose sqrt is not torch's): torch steps them, bit for bit as
    before."""
    make = OPTIMIZERS["adamw_groups" if name == "probe_disagrees" else name]
    counted = exact(monkeypatch)
    if name == "probe_disagrees":
        monkeypatch.setattr(exact_adam, "_probe", lambda *a: False)
    cfg = ON_HOST["stage3_offload"][0]
    sd, st, taken = train(make, True, monkeypatch, cfg=cfg)
    assert counted == [] and taken > 0
    exact(monkeypatch, on=False)
    sd0, st0, _ = train(make, False, monkeypatch, cfg=cfg)
    assert_identical(sd, sd0)
    assert_identical(st, st0)


def test_the_exact_kernel_waits_for_a_size_worth_its_build(monkeypatch):
    """By default a rank stepping fewer than MIN_ELEMENTS as spans does not build it; =off never;
    another value is refused, naming the valid ones."""
    monkeypatch.delenv("ZEROSHARD_EXACT_ADAM", raising=False)
    assert not exact_adam.wanted(exact_adam.MIN_ELEMENTS - 1) and exact_adam.wanted(exact_adam.MIN_ELEMENTS)
    monkeypatch.setenv("ZEROSHARD_EXACT_ADAM", "off")
    assert not exact_adam.wanted(1 << 40)
    monkeypatch.setenv("ZEROSHARD_EXACT_ADAM", "on")
    assert exact_adam.wanted(64)
    monkeypatch.setenv("ZEROSHARD_EXACT_ADAM", "yes")
    with pytest.raises(zeroshard.ConfigError, match="'on'.*'off'"):
        exact_adam.wanted(64)
