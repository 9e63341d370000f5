"""Multi-process halves of tests/test_contract.py (issue 14, the PyTorch contract): ordinary PyTorch
training code run through the engine must train what plain PyTorch trains on the global batch.

`run(rank, world, out_path)` runs every scenario on each rank of a spawned group through
scenarios.run_all (rank 0 writes {name: figures} as JSON; a scenario that raises records its error).

This module holds the registry, SCENARIOS: its own scenarios, on backward and step calls (two
backwards before a step, a step without one, a first forward that differs by rank, models the chunks
cannot hold, writes into parameters between steps), contract_gradient_scenarios' (gradients taken
besides the loss's backward, user autocast), then contract_optimizer_scenarios' and
contract_module_scenarios' and contract_call_scenarios'; contract_common holds what they share.
"""
from __future__ import annotations

import torch

import zeroshard
import contract_call_scenarios
import contract_gradient_scenarios
import contract_module_scenarios
import contract_optimizer_scenarios
from contract_common import loss_of, per_optimizer_and_stage
from distributed import error_on_every_rank, every_rank, shared_temp_dir
from models import batches, make_sgd, max_diff, tiny_gpt2
from scenarios import run_all

SCENARIOS = {}


def parts_reference(data, make_opt, extra_steps: int = 0):
    """Plain PyTorch on the global batch, several backward passes per step: data is
    [steps, parts, world, batch, seq]; each part's loss is the mean over every rank's rows of that
    part, and its backward adds to .grad (no scaling between parts), then one optimizer step.
    `extra_steps` more optimizer steps follow each one with no backward in between (torch skips
    parameters whose .grad is None: they change nothing)."""
    model = tiny_gpt2()
    opt = make_opt(list(model.parameters()))
    for step in data:
        for part in step:
            loss_of(model, part.reshape(-1, part.shape[-1])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for _ in range(extra_steps):
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def two_backwards_per_step(rank, world, make_opt, stage, extra=None):
    """A loss computed in two parts, each part's backward called before one step (a chunked loss, a
    head called alone), gradient_accumulation_steps=1: the gradients add up, as two
    loss.backward() calls do in PyTorch (issue 14, defect 3: stages 0-1 reduced the reduced buffer
    again, so the first part counted about `world` times)."""
    data = batches(3, world, 2, accumulation=2)
    ref = parts_reference(data, make_opt)
    engine = zeroshard.initialize(tiny_gpt2(), make_opt, {"stage": stage, "chunk_size": 20000, **(extra or {})})
    applied = []
    for step in data:
        for part in step:
            engine.backward(loss_of(engine, part[rank]))
        applied.append(engine.step())
    return {"diff": max_diff(engine.full_state_dict(), ref), "applied": applied}


def step_without_backward(rank, world, make_opt, stage):
    """step() with no backward since the last step, before training starts and after every step:
    nothing changes, as torch's optimizer changes no parameter whose .grad is None, and step()
    returns False (issue 14, defect 4: an AdamW update was applied again, momentum moved SGD)."""
    data = batches(3, world, 2)
    ref = parts_reference(data, make_opt, extra_steps=1)
    engine = zeroshard.initialize(tiny_gpt2(), make_opt, {"stage": stage, "chunk_size": 20000})
    extra = [engine.step()]
    for step in data:
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
        extra.append(engine.step())
    return {"diff": max_diff(engine.full_state_dict(), ref), "extra_applied": extra, "steps": engine.steps}


per_optimizer_and_stage(SCENARIOS, "two_backwards", two_backwards_per_step)
for _stage in (1, 2, 3):  # the reduced gradient goes to the host after each reduction
    SCENARIOS[f"two_backwards_offload_sgd_stage{_stage}"] = (
        lambda rank, world, stage=_stage: two_backwards_per_step(rank, world, make_sgd, stage,
                                                                 {"offload_optimizer": True}))
per_optimizer_and_stage(SCENARIOS, "step_without_backward", step_without_backward)


class TwoBranches(torch.nn.Module):
    """y = a(h) + 2 b(h): `flip` computes 2 b(h) + a(h) instead, the same values (addition commutes)
    with the parameters first used in another order."""

    def __init__(self, flip=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)
        self.flip = flip

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        y = 2 * self.b(h) + self.a(h) if self.flip else self.a(h) + 2 * self.b(h)  # a's, b's gradients differ
        return self.head(torch.tanh(y))


def first_forward_differs(rank, world, stage):
    """Odd ranks use the parameters in another order than even ones (data-dependent control flow):
    every rank must pack chunks alike, here in rank 0's first-use order (issue 14, defect 2: each
    rank re-packed in its own order; stage 0 then summed gradients of different parameters with no
    error, stages 1-2 hung in the re-pack's all-gather). Stage 3 gathers chunks in another order on
    odd ranks in every forward: DivergedError on every rank is the right outcome there."""
    g = torch.Generator().manual_seed(5)
    data = torch.randn(3, world, 4, 8, generator=g)
    ref = TwoBranches()
    opt = make_sgd(list(ref.parameters()))
    for step in data:
        ref(step.reshape(-1, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    engine = zeroshard.initialize(TwoBranches(flip=rank % 2 == 1), make_sgd, {"stage": stage, "chunk_size": 300})
    for step in data:
        engine.backward(engine(step[rank]).pow(2).mean())
        engine.step()
    mine = {k: v.tolist() for k, v in engine.full_state_dict().items()}
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()),
            "ranks_agree": all(e == mine for e in every_rank(mine)),
            "chunks": [[s.name for s in c.slots] for c in engine.chunks]}


class _Untrainable(torch.nn.Module):
    """A linear layer beside one thing zeroshard's chunks cannot hold (units.refuse_untrainable)."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if kind == "float64":
            self.double()
        elif kind == "complex":
            self.phase = torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))
        elif kind == "integer":  # a quantized base's weight: frozen, int8
            self.q = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
        elif kind == "sparse":
            self.emb = torch.nn.Embedding(10, 4, sparse=True)
        elif kind == "lazy":  # no shape until its first forward (it raised torch's RuntimeError)
            self.head = torch.nn.LazyLinear(4)


def untrainable(rank, world, stage):
    """Models zeroshard would otherwise change without a word (a float64, complex or integer
    parameter) or cannot chunk or reduce (a lazy module's parameter, sparse gradients): initialize raises UnsupportedModelError on every
    rank, before any collective, and leaves the model as it was."""
    out = {}
    def state(model):
        return {n: (type(p), p.dtype, None if isinstance(p, torch.nn.parameter.UninitializedParameter) else p.data_ptr())
                for n, p in model.named_parameters()}

    for kind in ("float64", "complex", "integer", "sparse", "lazy"):
        model = _Untrainable(kind)
        before = state(model)
        out[kind] = {"raised": error_on_every_rank(lambda: zeroshard.initialize(model, make_sgd, {"stage": stage})),
                     "unchanged": before == state(model) and type(model) is _Untrainable}
    return out


class _ClampedLinear(torch.nn.Linear):
    """A weight constraint applied in the forward, in place (as Keras' kernel constraints are ported)."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.3, 0.3)
        return super().forward(x)


def _written_mlp(clamped: bool):
    torch.manual_seed(0)
    return torch.nn.Sequential((_ClampedLinear if clamped else torch.nn.Linear)(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _write_between_steps(model, k):
    """What users write into parameters between steps: a row set by hand and a bias by nn.init
    (under grad mode, as torch allows) after the first step, every parameter clipped (as WGAN
    clips its critic) after the second, every parameter scaled at once and a view of each, taken
    together, shifted at once after the third (read at once by full_state_dict)."""
    if k == 0:
        torch.nn.init.constant_(model[2].bias, 0.25)
    with torch.no_grad():
        if k == 0:
            model[0].weight[0].fill_(0.5)
        if k == 1:
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)
        if k == 2:
            torch._foreach_mul_(list(model.parameters()), 0.5)
            torch._foreach_add_([p[0] for p in model.parameters()], 0.1)


def written_between_steps(rank, world, cfg):
    """Writes into parameters between steps and in a forward last as in plain PyTorch, at every
    stage: where the parameters are a copy of the fp32 masters (16-bit training, an offloaded
    optimizer: optim/user_writes.py) and at stage 3, where they are a gathered copy of the shard
    (runtime/param_writes.py). With the delayed update, a write while it is in flight raises
    EngineCallError on every rank; one inside full_parameters() (which lands it first) lasts."""
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2 * world, 8, generator=g) for _ in range(3)]
    delayed = cfg.get("delay_update_after") is not None
    ref = _written_mlp(clamped=not delayed)  # a write in each forward would land in the update's flight
    ref_opt = make_sgd(ref.parameters())
    model = _written_mlp(clamped=not delayed)
    if "offload_dir" in cfg:
        cfg = {**cfg, "offload_dir": shared_temp_dir()}
    engine = zeroshard.initialize(model, make_sgd, cfg)
    departures, peak = 0, 0
    for k, x in enumerate(data):
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(x.chunk(world)[rank]).float().pow(2).mean())
        engine.step()
        departures += engine.stats().get("schedule_departures") or 0
        peak = max(peak, engine.stats()["cache_peak_chunks"])
        _write_between_steps(ref, k)
        if delayed:  # the update in flight lands over a write, unless it lands first
            if k == 0:
                raised = error_on_every_rank(lambda: (_write_between_steps(model, k), engine.full_state_dict()))
            with engine.full_parameters():
                _write_between_steps(model, k)
        else:
            _write_between_steps(model, k)
    got = engine.full_state_dict()
    out = {"diff": max(float((got[n].float() - p).abs().max()) for n, p in ref.state_dict().items()),
           "departures": departures, "cache_peak": peak, "chunks": len(engine.chunks)}
    return {**out, "raised": raised} if delayed else out


for _name, _cfg in {"fp32_stage0": {"stage": 0}, "bf16_stage0": {"stage": 0, "precision": "bf16"},
                    "fp32_stage1": {"stage": 1}, "bf16_stage2": {"stage": 2, "precision": "bf16"},
                    "fp32_stage1_offload": {"stage": 1, "offload_optimizer": True},
                    "bf16_stage2_offload": {"stage": 2, "precision": "bf16", "offload_optimizer": True},
                    "fp32_stage2_disk": {"stage": 2, "offload_optimizer": "disk", "offload_dir": ""},
                    "fp32_stage2_delayed": {"stage": 2, "offload_optimizer": True, "delay_update_after": 0},
                    "fp32_stage3": {"stage": 3, "cache_chunks": 1},
                    "bf16_stage3": {"stage": 3, "precision": "bf16"},
                    "bf16_stage3_offload_params": {"stage": 3, "precision": "bf16", "offload_optimizer": True,
                                                   "offload_params": True},
                    "bf16_stage3_disk": {"stage": 3, "precision": "bf16", "offload_optimizer": "disk",
                                         "offload_params": "disk", "offload_dir": ""},
                    "fp32_stage3_delayed": {"stage": 3, "offload_optimizer": True, "delay_update_after": 0}}.items():
    SCENARIOS[f"written_between_steps_{_name}"] = lambda rank, world, cfg=_cfg: written_between_steps(
        rank, world, {"chunk_size": 100, **cfg})


class _UsedBeforeRegistered(torch.nn.Module):
    """Registers `b` before `a` and runs `a` first: the first forward re-packs the chunks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.b, self.a = torch.nn.Linear(8, 4), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def written_before_the_first_forward(rank, world, cfg):
    """A write right after initialize (a weight set by hand) lasts through the first forward's
    re-pack, which reads the masters (it was lost at stages 0-2 where the master is apart)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * world, 8, generator=g)
    ref, model = _UsedBeforeRegistered(), _UsedBeforeRegistered()
    ref_opt = make_sgd(ref.parameters())
    engine = zeroshard.initialize(model, make_sgd, cfg)
    for m in (ref, model):
        with torch.no_grad():
            m.a.weight.fill_(0.25)
    ref(x).pow(2).mean().backward()
    ref_opt.step()
    engine.backward(engine(x.chunk(world)[rank]).float().pow(2).mean())
    engine.step()
    got = engine.full_state_dict()
    return {"diff": max(float((got[n].float() - p).abs().max()) for n, p in ref.state_dict().items())}


