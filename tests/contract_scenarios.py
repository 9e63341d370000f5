"""Multi-process halves of tests/test_contract.py (issue 14, the PyTorch contract): ordinary PyTorch
training code run through the engine must train what plain PyTorch trains on the global batch.

`run(rank, world, out_path)` runs every scenario on each rank of a spawned group through
scenarios.run_all (rank 0 writes {name: figures} as JSON; a scenario that raises records its error).
"""
from __future__ import annotations

import tempfile

import torch

import zeroshard
from zeroshard.telemetry.stats import chunk_state_bytes
from models import batches, inputs, make_adamw, make_sgd, max_diff, parity, tiny_gpt2
from scenarios import _gather, run_all

SCENARIOS = {}
OPTIMIZERS = {"sgd": make_sgd, "adamw": make_adamw}


def loss_of(m, x):
    return m(input_ids=x, labels=x).loss


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


def _add(name, fn):
    for opt in OPTIMIZERS:
        for stage in range(4):
            SCENARIOS[f"{name}_{opt}_stage{stage}"] = (lambda rank, world, opt=opt, stage=stage:
                                                      fn(rank, world, OPTIMIZERS[opt], stage))


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


_add("two_backwards", two_backwards_per_step)
for _stage in (1, 2, 3):  # the reduced gradient goes to the host after each reduction
    SCENARIOS[f"two_backwards_offload_sgd_stage{_stage}"] = (
        lambda rank, world, stage=_stage: two_backwards_per_step(rank, world, make_sgd, stage,
                                                                 {"offload_optimizer": True}))
_add("step_without_backward", step_without_backward)


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
            "ranks_agree": all(e == mine for e in _gather(mine, world)),
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


def untrainable(rank, world, stage):
    """Models zeroshard would otherwise change without a word (a float64, complex or integer
    parameter) or cannot reduce (sparse gradients): initialize raises UnsupportedModelError on every
    rank, before any collective, and leaves the model as it was."""
    from distributed import error_on_every_rank
    out = {}
    for kind in ("float64", "complex", "integer", "sparse"):
        model = _Untrainable(kind)
        before = {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
        out[kind] = {"raised": error_on_every_rank(lambda: zeroshard.initialize(model, make_sgd, {"stage": stage})),
                     "unchanged": before == {n: (p.dtype, p.data_ptr()) for n, p in model.named_parameters()}
                     and type(model) is _Untrainable}
    return out


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _write_between_steps(model, k):
    """What users write into parameters between steps: a row set by hand after the first step,
    every parameter clipped (as WGAN clips its critic) after the second."""
    with torch.no_grad():
        if k == 0:
            model[0].weight[0].fill_(0.5)
        if k == 1:
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)


def written_between_steps(rank, world, cfg):
    """Writes into parameters between steps survive the next step as in plain PyTorch, also where
    the parameters are a copy of the fp32 masters (16-bit training, an offloaded optimizer:
    optim/user_writes.py)."""
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(2 * world, 8, generator=g) for _ in range(3)]
    ref = _mlp()
    ref_opt = make_sgd(ref.parameters())
    model = _mlp()
    engine = zeroshard.initialize(model, make_sgd, cfg)
    for k, x in enumerate(data):
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(x.chunk(world)[rank]).float().pow(2).mean())
        engine.step()
        _write_between_steps(ref, k)
        _write_between_steps(model, k)
    got = engine.full_state_dict()
    return {"diff": max(float((got[n].float() - p).abs().max()) for n, p in ref.state_dict().items())}


for _name, _cfg in {"fp32_stage0": {"stage": 0}, "bf16_stage0": {"stage": 0, "precision": "bf16"},
                    "bf16_stage2": {"stage": 2, "precision": "bf16"},
                    "fp32_stage1_offload": {"stage": 1, "offload_optimizer": True},
                    "bf16_stage2_offload": {"stage": 2, "precision": "bf16", "offload_optimizer": True}}.items():
    SCENARIOS[f"written_between_steps_{_name}"] = lambda rank, world, cfg=_cfg: written_between_steps(rank, world, cfg)

for _stage in (0, 3):
    SCENARIOS[f"untrainable_stage{_stage}"] = lambda rank, world, stage=_stage: untrainable(rank, world, stage)

for _stage in range(4):  # last: at stage 3 it ends in DivergedError
    SCENARIOS[f"first_forward_differs_stage{_stage}"] = lambda rank, world, stage=_stage: first_forward_differs(
        rank, world, stage)


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)


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


