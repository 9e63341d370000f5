"""Multi-process halves of tests/test_pretrained.py (issue 15): models built on the meta device,
pretrained weights streamed in (`weights=`, `load_weights`) and out (`save_pretrained`).

`run(rank, world, out_path)` runs every scenario on each rank of a spawned group (rank 0 writes
{name: figures} as JSON next to the folders the scenarios save; a scenario that raises records its
error).

This module holds the registry, SCENARIOS: its own scenarios, on models built on the meta device
(their values and training, initialisers, buffers), then pretrained_weights_scenarios'
(weight files in and out); pretrained_common holds what they share.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

import zeroshard
import pretrained_weights_scenarios
from models import batches, digest, make_sgd, max_diff
from distributed import error_on_every_rank, every_rank
from pretrained_common import (_ROOT, ARCHS, SMALL_CHUNKS, _equal_to_files, _files, _train, build, folder,
                               loss_of)
from scenarios import run_all

SCENARIOS = {}


def meta_init(rank, world, arch, stage):
    """A model built on the meta device: its values (digest; identical at every world size, stage
    and chunk size), their statistics, and training from them equals training the same model built
    normally and given those values (the engine, zero difference) and plain PyTorch (SGD, 1e-5)."""
    cfg = {"stage": stage, "chunk_size": SMALL_CHUNKS}
    engine = zeroshard.initialize(build(arch, meta=True), make_sgd, cfg)
    start = engine.full_state_dict()
    out = {"digest": digest(start), "params_on_meta": sum(p.is_meta for p in engine.module.parameters()),
           "stats": {k: [v.float().mean().item(), v.float().std().item() if v.numel() > 1 else 0.0, v.numel()]
                     for k, v in start.items()}}
    if stage == 3:  # another chunk size (one chunk) gives the same values
        other = zeroshard.initialize(build(arch, meta=True), make_sgd, {"stage": 3})
        out["digest_one_chunk"] = digest(other.full_state_dict())
        del other
    data = batches(2, world, 1, vocab=96, seq=16)
    normal = build(arch, meta=False)
    normal.load_state_dict(start)
    ref = build(arch, meta=False)
    ref.load_state_dict(start)
    normal_engine = zeroshard.initialize(normal, make_sgd, cfg)
    _train(engine, data, rank)
    _train(normal_engine, data, rank)
    opt = make_sgd(list(ref.parameters()))
    for step in data:
        loss_of(ref, step[0].reshape(-1, step.shape[-1])).backward()
        opt.step()
        opt.zero_grad()
    trained = engine.full_state_dict()
    out["vs_normal"] = max_diff(trained, normal_engine.full_state_dict())
    out["vs_torch"] = max_diff(trained, ref.state_dict())
    return out


for _arch in ARCHS:
    for _stage in range(4):
        SCENARIOS[f"meta_{_arch}_stage{_stage}"] = (lambda rank, world, a=_arch, s=_stage: meta_init(rank, world, a, s))

class Custom(nn.Module):
    """A module that fills a parameter and a buffer in its constructor, with no reset_parameters:
    the meta device cannot replay that."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    def forward(self, x):
        return (self.lin(x) * self.scale) @ self.mask


def custom_init(module):
    if isinstance(module, Custom):
        module.scale.data.fill_(2.0)
        module.mask.copy_(torch.tril(torch.ones(4, 4)))


def uninitialised(rank, world):
    """A tensor no initialiser writes: UninitializedTensorError on every rank, naming it; init_fn
    (which then replaces every module's own initialiser) or weights from a file fix it."""
    def meta_custom():
        with torch.device("meta"):
            return Custom()
    out = {"plain": error_on_every_rank(lambda: zeroshard.initialize(meta_custom(), make_sgd, {"stage": 3}))}

    def init_fn(m):
        custom_init(m)
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    e = zeroshard.initialize(meta_custom(), make_sgd, {"stage": 3}, init_fn=init_fn)
    sd = e.full_state_dict()
    out["init_fn"] = bool(torch.equal(sd["scale"], torch.full((4,), 2.0)) and torch.equal(sd["mask"], torch.tril(torch.ones(4, 4))))
    path = folder("custom")
    if rank == 0:
        from safetensors.torch import save_file
        torch.manual_seed(0)
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in Custom().state_dict().items()}, os.path.join(path, "model.safetensors"))
    every_rank(None)
    e = zeroshard.initialize(meta_custom(), make_sgd, {"stage": 2}, weights=path)
    out["weights"] = _equal_to_files(e.full_state_dict(), _files(path))
    return out


SCENARIOS["uninitialised"] = uninitialised


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        h = self.bn(self.lin(x))
        return self.attn(h[:, None], h[:, None], h[:, None])[0].sum()


