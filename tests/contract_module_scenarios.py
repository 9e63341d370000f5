"""Contract scenarios on the wrapped model as a torch.nn.Module (contract_scenarios.py):
load_state_dict after initialize, a parameter a forward returns, nn.MultiheadAttention, parameters
read outside every forward (CLIP's contrastive loop, an EMA copy), custom autograd Functions given
parameters, torch.func.functional_call, the module's own API, 16-bit precision with fp32 buffers and activations, and model.zero_grad()
within an accumulation window.
"""
from __future__ import annotations


import torch

import zeroshard
from zeroshard.telemetry.stats import chunk_state_bytes
from contract_common import loss_of, per_optimizer_and_stage
from distributed import error_on_every_rank, every_rank, shared_temp_dir
from models import batches, inputs, make_sgd, max_diff, parity, tiny_gpt2

SCENARIOS = {}


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


per_optimizer_and_stage(SCENARIOS, "returned_parameter", returned_parameter)


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


# -- stage 3: parameters read outside every forward -----------------------------------------------------------
class TwoTowers(torch.nn.Module):
    """Trained as contrastive loops train CLIP (open_clip's): each tower through a method other than
    forward, one of which reads the model's own parameter, and a loss that reads the model's
    logit_scale itself, outside every forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.text, self.image = torch.nn.Linear(8, 16), torch.nn.Linear(6, 16)
        self.image_scale = torch.nn.Parameter(torch.tensor(1.5))
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))

    def encode_text(self, x):
        return torch.nn.functional.normalize(self.text(x), dim=-1)

    def encode_image(self, x):
        return torch.nn.functional.normalize(self.image(x), dim=-1) * self.image_scale


def _contrastive(m, x, *_):
    t, i = m.encode_text(x[:, :8]), m.encode_image(x[:, 8:])
    logits = m.logit_scale.exp() * t @ i.T
    y = torch.arange(len(x))
    return (torch.nn.functional.cross_entropy(logits, y) + torch.nn.functional.cross_entropy(logits.T, y)) / 2


def read_outside_forward(rank, world, make_opt, stage):
    """At stage 3 CLIP's contrastive loop raised ShardedParameterError (logit_scale read by the
    loss, image_scale by a method other than forward): it trains as in torch. So does reading every
    parameter between steps (an EMA copy: the model's values), and a write into one there lasts
    (runtime/param_writes.py), while a write through .data (unseen) raises on every rank."""
    cfg = {"stage": stage, "chunk_size": 200, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, diff = parity(rank, world, TwoTowers, _contrastive, inputs(3, world, 4, 14), make_opt, cfg)
    with torch.no_grad():
        copied = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out = {"diff": diff, "chunks": len(engine.chunks), "copied": max_diff(copied, engine.full_state_dict())}
    if stage == 3:
        out["write"] = error_on_every_rank(lambda: engine.module.text.weight.data.clamp_(-0.01, 0.01))
        out["unchanged"] = max_diff(copied, engine.full_state_dict())
    with torch.no_grad():
        engine.module.logit_scale.mul_(2)
    out["doubled"] = float(engine.full_state_dict()["logit_scale"] - 2 * copied["logit_scale"])
    return out


per_optimizer_and_stage(SCENARIOS, "read_outside_forward", read_outside_forward)


# -- custom autograd Functions given parameters ---------------------------------------------------------------
class _LinearFn(torch.autograd.Function):
    """A fused kernel's shape (a linear cross-entropy given lm_head.weight): parameters as inputs."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return x @ w.t() + b

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]).sum(0)


class _ScaleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s, (g * x).sum().reshape(s.shape)


class FusedHead(torch.nn.Module):
    """The head applied by a custom Function in the model's forward (the head module never runs), a
    Function scaling by a parameter that starts frozen, and a scale the loss applies by one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.late = torch.nn.Parameter(torch.tensor(0.7), requires_grad=False)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return _ScaleFn.apply(_LinearFn.apply(torch.tanh(self.body(x)), self.head.weight, self.head.bias), self.late)


def _through_functions(m, x, step, *_):
    if step == 1:  # unfrozen: its gradient comes through a Function from now on
        getattr(m, "module", m).late.requires_grad_(True)
    return _ScaleFn.apply(m(x), getattr(m, "module", m).scale).pow(2).mean()


def custom_function(rank, world, make_opt, stage):
    """A custom torch.autograd.Function given a parameter outside the forward of the module owning
    it (the model's forward applying a fused head to head.weight, the loss scaling by the model's
    scale) trains as in torch. At stage 3 the Function got the placeholder (apply is below
    __torch_function__) and autograd accumulated the gradient there: those parameters silently
    trained on nothing (placeholder.py's Note: gradients past the placeholder). The reads inside
    the Functions (under no_grad) and in their backward follow stage 3's recorded schedule: no
    departures (4 a step from the third on, when those were left out of the recording)."""
    cfg = {"stage": stage, "chunk_size": 100, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, diff = parity(rank, world, FusedHead, _through_functions, inputs(3, world, 4, 8), make_opt, cfg)
    start = FusedHead().state_dict()
    full = engine.full_state_dict()
    return {"diff": diff, "chunks": len(engine.chunks), "departures": engine.stats().get("schedule_departures"),
            "moved": min(float((full[k] - start[k]).abs().max()) for k in ("head.weight", "head.bias", "scale", "late"))}


per_optimizer_and_stage(SCENARIOS, "custom_function", custom_function)


# -- torch.func.functional_call with tensors of the call's own --------------------------------------------------
class ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = torch.nn.Linear(8, 12), torch.nn.Linear(12, 12), torch.nn.Linear(12, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _perturbed(through_engine: bool):
    def loss(m, x, *_):
        if not through_engine:  # the engine's loss_of gets the engine: call its module
            m = getattr(m, "module", m)
        params = {n: p * 1.1 if f".{n}".endswith((".b.weight", ".b.bias")) else p for n, p in m.named_parameters()}
        return torch.func.functional_call(m, params, (x,)).pow(2).mean()
    return loss


def functional_call(rank, world, make_opt, stage):
    """torch.func.functional_call with some parameters replaced by tensors computed from them (weight
    perturbation, MAML's inner step), on the wrapped model and on the engine, from the first forward
    on, trains as in torch. Stage 3 put the real parameters over the call's tensors and computed
    the unperturbed model, silently (1.6e-3 off after 3 steps); on the engine at stages 0-2 the
    first forward recorded the call's tensors as the order of first use (a raw KeyError)."""
    cfg = {"stage": stage, "chunk_size": 100, **({"cache_chunks": 1} if stage == 3 else {})}
    out = {}
    for where in ("module", "engine"):
        engine, out[where] = parity(rank, world, ThreeLayers, _perturbed(where == "engine"), inputs(3, world, 4, 8),
                                    make_opt, cfg)
        out["chunks"] = len(engine.chunks)
    return out


per_optimizer_and_stage(SCENARIOS, "functional_call", functional_call)


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
    root = shared_temp_dir()
    with engine.full_parameters():
        sd = model.state_dict()
        out["state_dict_equal"] = max_diff({k: v for k, v in sd.items()}, after) == 0.0
        if rank == 0:
            model.save_pretrained(root)
        with torch.no_grad():
            model.transformer.wte.weight.mul_(0.5)
        edited = {k: v.detach().clone() for k, v in model.state_dict().items()}
    every_rank(None)  # rank 0 has written it
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
