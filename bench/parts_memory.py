"""run_all.py's parts on what each rank moves and holds: communication per step and model-state
memory against the ZeRO paper, the demo's memory timeline, and each rank's peak while a pretrained
model is built and loaded.
"""
from __future__ import annotations

import os
import sys

from launch import BENCH, load_json, run_command, torchrun

MIB = 2**20
COMM_CACHE_CHUNK = 415424  # elements: an eighth of gpt2-tiny (the default before chunks had a 4M-element floor)
PAPER_COMM_PSI = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}  # ZeRO section 7: all-reduce 2, stage 3 1.5x that


def run_comm(ctx, part):
    st = ((ctx.results["parts"].get("step_time", {}).get("data") or {}).get("workloads") or {}).get("gpt2-tiny")
    zs = [r for r in (st or {}).get("systems", []) if r.get("system") in ("zs0", "zs1", "zs2", "zs3") and "comm_psi" in r]
    if len(zs) < 4:
        # step_time was not run (or failed): measure the four stages here, few steps suffice for the counts.
        path = ctx.tmp("comm_stages.json")
        run_command(torchrun(sys.executable) + [os.path.join(BENCH, "step_time.py"), "--systems", "zs0,zs1,zs2,zs3",
                                                "--steps", "4", "--warmup", "1", "--json", path], ctx.log("comm"), 300)
        st = load_json(path)
        zs = st["systems"]
        source = "`step_time.py --systems zs0,zs1,zs2,zs3 --steps 4 --warmup 1` (run by this part)"
    else:
        source = "the step_time part's zeroshard rows (gpt2-tiny)"

    def row(r, cache, steps):
        over = r.get("cache_overflows")  # the engine counts them from the start, not per step
        return {"stage": int(r["system"][2:]), "cache": cache, "comm_psi": r["comm_psi"],
                "comm_elements": r["comm_elements"], "padded_elements": r["padded_elements"],
                "num_params": r["num_params"], "cache_overflows_per_step": over / steps if over is not None else None}
    rows = [row(r, "unlimited", st["steps"]) for r in zs]
    # The paper's 3 Psi at stage 3 assumes the parameters are gathered again for backward; an unlimited
    # rCache keeps them from forward, so small caches are measured too, on chunks of COMM_CACHE_CHUNK
    # elements (the default packs gpt2-tiny in one chunk; 1 chunk of this size is below what one layer
    # spans, so it also shows what thrashing costs).
    for cache in (1, 2):
        path = ctx.tmp(f"comm_cache{cache}.json")
        run_command(torchrun(sys.executable) + [os.path.join(BENCH, "step_time.py"), "--systems", "zs3",
                                                "--cache-chunks", str(cache), "--chunk-size", str(COMM_CACHE_CHUNK),
                                                "--steps", "4", "--warmup", "1", "--json", path], ctx.log("comm"), 300)
        got = load_json(path)
        rows.append(row(got["systems"][0], f"{cache} chunk{'s' if cache > 1 else ''}", got["steps"]))
    part["data"] = {"source": source, "rows": rows}


