"""Small models and the single-process reference that every configuration must reproduce."""
from __future__ import annotations

import torch


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


def train(engine, data, rank, loss_fn=None):
    loss_fn = loss_fn or (lambda m, x: m(input_ids=x, labels=x).loss)
    for step in data:
        for micro in step:
            loss = loss_fn(engine, micro[rank])
            engine.backward(loss)
            engine.step()


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
