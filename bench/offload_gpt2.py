"""ZeRO-Offload on one device: train a GPT-2 whose model states do not fit in device memory.

    python bench/offload_gpt2.py                       # on a GPU: a model sized to need offload
    python bench/offload_gpt2.py --n-layer 2 --n-embd 128 --steps 4   # a CPU smoke run

Model: GPT-2 (transformers, built on the meta device then materialised in bf16 with N(0, 0.02)
weights, no dropout), vocab 50257, `--seq` tokens per sample, `--batch` samples per step, activation
checkpointing on (transformers' gradient_checkpointing_enable). Default on CUDA: n_embd 4096, 32
heads, and the fewest layers for which mixed-precision Adam without offload (16 bytes per parameter,
ZeRO Table 1 at one device) needs more than the device's memory.

Training: zeroshard stage 2, bf16, CPUAdamW(lr 1e-4), offload_optimizer (and --offload-params /
--offload-activations if given; offload_params switches to stage 3). Random token ids.

Printed per run (median over timed steps, after --warmup untimed steps):
- step time, split into forward+backward and engine.step() (the CPU Adam step and the parameter
  uploads that were not hidden behind compute); "exposed" is the step() share of the step;
- model TFLOPS: (6 * params + 12 * layers * n_embd * seq) * tokens / step time (the recomputation of
  checkpointing not counted, as the Elixir and ZeRO-Offload papers count);
- peak device memory (torch.cuda.max_memory_allocated) next to what the model states alone would need
  without offload, and the bytes moved host<->device per step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402

VOCAB = 50257


def gpt2_params(n_layer: int, d: int, seq: int) -> int:
    return n_layer * (12 * d * d + 13 * d) + VOCAB * d + seq * d + 2 * d


def build(n_layer: int, d: int, seq: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=d, n_head=max(1, d // 128), vocab_size=VOCAB, n_positions=seq,
                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln_" in name or name.startswith("transformer.ln_f"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.tie_weights()
    model.gradient_checkpointing_enable()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=None, help="default: the fewest that need offload")
    ap.add_argument("--n-embd", type=int, default=None, help="default 4096 on CUDA, 128 on CPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=1,
                    help="micro-batches of --batch samples per optimizer step (the CPU step is paid once per step)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--offload-params", action="store_true")
    ap.add_argument("--offload-activations", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dev_mem = torch.cuda.get_device_properties(0).total_memory if cuda else None
    d = args.n_embd or (4096 if cuda else 128)
    seq = args.seq if cuda else min(args.seq, 128)
    n_layer = args.n_layer
    if n_layer is None:
        n_layer = 2
        if cuda:
            while 16 * gpt2_params(n_layer, d, seq) <= 1.05 * dev_mem:
                n_layer += 1
    psi = gpt2_params(n_layer, d, seq)
    host_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    print(f"GPT-2 {n_layer} layers x {d}: {psi / 1e9:.2f} B parameters; without offload the model states "
          f"need 16 x params = {16 * psi / 2**30:.1f} GiB"
          + (f" (device memory {dev_mem / 2**30:.1f} GiB)" if cuda else " (CPU smoke run)"))
    print(f"host memory {host_mem / 2**30:.0f} GiB; offloaded states need ~{16 * psi / 2**30:.0f} GiB there")

    t0 = time.perf_counter()
    model = build(n_layer, d, seq)
    config = {"stage": 3 if args.offload_params else 2, "precision": "bf16", "offload_optimizer": True,
              "offload_params": args.offload_params, "offload_activations": args.offload_activations,
              "gradient_accumulation_steps": args.accumulation}
    engine = zeroshard.initialize(model, lambda ps: zeroshard.CPUAdamW(ps, lr=1e-4), config)
    print(f"set-up {time.perf_counter() - t0:.0f} s; config {config}")

    g = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for i in range(args.warmup + args.steps):
        xs = [torch.randint(0, VOCAB, (args.batch, seq), generator=g) for _ in range(args.accumulation)]
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        for x in xs:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
        sync()
        t_fb = time.perf_counter() - t
        engine.step()
        sync()
        t_all = time.perf_counter() - t
        s = engine.stats()
        print(f"step {i}: loss {loss.item():.4f}  {t_all:.2f} s (forward+backward {t_fb:.2f} s, step() "
              f"{t_all - t_fb:.2f} s)" + ("  warm-up" if i < args.warmup else ""))
        if i >= args.warmup:
            rows.append((t_all, t_fb, s))
    t_all = statistics.median(r[0] for r in rows)
    t_fb = statistics.median(r[1] for r in rows)
    s = rows[-1][2]
    tokens = args.batch * seq * args.accumulation
    tflops = (6 * psi + 12 * n_layer * d * seq) * tokens / t_all / 1e12
    peak = torch.cuda.max_memory_allocated() if cuda else None
    by = s["model_state_bytes_by_device"]
    out = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "params": psi, "n_layer": n_layer,
        "n_embd": d, "seq": seq, "batch": args.batch, "accumulation": args.accumulation, "config": config, "step_s": t_all,
        "forward_backward_s": t_fb, "exposed_step_share": (t_all - t_fb) / t_all, "model_tflops": tflops,
        "peak_device_bytes": peak, "no_offload_model_state_bytes": 16 * psi,
        "model_state_bytes_by_device": by, "transfer_bytes": s["transfer_bytes"],
    }
    print(f"\n{out['device']}: {psi / 1e9:.2f} B params, batch {args.batch} x {seq}"
          + (f", {args.accumulation} micro-batches per step" if args.accumulation > 1 else ""))
    print(f"step {t_all:.2f} s (median of {len(rows)}): forward+backward {t_fb:.2f} s, exposed CPU step + "
          f"transfers {t_all - t_fb:.2f} s = {out['exposed_step_share']:.0%} of the step")
    print(f"model TFLOPS {tflops:.2f}")
    if cuda:
        print(f"peak device memory {peak / 2**30:.1f} GiB of {dev_mem / 2**30:.1f} GiB "
              f"(model states without offload would need {16 * psi / 2**30:.1f} GiB)")
    print(f"model states: device {by['device'] / 2**30:.2f} GiB, host {by['host'] / 2**30:.2f} GiB; moved per "
          f"step: h2d {s['transfer_bytes']['h2d'] / 2**30:.2f} GiB, d2h {s['transfer_bytes']['d2h'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