for _name, _cfg in {"bf16_stage1": {"stage": 1, "precision": "bf16"},
                    "fp32_stage2_offload": {"stage": 2, "offload_optimizer": True},
                    "fp32_stage3": {"stage": 3}}.items():
    SCENARIOS[f"written_before_the_first_forward_{_name}"] = (
        lambda rank, world, cfg=_cfg: written_before_the_first_forward(rank, world, {"chunk_size": 72, **cfg}))


class _IdentityMap(torch.nn.Module):
    def forward(self, w):
        return w


class _ParametrizedPerCall(torch.nn.Linear):
    """Parametrizes its weight for each call and removes it after, as peft's ParamWrapper does for
    LoRA on fused experts: torch sets the weight to itself on registering (its version counter
    moves; nothing is written)."""

    def forward(self, x):
        torch.nn.utils.parametrize.register_parametrization(self, "weight", _IdentityMap())
        try:
            return super().forward(x)
        finally:
            torch.nn.utils.parametrize.remove_parametrizations(self, "weight", leave_parametrized=False)


def parametrized_per_call(rank, world, cfg):
    """A forward that parametrizes a weight for the call trains what the same model without the
    parametrization trains, under the same config: its version bump is no write (with the delayed
    update it raised EngineCallError, a write lost)."""
    g = torch.Generator().manual_seed(6)
    data = [torch.randn(2 * world, 8, generator=g) for _ in range(3)]
    engines = []
    for cls in (_ParametrizedPerCall, torch.nn.Linear):
        torch.manual_seed(0)
        engines.append(zeroshard.initialize(torch.nn.Sequential(cls(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)),
                                            make_sgd, cfg))
        for x in data:
            engines[-1].backward(engines[-1](x.chunk(world)[rank]).pow(2).mean())
            engines[-1].step()
    return {"diff": max_diff(engines[0].full_state_dict(), engines[1].full_state_dict())}