def requires_grad_changes(rank, world, make_opt, stage, when):
    """A parameter frozen after initialize: 'before_forward' (while the first forward records the
    order of first use), then unfrozen after 2 steps; or 'after_steps' (frozen after 2 steps of
    training). torch does not step a parameter whose .grad is None: no momentum, no weight decay
    (issue 14, defect 1: it landed in a frozen chunk for good, or kept moving under Adam)."""
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
    engine = zeroshard.initialize(model, make_opt, {"stage": stage, "chunk_size": 20000})
    for k, step in enumerate(data):
        flip(p, k)
        engine.backward(loss_of(engine, step[0, rank]))
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict())}


for _when in ("before_forward", "after_steps"):
    for _stage in range(4):
        SCENARIOS[f"requires_grad_{_when}_stage{_stage}"] = (
            lambda rank, world, stage=_stage, when=_when: requires_grad_changes(rank, world, make_adamw, stage, when))


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


_add("dynamic_control_flow", dynamic_control_flow)


def loss_from_another_model(rank, world, make_opt, stage):
    """engine.backward on a loss that does not come from this engine's forward: no parameter of
    this model gets a gradient, so step() returns False and changes nothing (issue 14, defect 4)."""
    engine = zeroshard.initialize(tiny_gpt2(), make_opt, {"stage": stage, "chunk_size": 20000})
    before = engine.full_state_dict()
    other = torch.nn.Linear(4, 1)
    engine.backward(other(torch.ones(2, 4)).sum())
    applied = engine.step()
    return {"diff": max_diff(engine.full_state_dict(), before), "applied": applied, "steps": engine.steps}


_add("loss_from_another_model", loss_from_another_model)


# -- loading a state dict into the wrapped model -------------------------------------------------------
def load_state_dict_after_wrapping(rank, world, stage, extra=None):
    """model.load_state_dict(sd) after initialize, in bf16, once training has started: the fp32
    masters take sd's values exactly (full_state_dict shows them), and training goes on from them:
    equal, bit for bit, to an engine built on a model that had sd from the start (plain SGD, so no
    optimizer state differs). Issue 14, defect 5: only the 16-bit copies changed; the next step
    overwrote them from the old masters."""
    cfg = {"stage": stage, "precision": "bf16", "chunk_size": 20000, **(extra or {})}
    data = batches(3, world, 2)
    sd = tiny_gpt2(seed=1).state_dict()
    plain_sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    model = tiny_gpt2()
    engine = zeroshard.initialize(model, plain_sgd, cfg)
    engine.backward(loss_of(engine, data[0, 0, rank]))
    engine.step()
    model.load_state_dict(sd)
    loaded = max_diff(engine.full_state_dict(), sd)
    fresh = zeroshard.initialize(tiny_gpt2(seed=1), plain_sgd, cfg)
    for step in data[1:]:
        for e in (engine, fresh):
            e.backward(loss_of(e, step[0, rank]))
            e.step()
    return {"loaded": loaded, "diff": max_diff(engine.full_state_dict(), fresh.full_state_dict())}


for _stage in range(4):
    SCENARIOS[f"load_state_dict_stage{_stage}"] = (lambda rank, world, stage=_stage:
                                                   load_state_dict_after_wrapping(rank, world, stage))
for _stage in (2, 3):
    SCENARIOS[f"load_state_dict_offload_stage{_stage}"] = (lambda rank, world, stage=_stage:
                                                           load_state_dict_after_wrapping(
                                                               rank, world, stage, {"offload_optimizer": True}))
SCENARIOS["load_state_dict_offload_params_stage3"] = lambda rank, world: load_state_dict_after_wrapping(
    rank, world, 3, {"offload_optimizer": True, "offload_params": True})


# -- stage 3: a parameter that leaves its module's forward ------------------------------------------------
class ReturnsWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self):
        return self.weight


