"""run_all.py's step_time part: bench/step_time.py under torchrun on each workload, every system
interleaved in one launch (DeepSpeed's stages too where ZEROSHARD_DEEPSPEED_PYTHON names a python
with it), its table against DDP, the goals and the peers' anchors, and its plots.
"""
from __future__ import annotations

import collections
import os
import random
import statistics
import sys
import traceback

from launch import BENCH, load_json, run_command, say, torchrun

# Peers on gpt2-tiny (ANCHORS_WORKLOAD only), from shared/notes/anchors.md: (step seconds, ratio to DDP) on a
# machine of this kind.
ANCHORS = {"ddp": (0.178, 1.00), "fsdp2": (0.401, 2.25), "ds1": (0.232, 1.30), "ds2": (0.201, 1.13),
           "ds3": (0.265, 1.49)}
ANCHORS_WORKLOAD = "gpt2-tiny"
# The step_time part's workloads (bench/step_time.py's WORKLOADS), in order: what the table says of each,
# and (steps, warmup) for a full run and for --quick; timeout in seconds per launch.
STEP_TIME_WORKLOADS = {
    "gpt2-tiny": {"shape": "GPT-2 4 layers x 256, vocab 512, 4 x 128 tokens per rank", "full": (60, 3),
                  "quick": (6, 2), "block": 3, "timeout": 1200},
    "gpt2-small-cpu": {"shape": "GPT-2 6 layers x 512, vocab 8192, 2 x 256 tokens per rank", "full": (30, 2),
                       "quick": (4, 1), "block": 2, "timeout": 2400},
}
# Steps per system: enough that two systems of equal speed read within about 1% of each other (the
# compiled goals are parity goals; at 14 steps of gpt2-small-cpu two sittings differed by up to 4%).
# The project's targets per workload (issue 34), ratio of the median step to DDP's; a compiled row's
# ("+c") to DDP + compile's in the same run.
GOALS = {"gpt2-tiny": {"zs1": 1.03, "zs2": 1.03, "zs3": 1.10,
                       "zs0+c": 1.00, "zs1+c": 1.00, "zs2+c": 1.00, "zs3+c": 1.00},
         "gpt2-small-cpu": {"zs1": 1.02, "zs2": 1.02, "zs3": 1.05, "zs3@2": 1.10,
                            "zs0+c": 1.00, "zs1+c": 1.00, "zs2+c": 1.00, "zs3+c": 1.00}}
# Issue 34's goal on a phase rather than the whole step: stage 0's step phase at most DDP's, at DDP's work
# (zs0-nonorm: config grad_norm=False). The default's (zs0) is shown beside it with no goal: it measures
# the gradient's global norm for stats(), a pass over the gradient DDP does not make.
PHASE_GOALS = {"zs0": ("step", None), "zs0-nonorm": ("step", 1.00)}
PHASES = ("forward", "backward", "step")  # step_time.py's phases_s keys
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (per block)", "zs0": "zeroshard stage 0",
          "zs1": "zeroshard stage 1", "zs2": "zeroshard stage 2", "zs3": "zeroshard stage 3",
          "ds1": "DeepSpeed ZeRO-1", "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3",
          "zs3@2": "zeroshard stage 3, 2-chunk rCache", "zs0-nonorm": "zeroshard stage 0, grad_norm off",
          "ddp+c": "torch DDP + compile",
          **{f"zs{i}+c": f"zeroshard stage {i} + compile" for i in range(4)}}


STEP_TIME_SYSTEMS = "ddp,fsdp2,zs0,zs0-nonorm,zs1,zs2,zs3,zs3@2,ddp+c,zs0+c,zs1+c,zs2+c,zs3+c"
DEEPSPEED_SYSTEMS = "ds1,ds2,ds3"


def step_time_command(workload: str, steps: int, warmup: int, block: int, systems: str) -> str:
    return (f"torchrun --standalone --nproc_per_node 2 bench/step_time.py --model {workload} --steps {steps} "
            f"--warmup {warmup} --block {block} --systems {systems}")


