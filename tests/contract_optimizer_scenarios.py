"""Contract scenarios on what the optimizer steps (contract_scenarios.py): param groups and LR
schedules, parameters whose requires_grad changes after initialize, modules some steps or ranks
skip, and a loss that does not come from the engine's forward.
"""
from __future__ import annotations

import copy
import warnings

import torch

import zeroshard
from contract_common import loss_of, per_optimizer_and_stage
from distributed import error_on_every_rank, every_rank, shared_temp_dir
from models import batches, inputs, make_adamw, make_sgd, max_diff, parity, tiny_gpt2

SCENARIOS = {}


# -- optimizer param groups ------------------------------------------------------------------------
def grouped_adamw(model, lr=1e-3, cls=torch.optim.AdamW):
    """The fine-tuning scripts' optimizer: weight decay 0.1 on weights, none on biases and norms,
    and the embeddings' group at a second learning rate."""
    decay, no_decay, embed = [], [], []
    for name, p in model.named_parameters():
        if "wte" in name or "wpe" in name:
            embed.append(p)
        elif name.endswith("bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
            no_decay.append(p)
        else:
            decay.append(p)
    return cls([{"params": decay, "weight_decay": 0.1},
                {"params": no_decay, "weight_decay": 0.0},
                {"params": embed, "weight_decay": 0.1, "lr": lr / 2}], lr=lr)


def schedule(opt):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)


def param_groups(rank, world, stage, form="instance", extra=None):
    """Two-group AdamW (three groups: decay, no decay, embeddings at half the lr) through
    get_linear_schedule_with_warmup, as every fine-tuning script builds it: an optimizer instance
    over the model's parameters (`form` 'instance'), or a callable that ignores the tensors it is
    given and builds the same groups from the model (`form` 'factory': trained nothing before)."""
    data = batches(4, world, 2)
    ref_model = tiny_gpt2()
    ref_opt = grouped_adamw(ref_model)
    ref_sched = schedule(ref_opt)
    lrs_ref = []
    for step in data:
        loss_of(ref_model, step.reshape(-1, step.shape[-1])).backward()
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        lrs_ref.append([g["lr"] for g in ref_opt.param_groups])
    model = tiny_gpt2()
    opt = {"instance": lambda: grouped_adamw(model), "factory": lambda: (lambda ps: grouped_adamw(model)),
           "cpu_adam": lambda: grouped_adamw(model, cls=zeroshard.CPUAdamW)}[form]()
    engine = zeroshard.initialize(model, opt, {"stage": stage, "chunk_size": 20000, **(extra or {})})
    sched = schedule(engine.optimizer)
    lrs = []
    for step in data:
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
        sched.step()
        lrs.append([g["lr"] for g in engine.optimizer.param_groups])
    return {"diff": max_diff(engine.full_state_dict(), ref_model.state_dict()), "lrs_match": lrs == lrs_ref,
            "same_optimizer": form == "factory" or engine.optimizer is opt,
            "groups": len(engine.optimizer.param_groups)}


for _stage in range(4):
    SCENARIOS[f"param_groups_stage{_stage}"] = lambda rank, world, stage=_stage: param_groups(rank, world, stage)
    SCENARIOS[f"param_groups_factory_stage{_stage}"] = (lambda rank, world, stage=_stage:
                                                        param_groups(rank, world, stage, "factory"))
for _stage in (1, 2, 3):
    SCENARIOS[f"param_groups_offload_stage{_stage}"] = (lambda rank, world, stage=_stage: param_groups(
        rank, world, stage, extra={"offload_optimizer": True}))
    # zeroshard's CPU Adam (its compiled kernel in bf16: the master and the 16-bit copy in one pass)
    SCENARIOS[f"param_groups_cpu_adam_stage{_stage}"] = (lambda rank, world, stage=_stage: param_groups(
        rank, world, stage, "cpu_adam", extra={"offload_optimizer": True}))
    SCENARIOS[f"param_groups_cpu_adam_bf16_stage{_stage}"] = (lambda rank, world, stage=_stage: param_groups(
        rank, world, stage, "cpu_adam", extra={"offload_optimizer": True, "precision": "bf16"}))


