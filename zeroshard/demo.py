"""Demo: train a small GPT-2 with zeroshard over local processes on the CPU (no GPU, no download).

    torchrun --standalone --nproc_per_node 2 -m zeroshard.demo [--stage 3] [--steps 80]
    [--shard-group-size node | --hpz-group-size node]   (see the README's "Beyond one node")

The data is synthetic and learnable: each sequence repeats a random motif, so a model that learns
to copy from context drives the loss well below log(vocab). Every few steps rank 0 prints the
step, the loss averaged over ranks, tokens/s over all ranks, and the model-state bytes each rank
holds (parameters, gradients, optimizer states), which shrink with the stage.

It also records each rank's memory over two steps (model states, rCache, gradient buffers,
activations; zeroshard.telemetry.timeline) and, for stages 1-3, over two steps of a stage-0 run of the same
model, and saves both side by side as a PNG (--memory-plot; needs matplotlib): at stage 3 the model
states per rank are about 1/N of stage 0's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
import torch.distributed as dist

import zeroshard
import zeroshard.telemetry.timeline

VOCAB = 256


def motif_batch(gen, batch, seq, vocab, motif=8):
    base = torch.randint(0, vocab, (batch, motif), generator=gen)
    return base.repeat(1, math.ceil(seq / motif))[:, :seq]


def build(args, stage: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=args.seq,
                                       bos_token_id=0, eos_token_id=0))
    numels = [p.numel() for p in model.parameters()]
    # Eight chunks or so, so stage 3's small rCache has chunks to cycle through (the default size
    # packs a model this small into one chunk).
    config = {"stage": stage, "precision": args.precision, "clip_grad_norm": 1.0,
              "chunk_size": max(max(numels), sum(numels) // 8)}
    if stage == 3:  # the rCache is stage 3's: other stages would only warn that it has no effect
        config["cache_chunks"] = args.cache_chunks
    if stage != 0 and args.shard_group_size is not None:
        config["shard_group_size"] = args.shard_group_size
    if stage == 3 and args.hpz_group_size is not None:
        config["hpz_group_size"] = args.hpz_group_size
    return zeroshard.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.0),
                                config=config)


def train_step(engine, x) -> torch.Tensor:
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return loss.detach().float()


def memory_plot(args, engine, timeline) -> None:
    """Two recorded steps of a stage-0 run of the same model beside the run's own, in one PNG."""
    rank, world = engine.comm.rank, engine.comm.world
    timelines = {}
    if args.stage != 0 and (args.memory_plot or args.memory_json):
        ref = build(args, 0)
        gen = torch.Generator().manual_seed(1000 + rank)
        for step in range(3):
            if step == 1:
                ref.record_memory(steps=2)
            train_step(ref, motif_batch(gen, args.batch, args.seq, VOCAB))
        timelines["stage 0"] = ref.timeline
    timelines[f"stage {args.stage}"] = timeline
    states = {k: max(s.device_states + s.host_states for s in t.samples) for k, t in timelines.items()}
    if rank != 0:
        return
    line = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in states.items())
    if "stage 0" in timelines and args.stage != 0:
        line += f": stage {args.stage} holds {states[f'stage {args.stage}'] / states['stage 0']:.2f} of stage 0 (1/N = {1 / world:.2f})"
    print(f"model states per rank (rank 0): {line}", flush=True)
    if args.memory_json:
        with open(args.memory_json, "w") as f:
            json.dump({"world": world, "precision": args.precision, "timelines": {
                k: {"model_states": states[k], **{f"peak_{x}": t.peak(x) for x in
                                                  ("cache", "grad_buffers", "activations", "host_states")},
                    "samples": [dataclasses.asdict(s) for s in t.samples]}
                for k, t in timelines.items()}}, f)
    if not args.memory_plot:
        return
    try:
        zeroshard.telemetry.timeline.plot(timelines, args.memory_plot,
                                suptitle=f"zeroshard demo: memory of rank 0 of {world}, two training steps, {args.precision}")
        print(f"memory timeline saved to {args.memory_plot}", flush=True)
    except ImportError as e:
        print(f"no memory plot: {e}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--cache-chunks", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--shard-group-size", type=lambda v: v if v == "node" else int(v), default=None,
                    help="ranks per shard group (hybrid sharding), or 'node'; default: all ranks")
    ap.add_argument("--hpz-group-size", type=lambda v: v if v == "node" else int(v), default=None,
                    help="stage 3: ranks per secondary group (hpZ), or 'node'; default: no hpZ")
    ap.add_argument("--memory-plot", default="zeroshard-memory.png",
                    help="PNG of the memory timeline (stage 0 beside --stage); '' for none")
    ap.add_argument("--memory-json", default=None, help="also write rank 0's timeline figures (bytes) here")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be at least 3 (steps 2-3 are recorded for the memory timeline)")

    import transformers
    from tqdm import tqdm
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    engine = build(args, args.stage)
    rank, world = engine.comm.rank, engine.comm.world
    gen = torch.Generator().manual_seed(1000 + rank)
    n_params = sum(p.numel() for p in engine.module.parameters())
    if rank == 0:
        print(f"zeroshard demo: GPT-2 {n_params / 1e6:.2f}M parameters, stage {args.stage}, {args.precision}, "
              f"{world} process(es) on {engine.device}, {args.batch}x{args.seq} tokens per rank per step",
              flush=True)
    t0, tokens, loss_sum, since_log = time.perf_counter(), 0, torch.zeros(1), 0
    bar = tqdm(total=args.steps, desc="training", unit="step", disable=rank != 0 or None, leave=False)
    for step in range(1, args.steps + 1):
        x = motif_batch(gen, args.batch, args.seq, VOCAB)
        if step == 2:
            engine.record_memory(steps=2)
        loss_sum += train_step(engine, x)
        bar.update()
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
                bar.set_postfix(loss=f"{mean_loss:.3f}")
                bar.write(f"step {step:4d}/{args.steps}  loss {mean_loss:.3f}  {tokens / dt:,.0f} tokens/s  "
                          f"model states per rank (MiB): {per_rank}  comm/step: {s['comm_elements'] / 1e6:.2f}M elements"
                          + (f" ({s['comm_elements_by_link']['across'] / 1e6:.2f}M across groups of "
                             f"{s['hpz_group_size'] or s['shard_group_size']})"
                             if (s["hpz_group_size"] or s["shard_group_size"]) < world else ""),
                          file=sys.stdout)
                sys.stdout.flush()  # torchrun pipes stdout: lines would otherwise wait for the exit
    bar.close()
    if rank == 0:
        print(f"done in {time.perf_counter() - t0:.1f}s (log(vocab) = {math.log(VOCAB):.2f}: "
              "a loss well below it means the model learned to copy)", flush=True)
    memory_plot(args, engine, engine.timeline)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