def render_comm(ctx, part):
    rows = part["data"]["rows"]
    md = ["Elements each rank communicates per optimizer step in units of Ψ (the padded parameter count), counted "
          "as the ZeRO paper counts (all-reduce 2M, reduce-scatter and all-gather M each), gpt2-tiny, 2 ranks, fp32; "
          f"from {part['data']['source']}; stage 3 with a small rCache from "
          f"`step_time.py --systems zs3 --cache-chunks C --chunk-size {COMM_CACHE_CHUNK} --steps 4 --warmup 1` (the "
          "default chunk size packs gpt2-tiny into one chunk, so a cache of chunks needs smaller ones).", "",
          "| stage | rCache | measured (Ψ) | ZeRO paper (Ψ) | measured / paper | rCache overflows per step (mean) | "
          "Ψ (padded elements) | padding |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paper = PAPER_COMM_PSI[r["stage"]]
        cache = r["cache"] if r["stage"] == 3 else "-"
        over = r.get("cache_overflows_per_step")
        md.append(f"| {r['stage']} | {cache} | {r['comm_psi']:.3f} | {paper:.0f} | {r['comm_psi'] / paper:.3f} | "
                  f"{f'{over:.0f}' if over is not None and r['stage'] == 3 else '-'} | {r['padded_elements']:,} | "
                  f"{r['padded_elements'] / r['num_params'] - 1:.2%} |")
    md += ["", "Paper: stage 0 is DDP's all-reduce (2Ψ); stages 1 and 2 replace it by a reduce-scatter of gradients "
           "and an all-gather of updated parameters (2Ψ); stage 3 gathers the parameters for forward and again for "
           "backward (3Ψ). With an unlimited rCache the gathered parameters stay from forward into backward, so "
           "stage 3 moves 2Ψ (and holds the whole model meanwhile); with 2 chunks it is near the paper's 3Ψ (the "
           "chunks used last in forward are still cached for the start of backward). An rCache smaller than the "
           "chunks one module needs at once overflows: chunks are gathered again and again, and the count "
           "exceeds 3Ψ."]
    plt = ctx.pyplot()
    if plt is None:
        return md, []
    import numpy as np
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = np.arange(len(rows))
    w = 0.38
    measured = ax.bar(x - w / 2, [r["comm_psi"] for r in rows], w, label="measured", color="#ff7f0e")
    paper = ax.bar(x + w / 2, [PAPER_COMM_PSI[r["stage"]] for r in rows], w, label="ZeRO paper", color="#c7c7c7",
                   edgecolor="black", hatch="//")
    for bars in (measured, paper):
        for b in bars:
            ax.annotate(f"{b.get_height():.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x)
    ax.set_xticklabels([f"stage {r['stage']}" + (f"\nrCache {r['cache']}" if r["stage"] == 3 else "") for r in rows],
                       fontsize=9)
    ax.set_ylabel("elements communicated per rank per step (Ψ)")
    ax.set_ylim(0, max(3.0, *(r["comm_psi"] for r in rows)) * 1.2)
    ax.set_title("Communication per step: zeroshard (gpt2-tiny, 2 ranks) vs ZeRO paper")
    ax.legend(loc="upper left")
    return md, [ctx.save(fig, "comm.png")]


def run_memory(ctx, part):
    path = ctx.tmp("model_states.json")
    run_command([sys.executable, os.path.join(BENCH, "model_states.py"), "--worlds", "1,2,3", "--steps", "2",
                 "--json", path], ctx.log("memory"), 600)
    part["data"] = load_json(path)


def render_memory(ctx, part):
    rows = part["data"]["rows"]
    mib = 2**20
    md = ["`python bench/model_states.py --worlds 1,2,3`: gpt2-tiny, bf16 compute, fp32 masters, AdamW, after 2 steps; "
          "`engine.stats()['model_state_bytes']`, the largest over ranks. Table 1 (mixed-precision Adam, K = 12): "
          "`zeroshard.planning.estimate.estimate(Ψ, stage, N)` = 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N bytes "
          "for stages 0-3, Ψ = the padded element count at that world size.", "",
          "| N | stage | measured MiB / rank | Table 1 MiB | measured / Table 1 | live tensors MiB | Ψ |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        live = f"{r['live_bytes'] / mib:.2f}" if "live_bytes" in r else "-"
        md.append(f"| {r['world']} | {r['stage']} | {r['measured_bytes'] / mib:.2f} | {r['table1_bytes'] / mib:.2f} | "
                  f"{r['ratio']:.4f} | {live} | {r['padded_elements']:,} |")
    md += ["", "The engine counts its parameter and gradient buffers by their sizes; \"live tensors\" is a check that "
           "does not rely on it: the bytes of all tensor storages reachable from Python after the steps, less those "
           "before the model was built. At stages 2-3 it is 2Ψ/N below Table 1: the gradient shard is released "
           "after the update (Table 1 counts it, as it is held through backward and the step)."]
    plt = ctx.pyplot()
    if plt is None:
        return md, []
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    worlds = sorted({r["world"] for r in rows})
    for stage in range(4):
        rs = sorted((r for r in rows if r["stage"] == stage), key=lambda r: r["world"])
        if not rs:
            continue
        ax.plot([r["world"] for r in rs], [r["table1_bytes"] / mib for r in rs], ls="--", color=colors[stage],
                lw=1.2, label=f"stage {stage}: Table 1")
        ax.plot([r["world"] for r in rs], [r["measured_bytes"] / mib for r in rs], ls="none", marker="o",
                ms=7, color=colors[stage], label=f"stage {stage}: measured")
    ax.set_xticks(worlds)
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel("model states per rank (MiB)")
    ax.set_ylim(0, None)
    ax.set_title("Model-state memory per rank, gpt2-tiny, bf16 + AdamW: measured vs ZeRO Table 1")
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    ax.title.set_fontsize(10)
    return md, [ctx.save(fig, "memory.png")]


def run_timeline(ctx, part):
    path = ctx.tmp("timeline.json")
    steps = 3 if ctx.quick else 10
    run_command(torchrun(sys.executable) + ["-m", "zeroshard.demo", "--steps", str(steps), "--log-every", str(steps),
                                            "--memory-plot", os.path.join(ctx.out, "timeline.png"),
                                            "--memory-json", path], ctx.log("timeline"), 600)
    part["data"] = {**load_json(path), "steps": steps}


def render_timeline(ctx, part):
    d = part["data"]
    n = d["world"]
    md = [f"`torchrun --standalone --nproc_per_node {n} -m zeroshard.demo --steps {d['steps']}` (GPT-2 4 x 128, "
          f"vocab 256, 8 x 64 tokens per rank, AdamW, {d['precision']}): rank 0's memory over two steps of its "
          "stage 3 run and of a stage-0 run of the same model (`engine.record_memory`), in MiB.", "",
          "| run | model states | peak rCache | peak gradient buffers | peak activations | of stage 0's model states |",
          "|---|---|---|---|---|---|"]
    base = d["timelines"]["stage 0"]["model_states"]
    for k, t in d["timelines"].items():
        md.append(f"| {k} | {t['model_states'] / MIB:.2f} | {t['peak_cache'] / MIB:.2f} | "
                  f"{t['peak_grad_buffers'] / MIB:.2f} | {t['peak_activations'] / MIB:.2f} | "
                  f"{t['model_states'] / base:.3f} (1/N = {1 / n:.3f}) |")
    return md, ["timeline.png"] if os.path.exists(os.path.join(ctx.out, "timeline.png")) else []


def run_sharded_load(ctx, part):
    path = ctx.tmp("sharded_load.json")
    size = ["--n-layer", "2", "--n-embd", "256"] if ctx.quick else []
    run_command([sys.executable, os.path.join(BENCH, "sharded_load.py"), *size, "--json", path],
                ctx.log("sharded_load"), 1200)
    part["data"] = load_json(path)


def render_sharded_load(ctx, part):
    d = part["data"]
    md = [f"`python bench/sharded_load.py`: GPT-2 {d['n_layer']} x {d['n_embd']} ({d['params'] / 1e6:.1f}M parameters, "
          f"{d['fp32_bytes'] / 1e9:.2f} GB in fp32), world {d['world']}, stage 3, bf16: each rank's peak resident memory "
          "over initialize + load (VmHWM growth), goal at most 0.6 x the fp32 model for the meta paths.", "",
          "| path | peak per rank (MB) | x fp32 model | resident after (MB) | seconds | bit for bit |",
          "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        md.append(f"| {r['label']} | {', '.join(f'{p / 1e6:,.0f}' for p in r['peak_bytes'])} | {r['of_fp32']:.2f} | "
                  f"{max(r['resident_bytes']) / 1e6:,.0f} | {r['seconds']:.1f} | {r['bitwise']} |")
    md.append(f"| from_pretrained (one process) | | | | {d['from_pretrained_seconds']:.1f} | |")
    return md, []