# -- requires_grad changed after initialize, parameters without a gradient in some steps --------
FROZEN = "transformer.h.0.mlp.c_fc.weight"


def requires_grad_changes(rank, world, make_opt, stage, when, direct=False):
    """A parameter frozen after initialize: 'before_forward' (while the first forward records the
    order of first use), then unfrozen after 2 steps; or 'after_steps' (frozen after 2 steps of
    training). torch does not step a parameter whose .grad is None: no momentum, no weight decay
    (issue 14, defect 1: it landed in a frozen chunk for good, or kept moving under Adam).
    `direct`: the parameter is frozen before initialize (its chunk frozen) and the forward calls
    the wrapped model itself, not the engine (unfrozen, it stayed frozen there: only the engine's
    call followed requires_grad)."""
    data = batches(4, world, 2)

    def flip(p, k):  # p: a reference taken before initialize (stage 3 puts placeholders in the model)
        if when == "before_forward":
            p.requires_grad_(k >= 2)
        elif k == 2:
            p.requires_grad_(False)

    ref = tiny_gpt2()
    opt = make_opt(list(ref.parameters()))
    for k, step in enumerate(data):
        flip(ref.get_parameter(FROZEN), k)
        loss_of(ref, step.reshape(-1, step.shape[-1])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model = tiny_gpt2()
    p = model.get_parameter(FROZEN)
    if direct:
        p.requires_grad_(False)
    engine = zeroshard.initialize(model, make_opt, {"stage": stage, "chunk_size": 20000})
    for k, step in enumerate(data):
        flip(p, k)
        engine.backward(loss_of(model if direct else engine, step[0, rank]))
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict())}


for _when in ("before_forward", "after_steps"):
    for _stage in range(4):
        SCENARIOS[f"requires_grad_{_when}_stage{_stage}"] = (
            lambda rank, world, stage=_stage, when=_when: requires_grad_changes(rank, world, make_adamw, stage, when))
for _stage in range(4):
    SCENARIOS[f"requires_grad_at_initialize_direct_stage{_stage}"] = (
        lambda rank, world, stage=_stage: requires_grad_changes(rank, world, make_adamw, stage, "before_forward", True))


BODY = "transformer.h.0"


def added_param_group(rank, world, stage, frozen_at_initialize: bool):
    """Gradual unfreezing as Lightning's BackboneFinetuning does it: an AdamW over the parameters
    that train from the start, then, after 2 steps, a block unfrozen (or trained but in no group)
    and given to `optimizer.add_param_group` with its own learning rate: from then on it trains
    in that group, from no state, as in torch (it used to stay where it was: the group held the
    model's parameters, which have no .grad). Then a second add_param_group naming a parameter
    already in a group: ValueError on every rank, as torch's own check would raise."""
    data = batches(4, world, 2)

    def body(model):
        return list(model.get_submodule(BODY).parameters())

    def build(model):
        if frozen_at_initialize:
            for p in body(model):
                p.requires_grad_(False)
        held = {id(p) for p in body(model)}
        return torch.optim.AdamW([p for p in model.parameters() if id(p) not in held], lr=1e-3, weight_decay=0.1)

    def join(model, opt):
        for p in body(model):
            p.requires_grad_(True)
        opt.add_param_group({"params": body(model), "lr": 3e-3})

    ref = tiny_gpt2()
    ref_opt = build(ref)
    for k, step in enumerate(data):
        if k == 2:
            join(ref, ref_opt)
        loss_of(ref, step.reshape(-1, step.shape[-1])).backward()
        ref_opt.step()
        ref.zero_grad(set_to_none=True)  # every gradient, as the engine's step clears them
    cfg = {"stage": stage, "chunk_size": 20000}
    model = tiny_gpt2()
    engine = zeroshard.initialize(model, build(model), cfg)
    root = shared_temp_dir()
    for k, step in enumerate(data):
        if k == 2:
            join(model, engine.optimizer)
            # listed before the group's first step, and loaded back: nothing changes
            engine.optimizer.load_state_dict(engine.optimizer.state_dict())
        if k == len(data) - 1:
            engine.save_checkpoint(root, tag="added")
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
    out = {"diff": max_diff(engine.full_state_dict(), ref.state_dict()),
           "lrs": [g["lr"] for g in engine.optimizer.param_groups]}
    # Resuming: as in torch, the group is added again before the optimizer's state is loaded.
    resumed = tiny_gpt2(seed=7)
    again = zeroshard.initialize(resumed, build(resumed), cfg)
    join(resumed, again.optimizer)
    again.load_checkpoint(root, tag="added")
    again.backward(loss_of(again, data[-1][0, rank]))
    again.step()
    out["resumed_diff"] = max_diff(again.full_state_dict(), engine.full_state_dict())
    unjoined = tiny_gpt2(seed=7)
    out["not_added"] = error_on_every_rank(
        lambda: zeroshard.initialize(unjoined, build(unjoined), cfg).load_checkpoint(root, tag="added"))
    engine.optimizer.add_param_group({"params": [model.get_parameter("lm_head.weight")], "lr": 1.0})
    out["twice"] = error_on_every_rank(lambda: (engine.backward(loss_of(engine, data[0, 0, rank])), engine.step()))
    return out


