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
  uploads that were not hidden behind compute); "exposed" is the step() share of the step. With
  --delay-update (ZeRO-Offload's DPU) the CPU step overlaps the next forward+backward, whose time then
  includes any wait for it, so "exposed" is the step time minus the forward+backward of the exact
  warm-up steps (the compute floor);
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


def build_device(psi: int, cuda: bool) -> str:
    """Where to materialise the bf16 model: on the GPU when its 2 bytes/parameter take under a third
    of it (seconds, where the CPU's single-threaded normal_ takes minutes at billions of
    parameters); initialize() moves what it offloads to the host itself."""
    if cuda and 2 * psi < torch.cuda.get_device_properties(0).total_memory / 3:
        return "cuda"
    return "cpu"


def cap_device_memory(nbytes: int | None) -> None:
    """Make the GPU behave as one of `nbytes` (torch's caching allocator refuses more), so every
    system compared runs out of memory where such a device would."""
    if nbytes and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / torch.cuda.get_device_properties(0).total_memory))


def comparison_arguments(ap) -> None:
    """The model, data and device arguments that auto_gpt2.py and deepspeed_offload.py share, so the
    systems they compare train the same model on the same device."""
    from zeroshard.cli import size
    ap.add_argument("--n-layer", type=int, default=None, help="default: the fewest that need offload")
    ap.add_argument("--n-embd", type=int, default=None, help="default 4096 on CUDA, 128 on CPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device-memory", type=size, default=None,
                    help="make the device this big (e.g. 20GB): the planner plans for it and torch's allocator "
                         "refuses more, for every configuration; default: the device's")


def comparison_model(args, cuda: bool) -> tuple[int, int, int, int, int | None]:
    """(n_layer, n_embd, seq, params, device bytes) from comparison_arguments, after capping the
    device: by default the fewest layers whose 16 bytes/parameter exceed the device."""
    cap_device_memory(args.device_memory)
    dev_mem = args.device_memory or (torch.cuda.get_device_properties(0).total_memory if cuda else None)
    d = args.n_embd or (4096 if cuda else 128)
    n_layer = args.n_layer or 2
    if cuda and args.n_layer is None:
        while 16 * gpt2_params(n_layer, d, args.seq) <= 1.05 * dev_mem:
            n_layer += 1
    return n_layer, d, args.seq, gpt2_params(n_layer, d, args.seq), dev_mem


def timed_steps(engine, args, seq: int, cuda: bool, device=None, verbose: bool = False):
    """args.warmup + args.steps training steps on random tokens (the same for every system compared:
    seed 1), one micro-batch each. Returns (seconds of the timed steps, every step's loss); the peak
    device memory counts from the first timed step."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, VOCAB, (args.batch, seq), generator=g)
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        x = x if device is None else x.to(device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        sync()
        dt = time.perf_counter() - t
        losses.append(loss.item())
        if verbose:
            print(f"  step {i}: loss {losses[-1]:.4f}  {dt:.3f} s" + ("  warm-up" if i < args.warmup else ""),
                  flush=True)
        if i >= args.warmup:
            times.append(dt)
    return times, losses


def build(n_layer: int, d: int, seq: int, device: str = "cpu"):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=d, n_head=max(1, d // 128), vocab_size=VOCAB, n_positions=seq,
                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
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
    ap.add_argument("--delay-update", action="store_true",
                    help="ZeRO-Offload's one-step delayed parameter update after the --warmup exact steps "
                         "(config delay_update_after); exposure is then measured against the forward+backward "
                         "of the exact warm-up steps")
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
    model = build(n_layer, d, seq, build_device(psi, cuda))
    config = {"stage": 3 if args.offload_params else 2, "precision": "bf16", "offload_optimizer": True,
              "offload_params": args.offload_params, "offload_activations": args.offload_activations,
              "gradient_accumulation_steps": args.accumulation}
    if args.delay_update:
        if args.warmup < 2:
            ap.error("--delay-update needs --warmup >= 2 (exact steps after the first give the compute floor)")
        config["delay_update_after"] = args.warmup
    engine = zeroshard.initialize(model, lambda ps: zeroshard.CPUAdamW(ps, lr=1e-4), config)
    setup_s = time.perf_counter() - t0
    print(f"set-up {setup_s:.0f} s; config {config}")

    g = torch.Generator().manual_seed(1)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows, floor = [], []
    first_timed = args.warmup + int(args.delay_update)  # the first delayed step lands nothing
    for i in range(first_timed + args.steps):
        xs = [torch.randint(0, VOCAB, (args.batch, seq), generator=g) for _ in range(args.accumulation)]
        if cuda and i == first_timed:
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
              f"{t_all - t_fb:.2f} s)" + ("  warm-up" if i < first_timed else ""))
        if 0 < i < args.warmup:
            floor.append(t_fb)
        if i >= first_timed:
            rows.append((t_all, t_fb, s))
    t_all = statistics.median(r[0] for r in rows)
    # Delayed: the uploads of the update landing at step() are waited for by the next forward, so
    # forward+backward of the delayed steps is not the compute floor; the exact warm-up steps' is.
    t_fb = statistics.median(floor) if args.delay_update else statistics.median(r[1] for r in rows)
    s = rows[-1][2]
    tokens = args.batch * seq * args.accumulation
    tflops = (6 * psi + 12 * n_layer * d * seq) * tokens / t_all / 1e12
    peak = torch.cuda.max_memory_allocated() if cuda else None
    by = s["model_state_bytes_by_device"]
    out = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "params": psi, "n_layer": n_layer,
        "n_embd": d, "seq": seq, "batch": args.batch, "accumulation": args.accumulation, "config": config, "step_s": t_all,
        "setup_s": setup_s,
        "forward_backward_s": t_fb, "exposed_step_share": (t_all - t_fb) / t_all, "model_tflops": tflops,
        "peak_device_bytes": peak, "no_offload_model_state_bytes": 16 * psi,
        "model_state_bytes_by_device": by, "transfer_bytes": s["transfer_bytes"],
    }
    print(f"\n{out['device']}: {psi / 1e9:.2f} B params, batch {args.batch} x {seq}"
          + (f", {args.accumulation} micro-batches per step" if args.accumulation > 1 else ""))
    print(f"step {t_all:.2f} s (median of {len(rows)}): forward+backward {t_fb:.2f} s"
          + (" (exact warm-up steps)" if args.delay_update else "")
          + f", exposed CPU step + transfers {t_all - t_fb:.2f} s = {out['exposed_step_share']:.0%} of the step")
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
