"""Multi-process halves of tests/test_workloads.py (issue 29): workloads real users run that broke.
Each scenario trains through the engine and compares with single-process PyTorch on the global
batch (or, for generation, with the plain model's tokens).

`run(rank, world, out_path)` runs them all in one process group (rank 0 writes {name: figures}).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroshard
from distributed import every_rank
from models import batches, inputs, make_adamw, make_sgd, max_diff, parity, tiny_gpt2
from scenarios import run_all

SCENARIOS = {}
OPTIMIZERS = {"sgd": make_sgd, "adamw": make_adamw}


def adamw_eps6(ps):
    """AdamW with eps 1e-6 where a tiny model's second moments are small enough (a router's, an
    expert's that few tokens reached) that eps 1e-8 magnifies the rounding of the ranks' sums into
    4.9e-5 at world 3, at stage 0 as much as at 3: the sums' order, not the sharding."""
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, eps=1e-6)


# -- a mixture of experts with one module per expert, at stage 3 -------------------------------------------
def switch_transformer():
    """A tiny Switch Transformer (transformers' ModuleDict of experts beside a top-1 router). The
    router's load-balancing loss is off: it is a product of batch means, so the global batch's
    loss is not the mean of the ranks' (with or without zeroshard); capacity covers every token."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=8,
        expert_capacity=64, router_jitter_noise=0.0, dropout_rate=0.0, encoder_sparse_step=1, decoder_sparse_step=1,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return transformers.SwitchTransformersForConditionalGeneration(cfg)


def experts_run(model: nn.Module, marker: str):
    """Names of the submodules (those whose name contains `marker`) that run in the next forward."""
    ran = set()
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: ran.add(n)) for n, m in model.named_modules()
               if marker in n and n.rsplit(".", 1)[-1].startswith(("expert_", "0", "1", "2", "3"))]
    return ran, handles


def switch_moe(rank, world, make_opt, stage):
    """At stage 3, chunks small enough that experts sit in different chunks and a 2-chunk rCache:
    each rank runs only the experts its tokens were routed to, so gathering per module diverged
    (issue 29, defect 1: DivergedError "rank 0 is about to gather chunk 9 ... another rank chunk 10").
    The Switch MLP blocks are found by leaf_modules 'auto' and gathered whole."""
    g = torch.Generator().manual_seed(7)
    x = torch.randint(2, 64, (3, world, 1, 8), generator=g)  # few tokens for 8 experts: some get none
    y = torch.randint(2, 64, (3, world, 1, 6), generator=g)
    ref = switch_transformer()
    opt = make_opt(list(ref.parameters()))
    for k in range(3):
        ref(input_ids=x[k].reshape(-1, 8), labels=y[k].reshape(-1, 6)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model = switch_transformer()
    ran, handles = experts_run(model, "experts.")
    cfg = {"stage": stage, "chunk_size": 4096, **({"cache_chunks": 2} if stage == 3 else {})}
    engine = zeroshard.initialize(model, make_opt, cfg)
    for k in range(3):
        engine.backward(engine(input_ids=x[k, rank], labels=y[k, rank]).loss)
        engine.step()
        if k == 0:
            used = sorted(ran)
            for h in handles:
                h.remove()
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()), "chunks": len(engine.chunks),
            "leaves": sorted({type(m).__name__ for m in engine.leaves}),
            "experts_differ": len({tuple(u) for u in every_rank(used)}) > 1}


for _opt, _make in (("sgd", make_sgd), ("adamw", adamw_eps6)):
    for _stage in range(4):
        SCENARIOS[f"switch_moe_{_opt}_stage{_stage}"] = (lambda rank, world, make=_make, stage=_stage:
                                                        switch_moe(rank, world, make, stage))


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class TopOneMoE(nn.Module):
    """A hand-written mixture of experts: a router and an nn.ModuleList of experts; each token goes
    to its top expert, and only the experts some token picked run."""

    def __init__(self, d, n):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n))

    def forward(self, h):
        weight, pick = self.gate(h).softmax(-1).max(-1)
        out = torch.zeros_like(h)
        for e in sorted(set(pick.tolist())):
            rows = (pick == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, self.experts[e](h[rows]) * weight[rows, None])
        return h + out


class MoEModel(nn.Module):
    """Tokens are routed by their input's largest of the first 4 features (the gates start as 5 x
    the identity), so rank r's data (feature r large) goes mostly to expert r, and expert 3 of each
    block to no one at worlds up to 3."""

    def __init__(self, d=8, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, d)
        self.moe1, self.moe2 = TopOneMoE(d, n), TopOneMoE(d, n)
        self.head = nn.Linear(d, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(d, 8))
            self.inp.bias.zero_()
            for moe in (self.moe1, self.moe2):
                moe.gate.weight.copy_(5 * torch.eye(n, d))

    def forward(self, x):
        return self.head(self.moe2(self.moe1(self.inp(x))))


def routed_data(world, steps=3, tokens=6):
    x = inputs(steps, world, tokens, 8, seed=9) * 0.3
    for r in range(world):
        x[:, r, :, r] += 3.0
    return x


def custom_moe(rank, world, stage, leaf_modules="auto"):
    """A hand-written nn.ModuleList MoE with rank-dependent routing, SGD with momentum: trains as
    single-process PyTorch; an expert no token of any rank picked keeps its values bit for bit
    (torch steps no parameter without a .grad: no momentum step either)."""
    data = routed_data(world)
    ref = MoEModel()
    used_ref, handles = experts_run(ref, "experts.")
    opt = make_sgd(list(ref.parameters()))
    for step in data:
        ref(step.reshape(-1, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    model = MoEModel()
    ran, handles = experts_run(model, "experts.")
    cfg = {"stage": stage, "chunk_size": 160, "leaf_modules": leaf_modules,
           **({"cache_chunks": 2} if stage == 3 else {})}
    engine = zeroshard.initialize(model, make_sgd, cfg)
    for step in data:
        engine.backward(engine(step[rank]).pow(2).mean())
        engine.step()
    for h in handles:
        h.remove()
    full, init = engine.full_state_dict(), MoEModel().state_dict()

    def expert_of(key):  # "moe1.experts.3.fc1.weight" -> "moe1.experts.3"
        head, tail = key.split(".experts.")
        return f"{head}.experts.{tail.split('.')[0]}"
    unused = [k for k in full if ".experts." in k and expert_of(k) not in used_ref]
    return {"diff": max_diff(full, ref.state_dict()), "chunks": len(engine.chunks),
            "leaves": sorted(n for n, m in engine.module.named_modules() if any(m is x for x in engine.leaves)),
            "unused_experts": len(unused), "unused_kept": all(torch.equal(full[k], init[k]) for k in unused),
            "experts_differ": len({tuple(sorted(r)) for r in every_rank(sorted(ran))}) > 1}


for _stage in range(4):
    SCENARIOS[f"custom_moe_stage{_stage}"] = lambda rank, world, stage=_stage: custom_moe(rank, world, stage)
SCENARIOS["custom_moe_by_class_name"] = lambda rank, world: custom_moe(rank, world, 3, ["TopOneMoE"])
SCENARIOS["custom_moe_by_module_name"] = lambda rank, world: custom_moe(rank, world, 3, ["moe1", "moe2"])


class SideBranch(nn.Module):
    """A trainable branch runs first; the MoE block reads the raw input, so no gradient reaches
    its inputs and its backward's end cannot be seen: its chunks complete at the end of backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.side, self.moe, self.head = nn.Linear(8, 8), TopOneMoE(8, 4), nn.Linear(8, 1)
        with torch.no_grad():
            self.moe.gate.weight.copy_(5 * torch.eye(4, 8))

    def forward(self, x):
        return self.head(torch.tanh(self.side(x)) + self.moe(x))