for _stage in range(4):
    for _frozen in (True, False):
        SCENARIOS[f"added_param_group_{'frozen' if _frozen else 'trained'}_stage{_stage}"] = (
            lambda rank, world, stage=_stage, frozen=_frozen: added_param_group(rank, world, stage, frozen))

class Gated(torch.nn.Module):
    """y = head(tanh(a(h) [+ b(h)])): `b` runs only where asked (dynamic control flow)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.emb(x))
        y = self.a(h) + self.b(h) if use_b else self.a(h)
        return self.head(torch.tanh(y))


def uses_b(k: int, r: int) -> bool:
    """Step 0 and 3: every rank; step 1: rank 1 only; step 2: no rank."""
    return {0: True, 1: r == 1, 2: False, 3: True}[k]


def dynamic_control_flow(rank, world, make_opt, stage):
    """A module run in some steps and not others, and on some ranks only: where no rank ran it,
    torch leaves it alone (no momentum step, no weight decay); where one rank did, its gradient
    counts (issue 14, defect 1: it moved under momentum with a zero gradient)."""
    _, diff = parity(rank, world, Gated, lambda m, x, k, r, _: m(x, uses_b(k, r)).pow(2).mean(),
                     inputs(4, world, 4, 8), make_opt, {"stage": stage, "chunk_size": 300})
    return {"diff": diff}


per_optimizer_and_stage(SCENARIOS, "dynamic_control_flow", dynamic_control_flow)


def loss_from_another_model(rank, world, make_opt, stage):
    """engine.backward on a loss that does not come from this engine's forward: no parameter of
    this model gets a gradient, so step() returns False and changes nothing (issue 14, defect 4)."""
    engine = zeroshard.initialize(tiny_gpt2(), make_opt, {"stage": stage, "chunk_size": 20000})
    before = engine.full_state_dict()
    other = torch.nn.Linear(4, 1)
    engine.backward(other(torch.ones(2, 4)).sum())
    applied = engine.step()
    return {"diff": max_diff(engine.full_state_dict(), before), "applied": applied, "steps": engine.steps}


per_optimizer_and_stage(SCENARIOS, "loss_from_another_model", loss_from_another_model)


class OutOfOrder(torch.nn.Module):
    """Three equal layers registered in another order than the forward uses them: chunks pack them
    in the order of use, so a state listed by pieces and read in torch's order (the parameters' own)
    would silently give each layer another's Adam moments."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.last, self.first, self.mid = (torch.nn.Linear(16, 16) for _ in range(3))

    def forward(self, x):
        return self.last(torch.tanh(self.mid(torch.tanh(self.first(x)))))


def _mse(model, x):
    return model(x[..., :16]).sub(x[..., 16:]).pow(2).mean()