for _name, _cfg in {"stage2_delayed": {"stage": 2, "offload_optimizer": True, "delay_update_after": 0},
                    "stage3": {"stage": 3, "cache_chunks": 1},
                    "stage3_delayed": {"stage": 3, "offload_optimizer": True, "delay_update_after": 0}}.items():
    SCENARIOS[f"parametrized_per_call_{_name}"] = (
        lambda rank, world, cfg=_cfg: parametrized_per_call(rank, world, {"chunk_size": 100, **cfg}))


SCENARIOS.update(contract_gradient_scenarios.SCENARIOS)


class _RenormedEmbedding(torch.nn.Module):
    """An nn.Embedding with max_norm (rows renormalized in place inside the forward), rows scaled
    so that every one is renormalized when first looked up."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(20, 8, max_norm=1.0), torch.nn.Linear(8, 4)
        with torch.no_grad():
            self.emb.weight.mul_(3)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


def forward_writes(rank, world, stage):
    """A module that writes into its weight inside its forward (max_norm): above a world size of 1
    initialize raises UnsupportedModelError on every rank and leaves the model as it was (each rank
    would keep only its own batch's renormalized rows: a model plain PyTorch does not train). At a
    world size of 1 every stage trains what torch trains (stage 3 was refused: it dropped the rows
    with the gathered chunk before writes in a forward were kept)."""
    g = torch.Generator().manual_seed(10)
    xs, ys = torch.randint(0, 20, (3, world, 4, 5), generator=g), torch.randn(3, world, 4, 4, generator=g)
    model = _RenormedEmbedding()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = {}
    raised = error_on_every_rank(lambda: engine.setdefault("e", zeroshard.initialize(
        model, make_sgd, {"stage": stage, "chunk_size": 100})))
    out = {"raised": raised, "unchanged": type(model) is _RenormedEmbedding
           and max_diff(model.state_dict(), before) == 0.0}
    if "e" in engine:
        ref = _RenormedEmbedding()
        ref_opt = make_sgd(ref.parameters())
        for x, y in zip(xs, ys):
            torch.nn.functional.mse_loss(ref(x.reshape(-1, 5)), y.reshape(-1, 4)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            engine["e"].backward(torch.nn.functional.mse_loss(engine["e"](x[rank]), y[rank]))
            engine["e"].step()
        out["diff"] = max_diff(engine["e"].full_state_dict(), ref.state_dict())
    return out


for _stage in range(4):
    SCENARIOS[f"forward_writes_stage{_stage}"] = lambda rank, world, stage=_stage: forward_writes(rank, world, stage)

for _stage in (0, 3):
    SCENARIOS[f"untrainable_stage{_stage}"] = lambda rank, world, stage=_stage: untrainable(rank, world, stage)

for _stage in range(4):  # last: at stage 3 it ends in DivergedError
    SCENARIOS[f"first_forward_differs_stage{_stage}"] = lambda rank, world, stage=_stage: first_forward_differs(
        rank, world, stage)


SCENARIOS.update(contract_optimizer_scenarios.SCENARIOS)
SCENARIOS.update(contract_module_scenarios.SCENARIOS)
SCENARIOS.update(contract_call_scenarios.SCENARIOS)


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