class UsesReturnedWeight(torch.nn.Module):
    """A child's forward returns its parameter and the parent uses it after other modules ran (the
    child's chunk evicted from a one-chunk rCache by then)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.child = ReturnsWeight()
        self.lin = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        w = self.child()
        h = torch.tanh(self.lin(x))
        return self.head(h @ w)


def returned_parameter(rank, world, make_opt, stage):
    """Issue 14, defect 7: at stage 3 with cache_chunks=1 the parent got "size of tensor a (16) must
    match the size of tensor b (0)" (the child's chunk was released): it trains as in torch."""
    cfg = {"stage": stage, "chunk_size": 256, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, diff = parity(rank, world, UsesReturnedWeight, lambda m, x, *_: m(x).pow(2).mean(),
                          inputs(3, world, 4, 16), make_opt, cfg)
    return {"diff": diff, "chunks": len(engine.chunks)}


_add("returned_parameter", returned_parameter)


class Encoder(torch.nn.Module):
    """nn.TransformerEncoderLayer, whose nn.MultiheadAttention reads out_proj.weight and .bias in
    its own forward without calling out_proj."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(8, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layer(self.emb(x)))


def multihead_attention(rank, world, make_opt, stage):
    """Issue 14, defect 8: at stage 3 nn.MultiheadAttention (hence nn.Transformer*) failed with
    ShardedParameterError: out_proj's parameters are read outside out_proj's forward. A parameter a
    module reads from a submodule that never runs is gathered with the reading module."""
    data = inputs(3, world, 2, 5, 8)
    cfg = {"stage": stage, "chunk_size": 600, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, diff = parity(rank, world, Encoder, lambda m, x, *_: m(x).pow(2).mean(), data, make_opt, cfg)
    engine.eval()
    with torch.no_grad():
        evaluated = engine(data[0, rank])
    return {"diff": diff, "chunks": len(engine.chunks), "eval_finite": bool(torch.isfinite(evaluated).all())}


for _stage in range(4):
    SCENARIOS[f"multihead_attention_sgd_stage{_stage}"] = (lambda rank, world, stage=_stage:
                                                           multihead_attention(rank, world, make_sgd, stage))
    # eps 1e-6: this tiny model's second moments are small enough that eps 1e-8 magnifies the ranks'
    # summation order past the AdamW tolerance (6e-5 at world 2 at stage 0, DDP's own reduction).
    SCENARIOS[f"multihead_attention_adamw_stage{_stage}"] = (lambda rank, world, stage=_stage: multihead_attention(
        rank, world, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6, weight_decay=0.01), stage))


# -- the module's own API on the wrapped model ------------------------------------------------------------
def module_api(rank, world, stage):
    """Issue 14, defect 9: on the wrapped model, at every stage (bf16): model.zero_grad() and
    p.requires_grad_(False) through model.named_parameters() work (the frozen parameter is not
    stepped again, as in torch); inside `engine.full_parameters()` model.state_dict() holds the full
    fp32 values, save_pretrained writes a checkpoint from_pretrained reads back, and an in-place edit
    is written back to the masters (training then goes on from it, equal to an engine built on the
    edited model). Stage 3 raised ShardedParameterError on each of these."""
    from transformers import GPT2LMHeadModel
    cfg = {"stage": stage, "precision": "bf16", "chunk_size": 20000}
    plain_sgd = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731
    data = batches(3, world, 2)
    model = tiny_gpt2()
    engine = zeroshard.initialize(model, plain_sgd, cfg)
    model.zero_grad()
    frozen = dict(model.named_parameters())["transformer.h.0.mlp.c_fc.weight"]
    frozen.requires_grad_(False)
    before = engine.full_state_dict()
    engine.backward(loss_of(engine, data[0, 0, rank]))
    engine.step()
    after = engine.full_state_dict()
    out = {"frozen_kept": torch.equal(before["transformer.h.0.mlp.c_fc.weight"], after["transformer.h.0.mlp.c_fc.weight"]),
           "others_moved": not torch.equal(before["lm_head.weight"], after["lm_head.weight"])}
    root = _gather(tempfile.mkdtemp() if rank == 0 else None, world)[0]
    with engine.full_parameters():
        sd = model.state_dict()
        out["state_dict_equal"] = max_diff({k: v for k, v in sd.items()}, after) == 0.0
        if rank == 0:
            model.save_pretrained(root)
        with torch.no_grad():
            model.transformer.wte.weight.mul_(0.5)
        edited = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _gather(None, world)  # rank 0 has written it
    out["pretrained_equal"] = max_diff(GPT2LMHeadModel.from_pretrained(root).state_dict(), after) == 0.0
    out["written_back"] = max_diff(engine.full_state_dict(), edited) == 0.0
    fresh_model = tiny_gpt2()
    fresh_model.load_state_dict(edited)
    fresh_model.get_parameter("transformer.h.0.mlp.c_fc.weight").requires_grad_(False)
    fresh = zeroshard.initialize(fresh_model, plain_sgd, cfg)
    for step in data[1:]:
        for e in (engine, fresh):
            e.backward(loss_of(e, step[0, rank]))
            e.step()
    # A parameter frozen at initialize keeps only its 16-bit copy (no fp32 master): compare it rounded.
    a, b = engine.full_state_dict(), fresh.full_state_dict()
    name = "transformer.h.0.mlp.c_fc.weight"
    out["diff"] = max_diff({k: v for k, v in a.items() if k != name}, {k: v for k, v in b.items() if k != name})
    out["frozen_equal"] = torch.equal(a[name].bfloat16(), b[name].bfloat16())
    return out


for _stage in range(4):
    SCENARIOS[f"module_api_stage{_stage}"] = lambda rank, world, stage=_stage: module_api(rank, world, stage)


# -- 16-bit precision with fp32 buffers and activations -------------------------------------------------------
class Mixed(torch.nn.Module):
    """BatchNorm (fp32 running statistics), an fp32 buffer added to an activation, and an fp32
    tensor made inside the forward that turns the activation passed to the next layer into fp32."""

    def __init__(self, batchnorm=True):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8) if batchnorm else torch.nn.Identity()
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 8))
        self.l2 = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.bn(self.l1(x)) + self.shift
        h = torch.tanh(self.l2(h)) * torch.ones(8)  # fp32 ones: the product is fp32 under bf16
        return self.head(h)


def precision_policy(rank, world, precision, stage, extra=None):
    """Issue 14, defect 6: under bf16/fp16 a BatchNorm failed ("expected scalar type BFloat16 but
    found Float"), as did an fp32 buffer added to an activation and an fp32 activation passed into a
    layer. Floating buffers now follow the compute dtype (buffer_dtype='compute', as model.to(dtype)
    does; 'fp32' keeps them) and every module with parameters casts its floating inputs
    (cast_forward_inputs). Compared with fp32 torch on the global batch at world 1 (BatchNorm
    statistics are per rank, as under DDP): 16-bit tolerance 2e-2 after 3 SGD steps."""
    g = torch.Generator().manual_seed(5)
    data = torch.randn(3, world, 8, 6, generator=g)
    batchnorm = (extra or {}).get("buffer_dtype") != "fp32"  # fp32 statistics need fp32 BatchNorm parameters
    ref = Mixed(batchnorm)
    opt = make_sgd(list(ref.parameters()))
    for step in data:
        if world == 1:
            ref(step[0]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    engine = zeroshard.initialize(Mixed(batchnorm), make_sgd, {"stage": stage, "precision": precision,
                                                               "chunk_size": 64, **(extra or {}),
                                                               # fp16: a scale no step overflows at
                                                               **({"initial_loss_scale": 256} if precision == "fp16" else {})})
    for step in data:
        engine.backward(engine(step[rank]).pow(2).mean())
        engine.step()
    sd = engine.full_state_dict()
    return {"diff": max_diff(sd, ref.state_dict()) if world == 1 else None, "steps": engine.steps,
            "finite": all(bool(torch.isfinite(v.float()).all()) for v in sd.values()),
            "buffer_dtype": str(engine.module.shift.dtype),
            "grad_bytes": sum(b for c in engine.chunks for kind, _, b in chunk_state_bytes(c) if kind == "grads")}


for _precision in ("bf16", "fp16"):
    for _stage in range(4):
        SCENARIOS[f"precision_{_precision}_stage{_stage}"] = (lambda rank, world, p=_precision, stage=_stage:
                                                              precision_policy(rank, world, p, stage))
for _stage in (2, 3):
    SCENARIOS[f"precision_fp32_buffers_fp32_reduce_stage{_stage}"] = (
        lambda rank, world, stage=_stage: precision_policy(rank, world, "bf16", stage,
                                                           {"buffer_dtype": "fp32", "reduce_dtype": "fp32"}))


def zero_grad_mid_window(rank, world, make_opt, stage):
    """model.zero_grad() between the micro-batches of one accumulation window drops what was
    accumulated, as optimizer.zero_grad() does in torch (a skipped batch); engine.zero_grad() is the
    same call. It was a no-op: the dropped micro-batch was still applied."""
    data = batches(2, world, 2, accumulation=2)
    ref = tiny_gpt2()
    opt = make_opt(list(ref.parameters()))
    for step in data:
        for m, micro in enumerate(step):
            if m == 1:
                opt.zero_grad()
            (loss_of(ref, micro.reshape(-1, micro.shape[-1])) / 2).backward()
        opt.step()
        opt.zero_grad()
    model = tiny_gpt2()
    engine = zeroshard.initialize(model, make_opt, {"stage": stage, "chunk_size": 20000,
                                                    "gradient_accumulation_steps": 2})
    for step in data:
        for m, micro in enumerate(step):
            if m == 1:
                model.zero_grad()
            engine.backward(loss_of(engine, micro[rank]))
        engine.step()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict())}


for _stage in range(4):
    SCENARIOS[f"zero_grad_mid_window_sgd_stage{_stage}"] = (lambda rank, world, stage=_stage:
                                                            zero_grad_mid_window(rank, world, make_sgd, stage))
    # eps 1e-6: after two steps on half the data the second moments are small enough that eps 1e-8
    # magnifies the ranks' summation order past the AdamW tolerance (6e-5 at world 3, stage 0 too).
    SCENARIOS[f"zero_grad_mid_window_adamw_stage{_stage}"] = (lambda rank, world, stage=_stage: zero_grad_mid_window(
        rank, world, lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6, weight_decay=0.01), stage))