def optimizer_state_dicts(rank, world, stage):
    """optimizer.state_dict() and load_state_dict() as a custom loop calls them:
    - a plain torch run's state (2 AdamW steps on the global batch) and model, loaded into a new
      engine before its first forward, trains on as the plain run does;
    - each rank's own optimizer.state_dict() loads back into a new engine of the same layout (the
      same bytes as the engine it came from: the dicts are in memory);
    - rank 0's dict loaded on every rank: what DDP code does; at stage >= 1 above a world of 1 it
      holds rank 0's shard only: CheckpointError on every rank;
    - at stage 0 (and at a world of 1) the engine's dict is torch's own format: a plain torch
      optimizer loads it and trains on as the engine does;
    - engine.full_optimizer_state_dict() (collective) is torch's own format at every stage: the
      plain run's state_dict (groups, keys, values), which plain torch loads."""
    cfg = {"stage": stage, "chunk_size": 300}
    data = inputs(4, world, 3, 32)
    ref, out = OutOfOrder(), {}
    ref_opt = make_adamw(list(ref.parameters()))
    for k, step in enumerate(data):
        if k == 2:
            plain = copy.deepcopy({"model": ref.state_dict(), "optimizer": ref_opt.state_dict()})
        _mse(ref, step.reshape(-1, 32)).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    def engine_from(state, opt_state):
        model = OutOfOrder()
        engine = zeroshard.initialize(model, make_adamw(list(model.parameters())), cfg)
        model.load_state_dict(state)
        engine.optimizer.load_state_dict(opt_state)
        return engine

    def train(engine, steps):
        for step in steps:
            engine.backward(_mse(engine, step[rank]))
            engine.step()
        return engine

    out["plain"] = max_diff(train(engine_from(plain["model"], plain["optimizer"]), data[2:]).full_state_dict(),
                            ref.state_dict())
    model = OutOfOrder()
    straight = train(zeroshard.initialize(model, make_adamw(list(model.parameters())), cfg), data[:2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = copy.deepcopy({"model": straight.full_state_dict(), "optimizer": straight.optimizer.state_dict()})
        straight.optimizer.state_dict()
    out["shard_warnings"] = sum("holds this rank's shard" in str(w.message) for w in caught)
    train(straight, data[2:])
    out["own"] = max_diff(train(engine_from(saved["model"], saved["optimizer"]), data[2:]).full_state_dict(),
                          straight.full_state_dict())
    full, torch_sd = straight.full_optimizer_state_dict(), ref_opt.state_dict()
    out["full_groups"] = full["param_groups"] == torch_sd["param_groups"]
    out["full_keys"] = {i: list(v) for i, v in full["state"].items()} == {i: list(v) for i, v in torch_sd["state"].items()}
    out["full_vs_torch"] = max(max_diff(full["state"][i], v) for i, v in torch_sd["state"].items())
    make_adamw(list(OutOfOrder().parameters())).load_state_dict(full)  # plain torch loads it
    r0, r0_model = straight.full_optimizer_state_dict(rank0_only=True), straight.full_state_dict(rank0_only=True)
    model_sd = straight.full_state_dict()
    out["rank0_only"] = (r0_model == {} and r0 == {}) if rank else (
        max_diff(r0_model, model_sd) == 0.0 and r0["param_groups"] == full["param_groups"]
        and max(max_diff(r0["state"][i], v) for i, v in full["state"].items()) == 0.0)
    # an optimizer callable is handed each rank's pieces: its groups list the model's parameters in order
    built = train(zeroshard.initialize(OutOfOrder(), make_adamw, cfg), data).full_optimizer_state_dict()
    out["full_from_callable"] = (built["param_groups"] == torch_sd["param_groups"]
                                 and max(max_diff(built["state"][i], v) for i, v in torch_sd["state"].items()))
    out["torch_format"] = "zeroshard" not in saved["optimizer"]
    first = every_rank(saved)[0]
    out["rank0"] = error_on_every_rank(lambda: engine_from(first["model"], first["optimizer"]))
    if out["torch_format"]:
        torch_model = OutOfOrder()
        torch_model.load_state_dict(saved["model"])
        torch_opt = make_adamw(list(torch_model.parameters()))
        torch_opt.load_state_dict(saved["optimizer"])
        for step in data[2:]:
            _mse(torch_model, step.reshape(-1, 32)).backward()
            torch_opt.step()
            torch_opt.zero_grad()
        out["into_torch"] = max_diff(torch_model.state_dict(), straight.full_state_dict())
    return out


for _stage in range(4):
    SCENARIOS[f"optimizer_state_dicts_stage{_stage}"] = (
        lambda rank, world, stage=_stage: optimizer_state_dicts(rank, world, stage))


CLIP_TO = 1.25  # plain_loop's max norm: below the first steps' gradient norms at every world size (1.1-2.4)


def plain_loop(rank, world, stage, make_opt, scheduler_first: bool):
    """The loop plain PyTorch code writes, unchanged but for initialize: `loss.backward();
    optimizer.step(); scheduler.step(); optimizer.zero_grad()` on the user's own optimizer and the
    wrapped model (it used to step nothing: the gradients live in the chunks, not in .grad). The
    LR scheduler is built before initialize or after it (torch's scheduler wraps optimizer.step
    either way). In step 1, optimizer.zero_grad() between two backwards drops the first, as in
    torch. torch.nn.utils.clip_grad_norm_ before the step clips as torch's does (it used to raise:
    the gradients are not in .grad), given the model's parameters (SGD) or the optimizer's (AdamW,
    which lists master pieces); its norms are torch's. optimizer.step(closure) raises EngineCallError on
    every rank, as do a step after .grad set by hand and no backward (it stepped nothing, silently)
    and the step of an optimizer over the model's parameters that initialize was not given (a GAN's
    second: it skipped them, silently); torch's GradScaler (which unscales .grad, where there is
    none) raises GradientsInChunksError."""
    data = batches(4, world, 2, accumulation=2)
    norms = []

    def run(model, opt_of, x_of):
        opt = sched = None
        if scheduler_first:
            opt = make_opt(list(model.parameters()))
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt = opt_of(model, opt)
        sched = sched or torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for k, step in enumerate(data):
            for m in ((0, 1) if k == 1 else (0,)):
                if m == 1:
                    opt.zero_grad()
                loss_of(model, x_of(step[m])).backward()
            given = model.parameters() if make_opt is make_sgd else opt.param_groups[0]["params"]
            norms.append(float(torch.nn.utils.clip_grad_norm_(given, CLIP_TO)))
            opt.step()
            sched.step()
            opt.zero_grad()
        return model, opt

    ref, _ = run(tiny_gpt2(), lambda m, o: (m, o or make_opt(list(m.parameters()))), lambda x: x.reshape(-1, x.shape[-1]))

    def wrap(model, opt):
        engine = zeroshard.initialize(model, opt or make_opt(list(model.parameters())), {"stage": stage, "chunk_size": 20000})
        wrap.engine = engine
        return model, engine.optimizer
    model, opt = run(tiny_gpt2(), wrap, lambda x: x[rank])
    out = {"diff": max_diff(wrap.engine.full_state_dict(), ref.state_dict()), "steps": wrap.engine.steps,
           "norms": norms,
           "closure": error_on_every_rank(lambda: opt.step(lambda: 0.0))}
    before = wrap.engine.full_state_dict()

    def hand_set_step():
        for p in model.parameters():
            p.grad = torch.ones(p.shape)
        opt.step()
    out["hand_set"] = error_on_every_rank(hand_set_step)
    out["hand_set_cleared"] = all(p.grad is None for p in model.parameters())
    out["foreign"] = error_on_every_rank(lambda: torch.optim.SGD(model.parameters(), lr=0.1).step())
    out["unchanged"] = max_diff(wrap.engine.full_state_dict(), before)
    scaler = torch.amp.GradScaler("cpu")

    def scaled_step():
        scaler.scale(loss_of(model, data[0][0][rank])).backward()
        scaler.step(opt)
    out["grad_scaler"] = error_on_every_rank(scaled_step)
    return out


for _stage in range(4):
    SCENARIOS[f"plain_loop_sgd_stage{_stage}"] = (
        lambda rank, world, stage=_stage: plain_loop(rank, world, stage, make_sgd, scheduler_first=True))
    SCENARIOS[f"plain_loop_adamw_stage{_stage}"] = (
        lambda rank, world, stage=_stage: plain_loop(rank, world, stage, make_adamw, scheduler_first=False))