def run_step_time(ctx, part):
    """Each workload: one step_time.py launch, DeepSpeed's stages among the systems when
    ZEROSHARD_DEEPSPEED_PYTHON is set (and again without them if that launch fails). A workload that
    fails is recorded and the next one still runs."""
    part["data"] = {"workloads": {}}
    for name in os.listdir(ctx.out):  # the extra workloads' plots of an earlier run
        if name.startswith("step_time_") and name.endswith(".png"):
            os.remove(os.path.join(ctx.out, name))
    ds_python = os.environ.get("ZEROSHARD_DEEPSPEED_PYTHON")
    for workload, w in STEP_TIME_WORKLOADS.items():
        steps, warmup = w["quick"] if ctx.quick else w["full"]
        block = w["block"]
        say(f"  {workload}: {steps} steps ({warmup} warm-up) per system, interleaved in turns of {block}")
        path = ctx.tmp(f"step_time_{workload}.json")
        launches = [(ds_python, f"{STEP_TIME_SYSTEMS},{DEEPSPEED_SYSTEMS}")] if ds_python else []
        launches.append((sys.executable, STEP_TIME_SYSTEMS))
        deepspeed = ({"status": "not installed (set ZEROSHARD_DEEPSPEED_PYTHON to a side environment's python, "
                                "or to a wrapper: see bench/run_all.py)"} if not ds_python else None)
        data = None
        for python, systems in launches:
            try:
                run_command(torchrun(python) + [os.path.join(BENCH, "step_time.py"), "--model", workload,
                                                "--steps", str(steps), "--warmup", str(warmup), "--block", str(block),
                                                "--systems", systems, "--json", path],
                            ctx.log("step_time"), w["timeout"])
                data = load_json(path)
            except Exception as e:
                part["errors"].append(f"{workload}{' with DeepSpeed' if python == ds_python else ''}: {e}")
                part["error_tail"] = getattr(e, "tail", None) or traceback.format_exc().splitlines()
                if python == ds_python:
                    deepspeed = {"status": f"failed: {e}"}
                continue
            data["command"] = step_time_command(workload, steps, warmup, block, systems)
            if python == ds_python:
                deepspeed = {"status": "ran", "version": data["machine"].get("deepspeed"), "python": ds_python}
            break
        if data is None:
            part["data"]["workloads"][workload] = {"status": "failed", "systems": [], "deepspeed": deepspeed}
            continue
        data["deepspeed"] = deepspeed
        part["data"]["workloads"][workload] = data


def reference_losses(data):
    """The workload's fixed reference, else this run's zeroshard stage 0 (else DDP): (losses, what they are)."""
    if data.get("reference_losses"):
        return data["reference_losses"], "the reference (one process training on the global batch)"
    for name in ("zs0", "ddp"):
        r = next((r for r in data["systems"] if r["system"] == name and len(r.get("losses", [])) >= 3), None)
        if r:
            return r["losses"][:3], f"this run's {LABELS[name]} (no fixed reference for this workload)"
    return None, "nothing (no reference and no zs0/DDP row)"


def losses_ok(row, ref) -> bool:
    return ref is not None and len(row.get("losses", [])) >= 3 and all(
        abs(a - b) <= 1e-4 for a, b in zip(row["losses"], ref))


def system_row(data, name):
    """`data`'s row of system `name` with a median step, or None."""
    return next((r for r in data["systems"] if r["system"] == name and "median_s" in r), None)


def step_rows(data):
    """Rows with the ratio to DDP's median step, and a compiled row's to DDP + compile's."""
    ddp, ddpc = system_row(data, "ddp"), system_row(data, "ddp+c")
    rows = []
    for r in data["systems"]:
        r = dict(r)
        if "median_s" in r:
            r["vs_ddp"] = r["median_s"] / ddp["median_s"] if ddp else None
            if r["system"].endswith("+c"):
                r["vs_ddp_compiled"] = r["median_s"] / ddpc["median_s"] if ddpc else None
        rows.append(r)
    return rows


def goal_ratio(r):
    """What a row's goal is read against: its ratio to DDP, a compiled row's to DDP + compile."""
    return r.get("vs_ddp_compiled") if r["system"].endswith("+c") else r.get("vs_ddp")