def buffers(rank, world):
    """Buffers of a meta model come out as the normal constructor makes them: BatchNorm's running
    statistics and counter, Llama's rotary frequencies (computed, so equal bit for bit); the
    MultiheadAttention's packed projection is initialised by its own _reset_parameters. Persistent
    buffers are saved and loaded with the parameters; BatchNorm's reset_parameters, run to initialise
    its weight (missing from the file), does not overwrite running statistics the file gave."""
    from safetensors.torch import save_file
    with torch.device("meta"):
        m = Norms()
    e = zeroshard.initialize(m, make_sgd, {"stage": 3})
    sd = e.full_state_dict()
    normal = Norms().state_dict()
    out = {"bn": all(torch.equal(sd[k], normal[k]) for k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
                                                              "bn.weight", "bn.bias", "attn.in_proj_bias")),
           "attn_in_proj_std": sd["attn.in_proj_weight"].std().item()}
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    e.backward(e(x))  # training mode: the running statistics move
    e.step()
    trained = e.full_state_dict()
    path = folder("norms")
    e.save_pretrained(path)
    files = _files(path)
    out["saved_keys"], out["state_keys"] = sorted(files), sorted(trained)
    out["saved_equal"] = _equal_to_files(trained, files)
    with torch.device("meta"):
        m = Norms()
    out["weights_equal"] = _equal_to_files(zeroshard.initialize(m, make_sgd, {"stage": 2}, weights=path).full_state_dict(),
                                           files)
    later = zeroshard.initialize(Norms(), make_sgd, {"stage": 1})
    later.load_weights(path)
    out["load_weights_equal"] = _equal_to_files(later.full_state_dict(), files)
    partial = folder("norms_partial")
    if rank == 0:
        os.makedirs(partial, exist_ok=True)
        save_file({k: v for k, v in files.items() if k != "bn.weight"}, os.path.join(partial, "model.safetensors"))
    every_rank(None)
    with torch.device("meta"):
        m = Norms()
    got = zeroshard.initialize(m, make_sgd, {"stage": 3}, weights=partial).full_state_dict()
    out["running_stats_from_file"] = all(torch.equal(got[k], files[k]) for k in ("bn.running_mean", "bn.running_var"))
    out["running_stats_from_file"] &= bool(torch.equal(got["bn.weight"], torch.ones(6)))
    llama = zeroshard.initialize(build("llama", meta=True), make_sgd, {"stage": 3})
    ref = build("llama", meta=False)
    got = dict(llama.module.named_buffers())
    out["rotary"] = all(torch.equal(got[k].cpu(), v) for k, v in ref.named_buffers())
    out["rotary_names"] = sorted(got)
    return out


SCENARIOS["buffers"] = buffers


def stage3_frees_model(rank, world):
    """A model built normally: after a stage-3 initialize its parameters hold no storage of their own."""
    model = build("gpt2", meta=False)
    before = sum(p.numel() for p in model.parameters())
    engine = zeroshard.initialize(model, make_sgd, {"stage": 3, "chunk_size": SMALL_CHUNKS})
    return {"elements_before": before, "elements_left": sum(p.numel() for p in engine.params)}


SCENARIOS["stage3_frees_model"] = stage3_frees_model

def meta_variants(rank, world):
    """A meta model with a frozen parameter, the optimizer (and parameters) offloaded, bf16: trains
    exactly like the same model built normally with the same values and the same config."""
    out = {}
    for name, cfg in (("offload_bf16_stage2", {"stage": 2, "offload_optimizer": True, "precision": "bf16"}),
                      ("offload_all_stage3", {"stage": 3, "offload_optimizer": True, "offload_params": True})):
        meta = build("gpt2", meta=True)
        meta.transformer.wpe.weight.requires_grad_(False)
        e = zeroshard.initialize(meta, make_sgd, {**cfg, "chunk_size": SMALL_CHUNKS})
        normal = build("gpt2", meta=False)
        normal.load_state_dict(e.full_state_dict())
        normal.transformer.wpe.weight.requires_grad_(False)
        n = zeroshard.initialize(normal, make_sgd, {**cfg, "chunk_size": SMALL_CHUNKS})
        data = batches(2, world, 1, vocab=96, seq=16)
        _train(e, data, rank)
        _train(n, data, rank)
        out[name] = max_diff(e.full_state_dict(), n.full_state_dict())
    return out


SCENARIOS["meta_variants"] = meta_variants


class Rebinds(nn.Module):
    """reset_parameters replaces the bias Parameter while the weight is being materialised."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 3))
        self.bias = nn.Parameter(torch.empty(3))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)
        self.bias = nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x):
        return x @ self.weight + self.bias


class Scaled(nn.Module):
    """An initialiser that computes from another parameter's value: on meta it cannot."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 3))
        self.gain = nn.Parameter(torch.full((3,), 2.0))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            nn.init.normal_(self.weight)
            self.weight.mul_(self.gain)
            self.gain.fill_(2.0)

    def forward(self, x):
        return x @ self.weight


class Gated(nn.Module):
    """An initialiser that looks at requires_grad."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        if self.weight.requires_grad:
            nn.init.ones_(self.weight)

    def forward(self, x):
        return x * self.weight


def initialiser_isolation(rank, world):
    """Initialisers run on one tensor at a time: what they do to other slots is undone (the module
    keeps its own Parameter objects), a value computed from a tensor still on meta raises rather than
    leave the tensor as it was, and the stand-in looks like the parameter (requires_grad)."""
    with torch.device("meta"):
        m = Rebinds()
    bias = m.bias
    e = zeroshard.initialize(m, make_sgd, {"stage": 3})
    sd = e.full_state_dict()
    out = {"same_bias_object": m._parameters["bias"] is bias or getattr(m._parameters["bias"], "_zs_param", None) is bias,
           "bias": sd["bias"].tolist(), "weight_std": sd["weight"].std().item()}
    with torch.device("meta"):
        scaled = Scaled()
    out["scaled"] = error_on_every_rank(lambda: zeroshard.initialize(scaled, make_sgd, {"stage": 2}))
    with torch.device("meta"):
        gated = Gated()
    out["gated"] = zeroshard.initialize(gated, make_sgd, {"stage": 1}).full_state_dict()["weight"].tolist()
    return out


SCENARIOS["initialiser_isolation"] = initialiser_isolation


SCENARIOS.update(pretrained_weights_scenarios.SCENARIOS)


def run(rank, world, out_path, only=None):
    _ROOT["dir"] = os.path.dirname(out_path)
    run_all(rank, world, out_path, only, registry=SCENARIOS)
