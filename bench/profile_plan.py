"""The profiler and the chunk search against issue 4's bars, with figures printed.

    python bench/profile_plan.py [--json out.json] [--quick]

1. OPT-175B (transformers OPTConfig: hidden 12288, 96 layers, ffn 49152, 96 heads, vocab 50272),
   built on the meta device, one micro-batch of 1 x 2048 tokens in bf16: time to import
   transformers, to build the model, and to profile it (without and with activation
   checkpointing). Bar: profile under 5 s, import excluded.
2. The chunk search for that model (checkpointing on) on 8 x 80 GB and 1 x 80 GB described targets:
   search time and padding waste. Bar: under 5 s, waste under 4%.
3. Small GPT-2 configurations: the profile's predicted saved-for-backward and peak activation bytes
   against the same figures measured on real tensors (`zeroshard.planning.profiler.measure`), on this
   machine's device (on a GPU also torch.cuda.max_memory_allocated). Bar: within 10%.
   --quick leaves out the GPT-2 124M rows, most of the run's time on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument("--quick", action="store_true", help="leave out the GPT-2 124M activation rows")
    args = ap.parse_args()
    out = {"opt175b": {}, "chunk_search": [], "activations": []}
    t = time.perf_counter()
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM
    t_import = time.perf_counter() - t
    transformers.logging.set_verbosity_error()
    import zeroshard
    from zeroshard.planning.hardware import Hardware
    from zeroshard.planning.planner import Planner, Target
    from zeroshard.planning.profiler import measure

    print(f"import transformers: {t_import:.2f} s (excluded)")
    out["import_transformers_s"] = t_import
    cfg = OPTConfig(hidden_size=12288, num_hidden_layers=96, ffn_dim=49152, num_attention_heads=96,
                    vocab_size=50272, max_position_embeddings=2048)
    t = time.perf_counter()
    with torch.device("meta"):
        opt = OPTForCausalLM(cfg)
    out["opt175b"].update(build_s=time.perf_counter() - t, params=sum(p.numel() for p in opt.parameters()))
    print(f"OPT-175B built on meta: {out['opt175b']['build_s']:.2f} s, {out['opt175b']['params'] / 1e9:.2f} B parameters")
    x = torch.randint(0, cfg.vocab_size, (1, 2048))
    for ckpt in (False, True):
        if ckpt:
            opt.gradient_checkpointing_enable()
        t = time.perf_counter()
        prof = zeroshard.profile(opt, {"input_ids": x, "labels": x}, dtype="bf16")
        wall = time.perf_counter() - t
        print(f"profile OPT-175B, checkpointing {'on ' if ckpt else 'off'}: {wall:.2f} s -- {prof.summary()}")
        out["opt175b"]["checkpointing" if ckpt else "plain"] = {
            "profile_s": wall, "saved_bytes": prof.saved_bytes, "peak_activation_bytes": prof.peak_activation_bytes,
            "flops": prof.flops}
    for gpus in (8, 1):
        planner = Planner(prof, Target(Hardware.described(80e9), world=gpus))
        t = time.perf_counter()
        best = planner.plan()
        t_plan = time.perf_counter() - t
        print(f"chunk search, {gpus} x 80 GB: {len(planner.candidates)} sizes in {planner.search_seconds:.2f} s, "
              f"padding waste {planner.layout.waste:.3%}; the rest of the plan {t_plan:.2f} s")
        print(f"  {best.describe()}")
        out["chunk_search"].append({"gpus": gpus, "gpu_memory_bytes": 80e9, "candidates": len(planner.candidates),
                                    "search_s": planner.search_seconds, "waste": planner.layout.waste,
                                    "rest_of_plan_s": t_plan, "plan": best.describe()})

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"\nactivations, predicted (meta) vs measured (real tensors on {device}):")
    print("| GPT-2 (layers x width, vocab, batch x seq) | ckpt | saved pred | saved real | diff | peak pred | "
          "peak real | diff |" + (" cuda peak |" if device.type == "cuda" else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if device.type == "cuda" else ""))
    for n_layer, d, vocab, batch, seq, ckpt in ((2, 64, 128, 2, 32, False), (4, 256, 512, 4, 128, False),
                                                (4, 256, 512, 4, 128, True), (6, 384, 1024, 2, 256, False),
                                                (12, 768, 50257, 2, 512, False), (12, 768, 50257, 2, 512, True)):
        if args.quick and d >= 768:
            continue
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=d, n_head=max(1, d // 64), vocab_size=vocab,
                                           n_positions=seq, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)).to(device)
        if ckpt:
            model.gradient_checkpointing_enable()
        ids = torch.randint(0, vocab, (batch, seq))
        inputs = {"input_ids": ids, "labels": ids}
        prof = zeroshard.profile(model, inputs)
        real = measure(model, inputs)
        ds = prof.saved_bytes / real["saved_bytes"] - 1
        dp = prof.peak_activation_bytes / real["peak_activation_bytes"] - 1
        row = (f"| {n_layer} x {d}, {vocab}, {batch} x {seq} | {'yes' if ckpt else 'no'} | "
               f"{prof.saved_bytes / 2**20:.1f} MiB | {real['saved_bytes'] / 2**20:.1f} MiB | {ds:+.1%} | "
               f"{prof.peak_activation_bytes / 2**20:.1f} MiB | {real['peak_activation_bytes'] / 2**20:.1f} MiB | "
               f"{dp:+.1%} |")
        if "cuda_peak_bytes" in real:
            row += f" {real['cuda_peak_bytes'] / 2**20:.1f} MiB ({prof.peak_activation_bytes / real['cuda_peak_bytes'] - 1:+.1%}) |"
        print(row)
        out["activations"].append({
            "n_layer": n_layer, "n_embd": d, "vocab": vocab, "batch": batch, "seq": seq, "checkpointing": ckpt,
            "device": device.type, "saved_pred": prof.saved_bytes, "saved_real": real["saved_bytes"],
            "peak_pred": prof.peak_activation_bytes, "peak_real": real["peak_activation_bytes"],
            "cuda_peak": real.get("cuda_peak_bytes")})
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