def moe_without_input_gradient(rank, world):
    data = routed_data(world)
    for r in range(world):  # rank r routes to expert 3 - r: the last chunks' experts differ by rank
        data[:, r, :, r] -= 3.0
        data[:, r, :, 3 - r] += 3.0
    _, diff = parity(rank, world, SideBranch, lambda m, x, *_: m(x).pow(2).mean(), data, make_sgd,
                     {"stage": 3, "chunk_size": 160, "cache_chunks": 1})
    return {"diff": diff}


SCENARIOS["moe_without_input_gradient"] = moe_without_input_gradient


class CheckpointedStack(nn.Module):
    """Two layers, each recomputed in backward (non-reentrant activation checkpointing): named as a
    leaf, its layers have no hooks of their own, so a recomputation runs on whatever the leaf's
    entries hold then."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))

    def forward(self, h):
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        return h


def leaf_with_checkpointed_layers(rank, world):
    """Stage 3, a leaf whose submodules are recomputed in backward: the leaf shows its real
    parameters while held in backward (hooks.Stage3Hooks._shows_while_held); before, the
    recomputation met placeholders and raised ShardedParameterError."""
    def build():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(8, 8), CheckpointedStack(), nn.Linear(8, 1))
    loss = lambda m, x, *_: m(x).pow(2).mean()  # noqa: E731
    engine, diff = parity(rank, world, build, loss, inputs(3, world, 4, 8), make_sgd,
                          {"stage": 3, "chunk_size": 64, "leaf_modules": ["CheckpointedStack"]})
    return {"diff": diff, "chunks": len(engine.chunks)}


SCENARIOS["leaf_with_checkpointed_layers"] = leaf_with_checkpointed_layers


def unknown_leaf_module(rank, world):
    """A leaf_modules name that matches no module: ValueError naming it, at initialize."""
    zeroshard.initialize(MoEModel(), make_sgd, {"stage": 3, "leaf_modules": ["auto", "NoSuchBlock"]})
    return {"raised": False}


SCENARIOS["unknown_leaf_module"] = unknown_leaf_module


def moe_auto_plan(rank, world):
    """offload='auto' profiles on the meta device, where routing by data cannot run: a RuntimeError
    saying so on every rank (the plan is made on rank 0; the others wait for it), not torch's raw
    NotImplementedError on rank 0 and a wait on the others."""
    try:
        zeroshard.initialize(MoEModel(), make_sgd, {"stage": "auto", "offload": "auto"},
                             example_inputs=routed_data(1)[0, 0])
        return {"raised": every_rank(None)}
    except RuntimeError as e:
        return {"raised": every_rank(f"{type(e).__name__}: {e}")}


SCENARIOS["moe_auto_plan"] = moe_auto_plan


# -- generate() at stage 3 when ranks stop at different lengths ---------------------------------------------
class Wrapper(nn.Module):
    """A transformers model inside another module, as in a LightningModule."""

    def __init__(self):
        super().__init__()
        self.model = tiny_gpt2()

    def forward(self, **kw):
        return self.model(**kw)


def generate_unequal(rank, world):
    """Stage 3, small chunks, a 1-chunk rCache: every forward gathers, so every rank must run as
    many forwards as the others. Ranks ask for different numbers of new tokens, sample with their
    own seeds and stop at an EOS some reach early (issue 29, defect 2: rank 0 returned, rank 1 died
    with gloo's 'Connection closed by peer'). engine.generate, and the model's own generate inside a
    wrapper module, give each rank exactly the plain model's tokens."""
    plain = tiny_gpt2().eval()
    prompt = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(rank))
    greedy = plain.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(greedy[0, 5 + 1]) if rank == 0 else -1  # rank 0's second new token ends its sequence
    eos = max(every_rank(eos))
    cases = {"greedy": dict(max_new_tokens=3 + 4 * rank, do_sample=False),
             "sampled": dict(max_new_tokens=2 + 3 * rank, do_sample=True, top_k=0, seed=100 + rank),
             "eos": dict(max_new_tokens=8, do_sample=False, eos_token_id=eos)}
    out = {}
    for owner in ("engine", "wrapper"):
        model = tiny_gpt2() if owner == "engine" else Wrapper()
        engine = zeroshard.initialize(model, None, {"stage": 3, "cache_chunks": 1, "chunk_size": 5000})
        engine.eval()
        gen = engine.generate if owner == "engine" else engine.module.model.generate
        for case, kw in cases.items():
            kw = dict(kw)
            seed = kw.pop("seed", None)
            if seed is not None:
                torch.manual_seed(seed)
            want = plain.generate(prompt, pad_token_id=0, **kw)
            if seed is not None:
                torch.manual_seed(seed)
            got = gen(prompt, pad_token_id=0, **kw)
            out[f"{owner}_{case}"] = every_rank(torch.equal(got, want))
            out[f"{owner}_{case}_lengths"] = every_rank(got.shape[1])
    return out