def ratio_interval(data, r, base, resamples: int = 1000) -> tuple[float, float] | None:
    """A 90% interval of r's median step over base's (both rows of `data`), resampling the rounds of
    the interleaved run: a round's steps of every system ran side by side, so resampling rounds
    keeps each pair together while the machine's drift between rounds becomes the spread. None
    without both rows' step times."""
    if not base or "step_times_s" not in r or "step_times_s" not in base:
        return None
    block, warmup = max(1, data.get("block", 1)), data.get("warmup", 0)

    def by_round(times):
        rounds = collections.defaultdict(list)
        for t, s in enumerate(times):
            rounds[(warmup + t) // block].append(s)
        return rounds
    mine, theirs = by_round(r["step_times_s"]), by_round(base["step_times_s"])
    keys = sorted(set(mine) & set(theirs))
    if len(keys) < 2:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(resamples):
        pick = [rng.choice(keys) for _ in keys]
        ratios.append(statistics.median([s for k in pick for s in mine[k]])
                      / statistics.median([s for k in pick for s in theirs[k]]))
    ratios.sort()
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def goal_base(data, r):
    """The row a goal's ratio is read against: DDP, or for a compiled row DDP + compile."""
    return system_row(data, "ddp+c" if r["system"].endswith("+c") else "ddp")


def goal_cell(workload, r) -> str:
    goal = GOALS.get(workload, {}).get(r["system"])
    if goal is None:
        return ""
    against = " of DDP + compile" if r["system"].endswith("+c") else ""
    if goal_ratio(r) is None:
        return f"<= {goal:.2f}{against}"
    return f"<= {goal:.2f}{against} ({goal_ratio(r):.2f}: {'met' if goal_ratio(r) <= goal else 'not met'})"


def phase_goal(rows, r):
    """(phase, ratio of r's median phase to DDP's or None, goal) for a row of a PHASE_GOALS system."""
    phase, goal = PHASE_GOALS[r["system"]]
    ddp = next((d for d in rows if d["system"] == "ddp" and (d.get("phases_s") or {}).get(phase)), None)
    mine = (r.get("phases_s") or {}).get(phase)
    return phase, (mine / ddp["phases_s"][phase] if ddp and mine is not None else None), goal


def render_step_time(ctx, part):
    workloads = part["data"]["workloads"]
    md = ["Per workload: every system built in one launch and run interleaved, in turns of a few steps, the "
          "order rotated each round, so the machine's drifting speed falls on all alike. Within a turn steps run "
          "back to back, a step lasting from its forward's start to the next forward's start (work a step leaves "
          "running is paid inside the next; at a turn's end the system waits for it, in its last step). Each "
          "system's median step, its ratio to DDP's, and the median of each phase: forward (the model call "
          "producing the loss), backward (`loss.backward()` / `engine.backward(loss)`) and step (optimizer step + "
          "`zero_grad` / `engine.step()`, up to the next forward), read with `perf_counter` at the phase "
          "boundaries (no synchronisation added). A step is as slow as its slowest rank, and its phases are that "
          "rank's; the three phase medians need not add up to the median step. AdamW, fp32, 2 ranks over gloo, "
          "1 thread each.", "",
          "Goals (ratio to DDP): " + "; ".join(
              f"{wl} " + ", ".join(f"{LABELS[s].replace('zeroshard ', '')} <= {g:.2f}" for s, g in goals.items())
              for wl, goals in GOALS.items()) + "; on both, "
          + ", ".join(f"{LABELS[s].replace('zeroshard ', '')}: its {ph} phase <= {g:.2f} of DDP's"
                      for s, (ph, g) in PHASE_GOALS.items() if g is not None) + "."]
    summary = []
    plots = []
    for workload, data in workloads.items():
        md += ["", f"### {workload}", ""]
        if "machine" not in data:
            md.append(f"{data.get('status', 'not run')}")
            ds = data.get("deepspeed") or {}
            if ds.get("status"):
                md.append(f"\nDeepSpeed: {ds['status']}.")
            continue
        rows = step_rows(data)
        ds = data.get("deepspeed") or {}
        ref, ref_what = reference_losses(data)
        md += [f"`{data['command']}`: {STEP_TIME_WORKLOADS[workload]['shape']}; median over "
               f"{data['steps'] - data['warmup']} timed steps ({data['warmup']} warm-up) per system.", "",
               "| system | median step (s) | vs DDP | forward (s) | backward (s) | step (s) | first three losses | "
               "losses | anchor vs DDP (s) | goal vs DDP |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            anchor = ANCHORS.get(r["system"]) if workload == ANCHORS_WORKLOAD else None
            anchor_s = f"{anchor[1]:.2f} ({anchor[0]:.3f})" if anchor else ""
            goal = goal_cell(workload, r)
            name = LABELS.get(r["system"], r["system"])
            if "median_s" not in r:
                err = r.get("error", "no result").strip().splitlines()[-1]
                md.append(f"| {name} | failed: {err} | | | | | | | {anchor_s} | {goal} |")
                continue
            ratio = f"{r['vs_ddp']:.2f}" if r.get("vs_ddp") is not None else "-"
            ph = r.get("phases_s") or {}
            phases = " | ".join(f"{ph[k]:.3f}" if k in ph else "-" for k in PHASES)
            losses = ", ".join(f"{v:.6f}" for v in r["losses"][:3])
            md.append(f"| {name} | {r['median_s']:.3f} | {ratio} | {phases} | {losses} | "
                      f"{'ok' if losses_ok(r, ref) else 'MISMATCH'} | {anchor_s} | {goal} |")
            if r["system"] in GOALS.get(workload, {}) or r["system"] in PHASE_GOALS:
                summary.append((workload, r, rows))
        md.append("")
        compiled = [r for r in rows if r.get("compile_s") is not None]
        if compiled:
            md.append("Compile time, apart from the step (the warm-up steps beyond as many median steps): "
                      + ", ".join(f"{LABELS.get(r['system'], r['system'])} {r['compile_s']:.1f} s" for r in compiled)
                      + ". Compiled rows' losses agree within fp32 rounding (inductor's fused kernels).")
        md.append(f"Losses: ok = within 1e-4 of {ref_what}"
                  + (f": {', '.join(f'{v:.6f}' for v in ref)}." if ref else "."))
        if workload == ANCHORS_WORKLOAD:
            md.append("Anchors: shared/notes/anchors.md, measured on another 2-core machine of this kind; compare "
                      "the ratios, not the seconds.")
        if ds.get("status") == "ran":
            md.append(f"\nDeepSpeed {ds.get('version')} (bench/deepspeed_step.py: torch AdamW as a client optimizer, "
                      f"fp32, default buckets) ran in the same launch, under {ds.get('python')}.")
        else:
            md.append(f"\nDeepSpeed: {ds.get('status', 'not run')}."
                      + (" Its anchors: ZeRO-1 1.30, ZeRO-2 1.13, ZeRO-3 1.49." if workload == ANCHORS_WORKLOAD else ""))
        png = plot_step_time(ctx, rows, data, workload)
        if png:
            plots.append(png)
    if summary:
        md += ["", "### Goals", "",
               "90% interval: of the ratio, resampling the interleaved run's rounds (ratio_interval); where the "
               "ratio misses its goal but the interval reaches it, the miss is within this run's noise.", "",
               "| workload | system | vs DDP (compiled: vs DDP + compile) | 90% interval | goal | met |",
               "|---|---|---|---|---|---|"]
        for workload, r, rows in summary:
            interval = None
            what = LABELS[r["system"]]
            if r["system"] in PHASE_GOALS:
                phase, got, goal = phase_goal(rows, r)
                what += f", {phase} phase (vs DDP's)"
            else:
                got, goal = goal_ratio(r), GOALS[workload][r["system"]]
                interval = ratio_interval(workloads[workload], r, goal_base(workloads[workload], r))
            met = "-" if got is None or goal is None else ("yes" if got <= goal else "no")
            if met == "no" and interval and interval[0] <= goal:
                met = "no (within noise)"
            ratio = f"{got:.3f}" if got is not None else "-"
            spread = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "-"
            bound = f"<= {goal:.2f}" if goal is not None else "none (with the gradient's norm, which DDP does not make)"
            md.append(f"| {workload} | {what} | {ratio} | {spread} | {bound} | {met} |")
    return md, plots


def plot_step_time(ctx, rows, data, workload):
    plt = ctx.pyplot()
    if plt is None:
        return None
    rows = [r for r in rows if "median_s" in r]
    if not rows:
        return None
    family = {"ddp": "#7f7f7f", "fsdp": "#1f77b4", "zs": "#ff7f0e", "ds": "#9467bd"}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    x = range(len(rows))
    colors = [next((c for k, c in family.items() if r["system"].startswith(k)), "#8c564b") for r in rows]
    bars = ax.bar(x, [r["median_s"] for r in rows], color=colors)
    for b, r in zip(bars, rows):
        if r.get("vs_ddp") is not None:
            ax.annotate(f"{r['vs_ddp']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    ddp = next((r for r in rows if r["system"] == "ddp"), None)
    marks = []
    if ddp:
        ax.axhline(ddp["median_s"], color="#7f7f7f", lw=0.8, ls=":", label="DDP (this run)")
        # DDP's own anchor is 1.00 by definition: the dotted line already shows it.
        anchors = [(i, ANCHORS[r["system"]][1] * ddp["median_s"]) for i, r in enumerate(rows)
                   if workload == ANCHORS_WORKLOAD and r["system"] in ANCHORS and r["system"] != "ddp"]
        if anchors:
            ax.scatter(*zip(*anchors), marker="D", facecolors="none", edgecolors="black", zorder=3,
                       label="peer anchor: its ratio x this run's DDP")
        goals_of = GOALS.get(workload, {})
        goals = [(i, goals_of[r["system"]] * ddp["median_s"]) for i, r in enumerate(rows) if r["system"] in goals_of]
        if goals:
            ax.scatter(*zip(*goals), marker="_", s=400, color="red", zorder=3, label="goal: ratio x this run's DDP")
        marks = [y for _, y in anchors + goals]
    ax.set_xticks(list(x))
    ax.set_xticklabels([LABELS.get(r["system"], r["system"]).replace(" (per block)", "").replace(" ", "\n", 1)
                        for r in rows], fontsize=8)
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"{workload}, {data['machine']['world']} ranks (gloo, CPU): step time, labels = ratio to DDP")
    ax.legend(fontsize=8, loc="best")
    ax.set_ylim(0, max([b.get_height() for b in bars] + marks) * 1.25)
    # gpt2-tiny keeps the name the README shows.
    return ctx.save(fig, "step_time.png" if workload == ANCHORS_WORKLOAD else f"step_time_{workload}.png")
