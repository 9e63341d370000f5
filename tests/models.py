"""Small models and the single-process reference that every configuration must reproduce."""
from __future__ import annotations

import torch

CUDA = torch.cuda.is_available()  # the engine then trains on the GPU (default device), the reference on the CPU
# fp32 AdamW against the CPU reference. AdamW divides by sqrt(second moment) and magnifies rounding
# where that is tiny: ranks (and, on CUDA, cuBLAS kernels) sum in another order than the CPU
# reference does, and an element whose gradient is at rounding level (tiny GPT-2's first attention
# weights at initialization) moves by up to lr a step whichever way the rounding points. torch DDP
# itself lands ~1e-5 away on an AMD EPYC and 4.4e-5 away at world 3 on an Intel Xeon
# (test_parity.py's test_ddp_reference_point: the 3e-5 this bound was on the CPU failed DDP itself
# there, and zeroshard's runs at 4.2e-5 to 5.7e-5); on an H100 a checkpoint resumed at world 3
# landed 4.2e-5 away (issue 19). SGD is linear in the gradient and stays within 1e-5 everywhere.
ADAMW_TOL = 1e-4
TOL = {"sgd": 1e-5, "adamw": ADAMW_TOL}  # fp32 SGD with momentum is linear in the gradient: 1e-5
# Offloaded runs equal runs without offload bit for bit where both optimizers run the same kernel
# on the same kind of processor (the CPU). On CUDA the offloaded step runs on the host and the other
# on the GPU, so they agree to the parity tolerances instead.
OFFLOAD_EXACT = not CUDA


def tiny_gpt2(n_layer=2, n_embd=64, vocab=128, positions=32, seed=0):
    """GPT-2 with tied input/output embeddings, dropout off, built from a config (no download)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def batches(steps, world, micro, accumulation=1, batch=2, seq=32, vocab=128, seed=1234):
    """Token ids [steps, accumulation, world, batch, seq]: rank r trains on [:, :, r]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, accumulation, world, batch, seq), generator=g)


def make_adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)


def make_sgd(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def reference(model, data, make_opt, clip=None, loss_fn=None):
    """Plain single-process PyTorch on the global batch: every rank's and every micro-batch's data at
    once. Returns (state_dict, losses, grad_norms)."""
    loss_fn = loss_fn or (lambda m, x: m(input_ids=x, labels=x).loss)
    opt = make_opt(list(model.parameters()))
    losses, norms = [], []
    for step in data:
        x = step.reshape(-1, step.shape[-1])
        loss = loss_fn(model, x)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def delayed_reference(model, data, make_opt, delay_after, clip=None, lr_decay=1.0):
    """ZeRO-Offload's one-step delayed parameter update in plain PyTorch, on the global batch.

    The optimizer steps a master copy. Steps before `delay_after` are exact (the master is copied
    into the model at once). From then on step k's update is copied in only after step k+1's
    backward, so each gradient is computed on parameters one update older; at the end the last
    update is copied in. Each step's lr is multiplied by `lr_decay` after it (an LR schedule set
    between steps, as a user's scheduler would). Returns the state_dict."""
    loss_fn = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    params = list(model.parameters())
    master = [p.detach().clone().requires_grad_(True) for p in params]
    opt = make_opt(master)
    pending = False

    def publish():
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)

    for k, step in enumerate(data):
        x = step.reshape(-1, step.shape[-1])
        loss_fn(model, x).backward()
        if pending:
            publish()
        for p, m in zip(params, master):
            m.grad, p.grad = p.grad, None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(master, clip)
        opt.step()
        opt.zero_grad()
        for g in opt.param_groups:
            g["lr"] *= lr_decay
        pending = k >= delay_after
        if not pending:
            publish()
    publish()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(engine, data, rank, loss_fn=None):
    loss_fn = loss_fn or (lambda m, x: m(input_ids=x, labels=x).loss)
    for step in data:
        for micro in step:
            loss = loss_fn(engine, micro[rank])
            engine.backward(loss)
            engine.step()


def max_diff(a: dict, b: dict) -> float:
    """Largest elementwise difference between two state dicts with the same keys (tensors with no
    elements count as equal)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max([(a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a if a[k].numel()] or [0.0])


def digest(state: dict) -> str:
    """A fingerprint of a state dict's exact bytes (ranks compare theirs)."""
    import hashlib
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def inputs(steps, world, *shape, seed=5):
    """Random inputs [steps, world, *shape]: rank r trains on [:, r]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, world, *shape, generator=g)


def parity(rank, world, build, loss_of, data, make_opt, cfg=None, accumulation=1, before_step=None):
    """Train `build()` through the engine on rank `rank`'s data and the same model in plain torch on
    every rank's data: the reference loss is the mean of the ranks' losses, one backward per
    micro-batch. data: [steps, accumulation, world, ...] (or [steps, world, ...] when accumulation
    is 1). loss_of(model, x, step, rank, micro) -> loss. Returns (engine, max difference)."""
    import zeroshard
    if accumulation == 1:
        data = data.unsqueeze(1)
    ref = build()
    opt = make_opt(list(ref.parameters()))
    for k, step in enumerate(data):
        for m, micro in enumerate(step):
            (sum(loss_of(ref, micro[r], k, r, m) for r in range(world)) / (world * accumulation)).backward()
        if before_step is not None:
            before_step(ref, k)
        opt.step()
        opt.zero_grad(set_to_none=True)
    engine = zeroshard.initialize(build(), make_opt, {"stage": 0, **(cfg or {}),
                                                      "gradient_accumulation_steps": accumulation})
    for k, step in enumerate(data):
        for m, micro in enumerate(step):
            engine.backward(loss_of(engine, micro[rank], k, rank, m))
            engine.step()
    return engine, max_diff(engine.full_state_dict(), ref.state_dict())


class Quirky(torch.nn.Module):
    """Exercises what trips sharded engines: a module called twice per forward, a parameter that gets
    no gradient, a frozen layer, modules registered in an order other than their first use, and a
    parameter shared by two modules."""

    def __init__(self, d=24, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.head = torch.nn.Linear(d, 4)  # registered first, used last
        self.unused = torch.nn.Linear(d, d)  # never called: no gradient
        self.frozen = torch.nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.inp = torch.nn.Linear(8, d)
        self.block = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh())
        self.shared = torch.nn.Linear(d, d, bias=False)
        self.also_shared = torch.nn.Linear(d, d, bias=False)
        self.also_shared.weight = self.shared.weight

    def forward(self, x, checkpoint=None):
        h = torch.tanh(self.inp(x))
        for _ in range(2):  # the same module twice
            if checkpoint is None:
                h = self.block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=checkpoint)
        h = self.frozen(h) + self.shared(h)
        h = torch.tanh(self.also_shared(h))
        return self.head(h)


def quirky_data(steps, world, accumulation=1, batch=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(steps, accumulation, world, batch, 8, generator=g)


def quirky_loss(m, x):
    return m(x).pow(2).mean()