SCENARIOS["generate_unequal_lengths"] = generate_unequal


# -- a returned parameter passed up through an intermediate module ----------------------------------------
class Returned:
    def __init__(self, out, bias):
        self.out, self.bias = out, bias


def make_dangling(form: str):
    """DeepSpeed tests/unit/runtime/zero/test_zero_context_return.py: a Linear that also returns its
    bias (as a tuple, or as a plain object's attribute), inside a Linear that passes the pair on,
    inside a container that adds the bias after both forwards ended."""
    class DanglingBias(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            return (out, self.bias) if form == "tuple" else Returned(out, self.bias)

    class Passes(nn.Linear):
        def __init__(self):
            super().__init__(16, 16)
            self.inner = DanglingBias(16, 16)

        def forward(self, x):
            got = self.inner(super().forward(x))
            return got if form == "tuple" else (got.out, got.bias)

    class Container(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.passes = nn.Linear(16, 16), Passes()

        def forward(self, x):
            out, bias = self.passes(torch.tanh(self.first(x)))
            return out + bias
    return Container


def returned_through_parent(rank, world, make_opt, stage, form):
    """Issue 29, defect 7: at stage 3 with a 1-chunk rCache the container got "size of tensor a (16)
    must match the size of tensor b (0)": the bias's chunk was released before the caller used it."""
    cfg = {"stage": stage, "chunk_size": 300, **({"cache_chunks": 1} if stage == 3 else {})}
    engine, diff = parity(rank, world, make_dangling(form), lambda m, x, *_: m(x).pow(2).mean(),
                          inputs(3, world, 4, 16), make_opt, cfg)
    return {"diff": diff, "chunks": len(engine.chunks)}


for _form in ("tuple", "object"):
    for _opt in OPTIMIZERS:
        for _stage in range(4):
            SCENARIOS[f"returned_{_form}_{_opt}_stage{_stage}"] = (
                lambda rank, world, form=_form, opt=_opt, stage=_stage:
                returned_through_parent(rank, world, OPTIMIZERS[opt], stage, form))


# -- two engines in one process ---------------------------------------------------------------------------
def two_engines(rank, world):
    """Two models trained in turn in one process (a GAN's generator and discriminator; a sweep),
    one at stage 2, one at stage 3: after each stage-2 step its updated chunks are still arriving
    and its guard sees every torch call, including those on the stage-3 model's placeholders
    (issue 29, found beside defect 4: the guard read a placeholder's layout, which refuses any use:
    ShardedParameterError from the Trainer's parameter count). Both train as single-process torch."""
    data = batches(3, world, 2)
    refs = [tiny_gpt2(seed=s) for s in (0, 1)]
    opts = [make_sgd(list(m.parameters())) for m in refs]
    for step in data:
        for m, opt in zip(refs, opts):
            x = step.reshape(-1, step.shape[-1])
            m(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    models = [tiny_gpt2(seed=s) for s in (0, 1)]
    engines = [zeroshard.initialize(m, make_sgd, {"stage": stage, "chunk_size": 20000})
               for m, stage in zip(models, (2, 3))]
    counted = []
    for step in data:
        for e in engines:
            x = step[0, rank]
            e.backward(e(input_ids=x, labels=x).loss)
            e.step()
            counted.append(sum(p.numel() for p in models[1].parameters()))  # what the Trainer counts
    return {"diff": max(max_diff(e.full_state_dict(), m.state_dict()) for e, m in zip(engines, refs)),
            "counted": sorted(set(counted)), "numel": sum(p.numel() for p in refs[1].parameters())}


SCENARIOS["two_engines"] = two_engines


# -- activation offload copies each saved tensor once ----------------------------------------------------
def tiny_llama():
    import transformers
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return m


def offload_copies(rank, world, model_name, stage):
    """offload_activations: a tensor several operations save (the loss's log-probabilities, kept by
    log_softmax and nll_loss; a checkpoint's input) goes to the host once and back once (issue 29,
    defect 3: 1.43x the bytes for the README's checkpointed Llama). Counted in the second step: the
    bytes copied each way against the bytes of the distinct tensors handed to the offload."""
    build = {"gpt2": tiny_gpt2, "llama": tiny_llama}[model_name]
    data = batches(2, world, 2)
    ref = build()
    opt = make_sgd(list(ref.parameters()))
    for step in data:
        x = step.reshape(-1, step.shape[-1])
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    engine = zeroshard.initialize(build(), make_sgd, {"stage": stage, "offload_activations": True, "chunk_size": 20000})
    handed = []

    def counted(t, pack=engine.saved.offload.pack):  # what the offload copies, kept alive: no address reused
        packed = pack(t)
        if packed is not t:
            handed.append(t)
        return packed
    for k, step in enumerate(data):
        if k == 1:
            engine.saved.offload.pack = counted
        x = step[0, rank]
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    distinct = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()): t.nbytes
                for t in handed}
    moved = engine.stats()["transfer_bytes"]
    return {"diff": max_diff(engine.full_state_dict(), ref.state_dict()), "handed": len(handed),
            "distinct_tensors": len(distinct), "distinct_bytes": sum(distinct.values()),
            "d2h": moved["d2h"], "h2d": moved["h2d"], "host": engine.stats()["saved_activation_bytes"]["host"]}


for _model in ("gpt2", "llama"):
    for _stage in (2, 3):
        SCENARIOS[f"offload_copies_{_model}_stage{_stage}"] = (lambda rank, world, m=_model, stage=_stage:
                                                               offload_copies(rank, world, m, stage))

# Last: it ends in DivergedError, after which this world's engines start afresh.
SCENARIOS["custom_moe_without_leaves"] = lambda rank, world: custom_moe(rank, world, 3, [])


def run(rank, world, out_path, only=None):
    run_all(rank, world, out_path, only, registry=SCENARIOS)
