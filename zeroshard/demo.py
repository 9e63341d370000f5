"""Demo: train a small GPT-2 with zeroshard over local processes on the CPU (no GPU, no download).

    torchrun --standalone --nproc_per_node 2 -m zeroshard.demo [--stage 3] [--steps 80]

The data is synthetic and learnable: each sequence repeats a random motif, so a model that learns
to copy from context drives the loss well below log(vocab). Every few steps rank 0 prints the
step, the loss averaged over ranks, tokens/s over all ranks, and the model-state bytes each rank
holds (parameters, gradients, optimizer states), which shrink with the stage.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

import zeroshard


def motif_batch(gen, batch, seq, vocab, motif=8):
    base = torch.randint(0, vocab, (batch, motif), generator=gen)
    return base.repeat(1, math.ceil(seq / motif))[:, :seq]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--cache-chunks", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = 256
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=vocab, n_positions=args.seq,
                                       bos_token_id=0, eos_token_id=0))
    engine = zeroshard.initialize(
        model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.0),
        config={"stage": args.stage, "precision": args.precision, "cache_chunks": args.cache_chunks,
                "clip_grad_norm": 1.0})
    rank, world = engine.comm.rank, engine.comm.world
    gen = torch.Generator().manual_seed(1000 + rank)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"zeroshard demo: GPT-2 {n_params / 1e6:.2f}M parameters, stage {args.stage}, {args.precision}, "
              f"{world} process(es) on {engine.device}, {args.batch}x{args.seq} tokens per rank per step",
              flush=True)
    t0, tokens, loss_sum, since_log = time.perf_counter(), 0, torch.zeros(1), 0
    for step in range(1, args.steps + 1):
        x = motif_batch(gen, args.batch, args.seq, vocab)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().float()
        since_log += 1
        tokens += x.numel() * world
        if step % args.log_every == 0 or step == args.steps:
            if world > 1:
                dist.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / (world * since_log)
            loss_sum.zero_()
            since_log = 0
            s = engine.stats()
            mib = [s["model_state_bytes"] / 2**20]
            if world > 1:
                mib = [None] * world
                dist.all_gather_object(mib, s["model_state_bytes"] / 2**20)
            dt = time.perf_counter() - t0
            if rank == 0:
                per_rank = " ".join(f"{m:.1f}" for m in mib)
                print(f"step {step:4d}/{args.steps}  loss {mean_loss:.3f}  {tokens / dt:,.0f} tokens/s  "
                      f"model states per rank (MiB): {per_rank}  comm/step: {s['comm_elements'] / 1e6:.2f}M elements",
                      flush=True)
    if rank == 0:
        print(f"done in {time.perf_counter() - t0:.1f}s (log(vocab) = {math.log(vocab):.2f}: "
              "a loss well below it means the model learned to copy)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
