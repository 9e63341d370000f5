"""Every benchmark of the project in one run: JSON, markdown tables for the README, PNG plots.

    python bench/run_all.py [--out DIR] [--only part,part] [--quick] [--force-gpu-smoke]

Parts (each runs the benchmark script named, as a subprocess, and reads its --json output):

- step_time: bench/step_time.py under torchrun, 2 ranks: torch DDP, torch FSDP2, zeroshard stages
  0-3 and stage 3 with a 2-chunk rCache (zs3@2), and compiled (inductor): DDP + compile and zeroshard
  stages 0-3 with config compile=True, their compile time apart and their goal read against DDP +
  compile's step, on each workload of STEP_TIME_WORKLOADS (--model gpt2-tiny, 30 steps in turns of 3; --model
  gpt2-small-cpu, 14 steps in turns of 2; 6 and 4 with --quick), every system built first and then
  run interleaved, turn by turn: per system the median step, its ratio to DDP, the median forward,
  backward and optimizer-step phases, and the goal (GOALS, per workload). gpt2-tiny's rows sit next
  to the peer figures of shared/notes/anchors.md (measured on another machine of this kind, so
  ratios to DDP are compared, not seconds). DeepSpeed ZeRO 1-3 (ds1-ds3, bench/deepspeed_step.py)
  join the same launch, interleaved with the others, when ZEROSHARD_DEEPSPEED_PYTHON names the python
  of an environment with deepspeed; the launch then runs under that python. It may be a wrapper: with
  DeepSpeed and the pure-Python packages it needs beyond the project's environment installed in side
  folders (`pip install --no-deps --target /tmp/site deepspeed==0.19.8 hjson ...`; here /tmp/site
  and /tmp/ds-extra with psutil, einops, msgpack, ninja, py-cpuinfo, nvidia-ml-py), a script

      #!/bin/sh
      PYTHONPATH="/tmp/site:/tmp/ds-extra${PYTHONPATH:+:$PYTHONPATH}" exec /work/main/.venv/bin/python "$@"

  saved as /tmp/ds-python (chmod +x) and ZEROSHARD_DEEPSPEED_PYTHON=/tmp/ds-python; it is launched as
  `$ZEROSHARD_DEEPSPEED_PYTHON -m torch.distributed.run ...`, whose workers inherit the PYTHONPATH. If
  that launch fails, the workload runs again without DeepSpeed and the failure is recorded.
- comm: elements each rank moves per step in units of Psi (step_time's gpt2-tiny zeroshard rows, plus
  stage 3 with rCaches of 1 and 2 chunks), against the ZeRO paper's 2, 2, 2, 3 Psi.
- memory: model-state bytes per rank for stages 0-3 at world sizes 1-3 (bench/model_states.py)
  against ZeRO's Table 1.
- cpu_adam: bench/cpu_adam.py, 64M elements (8M with --quick).
- profile_plan: bench/profile_plan.py: OPT-175B meta profile, chunk search, activation prediction.
- sharded_load: bench/sharded_load.py: each rank's peak memory while a pretrained GPT-2 medium (355M)
  is built and loaded at world 3, stage 3, bf16: built normally, or on the meta device with
  `weights=` or `load_weights`, against the goal of 0.6 x its fp32 bytes (GPT-2 2 x 256 with --quick).
- disk_tier: bench/disk_tier.py: a 2.0B-parameter GPT-2 (bf16, AdamW: 30 GiB of model states) built on
  the meta device trains 2 steps at world 1 with offload_optimizer='disk' in a directory under the
  output folder (removed after): peak resident memory against RAM, the step split into forward+backward,
  I/O waits and compute, the disk bandwidth achieved against the raw bandwidth measured in the same
  run (GPT-2 2 x 256 with --quick). About 10 minutes and 40 GB of free disk.
- gpu: on a CUDA machine only, bench/offload_gpt2.py on GPT-2 sizes from 1B up to the first that does
  not fit; "skipped: no GPU" elsewhere. --force-gpu-smoke runs two tiny configurations on the CPU
  instead, to exercise the part's code.

Output in DIR (default bench/results/): results.json, results.md (starting with the machine),
<part>.png (step_time_gpt2-small-cpu.png beside step_time.png), logs/<part>.log, raw/ (each script's
JSON). About 15 minutes on a 2-core CPU (step_time with both workloads and DeepSpeed about 10 of them),
3-4 with --quick. A part that fails is recorded (error and log tail) and the others still run; the
exit status is 1 if any part failed.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch

MIB = 2**20
BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
PARTS = ["step_time", "comm", "memory", "timeline", "cpu_adam", "profile_plan", "sharded_load", "disk_tier", "gpu"]

# Peers on gpt2-tiny (ANCHORS_WORKLOAD only), from shared/notes/anchors.md: (step seconds, ratio to DDP) on a
# machine of this kind.
ANCHORS = {"ddp": (0.178, 1.00), "fsdp2": (0.401, 2.25), "ds1": (0.232, 1.30), "ds2": (0.201, 1.13),
           "ds3": (0.265, 1.49)}
ANCHORS_WORKLOAD = "gpt2-tiny"
# The step_time part's workloads (bench/step_time.py's WORKLOADS), in order: what the table says of each,
# and (steps, warmup) for a full run and for --quick; timeout in seconds per launch.
STEP_TIME_WORKLOADS = {
    "gpt2-tiny": {"shape": "GPT-2 4 layers x 256, vocab 512, 4 x 128 tokens per rank", "full": (30, 3),
                  "quick": (6, 2), "block": 3, "timeout": 900},
    "gpt2-small-cpu": {"shape": "GPT-2 6 layers x 512, vocab 8192, 2 x 256 tokens per rank", "full": (14, 2),
                       "quick": (4, 1), "block": 2, "timeout": 1500},
}
# The project's targets per workload (issue 34), ratio of the median step to DDP's; a compiled row's
# ("+c") to DDP + compile's in the same run.
GOALS = {"gpt2-tiny": {"zs1": 1.03, "zs2": 1.03, "zs3": 1.10,
                       "zs0+c": 1.00, "zs1+c": 1.00, "zs2+c": 1.00, "zs3+c": 1.00},
         "gpt2-small-cpu": {"zs1": 1.02, "zs2": 1.02, "zs3": 1.05, "zs3@2": 1.10,
                            "zs0+c": 1.00, "zs1+c": 1.00, "zs2+c": 1.00, "zs3+c": 1.00}}
PHASES = ("forward", "backward", "step")  # step_time.py's phases_s keys
LABELS = {"ddp": "torch DDP", "fsdp2": "torch FSDP2 (per block)", "zs0": "zeroshard stage 0",
          "zs1": "zeroshard stage 1", "zs2": "zeroshard stage 2", "zs3": "zeroshard stage 3",
          "ds1": "DeepSpeed ZeRO-1", "ds2": "DeepSpeed ZeRO-2", "ds3": "DeepSpeed ZeRO-3",
          "zs3@2": "zeroshard stage 3, 2-chunk rCache", "ddp+c": "torch DDP + compile",
          **{f"zs{i}+c": f"zeroshard stage {i} + compile" for i in range(4)}}
COMM_CACHE_CHUNK = 415424  # elements: an eighth of gpt2-tiny (the default before chunks had a 4M-element floor)
PAPER_COMM_PSI = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}  # ZeRO section 7: all-reduce 2, stage 3 1.5x that
# shared/notes/anchors.md, 64M fp32 elements on a machine of this kind: G elements/s.
ADAM_ANCHORS = {"torch AdamW (for-loop)": 0.21, "torch AdamW (foreach)": 0.41, "torch AdamW (fused)": 3.4,
                "DeepSpeedCPUAdam": 1.9}
# GPU part: GPT-2 sizes in billions of parameters, tried in order until one does not fit.
GPU_SIZES_B = [1, 2, 4, 6, 8, 10, 12, 15, 20, 30, 40, 60, 80, 100]

T0 = time.perf_counter()


def say(msg: str) -> None:
    m, s = divmod(time.perf_counter() - T0, 60)
    print(f"[{int(m):2d}:{s:04.1f}] {msg}", flush=True)


# -- running the benchmark scripts -------------------------------------------------------------------

class CommandFailed(Exception):
    def __init__(self, msg: str, tail: list[str], output: list[str] | None = None):
        super().__init__(msg)
        self.tail = tail  # the lines that say why, for the report
        self.output = output if output is not None else tail  # the last few hundred lines, to classify the failure


def error_excerpt(lines: list[str]) -> list[str]:
    """The lines that say why: up to the last exception line of the benchmark itself (torchrun's own
    ChildFailedError report, which follows a worker's failure, says only that a worker failed)."""
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line) and "ChildFailedError" not in line:
            start = max((j for j in range(i + 1) if lines[j].startswith("Traceback")), default=max(0, i - 12))
            return lines[max(start, i - 15):i + 1]
    return lines[-15:]


def child_env(cpu_only: bool) -> dict:
    env = os.environ.copy()
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"  # progress lines should reach us as they are printed
    if cpu_only:
        # The gloo/CPU benchmarks: with a GPU visible, zeroshard would put each rank on cuda:LOCAL_RANK.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Ends the child's process group (torchrun's workers included): it was started in a session of
    its own, so the group holds only what this script launched."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(cmd: list[str], log_path: str, timeout: float, cpu_only: bool = True) -> list[str]:
    """Runs cmd from the repo root, its output echoed (indented) and appended to log_path. Returns the
    last lines of output; raises CommandFailed on a non-zero exit or when it runs past timeout."""
    tail: collections.deque[str] = collections.deque(maxlen=300)
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        say("  $ " + shlex.join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(cpu_only), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                tail.append(line.rstrip("\n"))
                print("      " + line.rstrip("\n"), flush=True)
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            reader.join(timeout=5)
            raise CommandFailed(f"timed out after {timeout:.0f} s: {shlex.join(cmd)}", list(tail)[-15:], list(tail))
        except BaseException:  # Ctrl-C: leave no benchmark running behind us
            _stop(proc)
            raise
        reader.join(timeout=5)
    if rc != 0:
        what = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        excerpt = error_excerpt(list(tail))
        raise CommandFailed(f"{excerpt[-1].strip() if excerpt else what} ({what}: {shlex.join(cmd)})", excerpt,
                            list(tail))
    return list(tail)


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def torchrun(python: str) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


# -- the parts: run() fills part["data"]; render() gives markdown lines and plots ---------------------

STEP_TIME_SYSTEMS = "ddp,fsdp2,zs0,zs1,zs2,zs3,zs3@2,ddp+c,zs0+c,zs1+c,zs2+c,zs3+c"
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


def step_rows(data):
    """Rows with the ratio to DDP's median step, and a compiled row's to DDP + compile's."""
    ddp = next((r for r in data["systems"] if r["system"] == "ddp" and "median_s" in r), None)
    ddpc = next((r for r in data["systems"] if r["system"] == "ddp+c" and "median_s" in r), None)
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


def goal_cell(workload, r) -> str:
    goal = GOALS.get(workload, {}).get(r["system"])
    if goal is None:
        return ""
    against = " of DDP + compile" if r["system"].endswith("+c") else ""
    if goal_ratio(r) is None:
        return f"<= {goal:.2f}{against}"
    return f"<= {goal:.2f}{against} ({goal_ratio(r):.2f}: {'met' if goal_ratio(r) <= goal else 'not met'})"


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
              for wl, goals in GOALS.items()) + "."]
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
            if r["system"] in GOALS.get(workload, {}):
                summary.append((workload, r))
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
        md += ["", "### Goals", "", "| workload | system | vs DDP (compiled: vs DDP + compile) | goal | met |",
               "|---|---|---|---|---|"]
        for workload, r in summary:
            goal = GOALS[workload][r["system"]]
            got = goal_ratio(r)
            met = "-" if got is None else ("yes" if got <= goal else "no")
            ratio = f"{got:.2f}" if got is not None else "-"
            md.append(f"| {workload} | {LABELS[r['system']]} | {ratio} | <= {goal:.2f} | {met} |")
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


def run_cpu_adam(ctx, part):
    numel, reps = ("8M", 3) if ctx.quick else ("64M", 5)
    path = ctx.tmp("cpu_adam.json")
    run_command([sys.executable, os.path.join(BENCH, "cpu_adam.py"), "--numel", numel, "--reps", str(reps),
                 "--json", path], ctx.log("cpu_adam"), 600)
    part["data"] = load_json(path)


def render_cpu_adam(ctx, part):
    d = part["data"]
    md = [f"`python bench/cpu_adam.py --numel {d['numel'] // 2**20}M`: one AdamW step over one flat fp32 tensor of "
          f"{d['numel'] / 2**20:.0f}M elements, {d['threads']} threads, best of the repetitions; memory bandwidth "
          f"measured in the same run: {d['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (best simple stream). "
          "28 bytes per element, 30 with the bf16 copy.", "",
          "| implementation | time (ms) | G elements/s | GB/s | of bandwidth | anchor G elements/s |",
          "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        anchor = ADAM_ANCHORS.get(r["name"])
        md.append(f"| {r['name']} | {r['seconds'] * 1e3:.1f} | {r['elements_per_s'] / 1e9:.2f} | {r['gb_per_s']:.1f} | "
                  f"{r['fraction_of_bandwidth']:.0%} | {anchor if anchor else ''} |")
    if not any(r["name"] == "DeepSpeedCPUAdam" for r in d["rows"]):
        md.append("| DeepSpeedCPUAdam | not installed here | | | | 1.9 |")
    md += ["", "Anchors: shared/notes/anchors.md, 64M elements on another machine of this kind. Over 100% of bandwidth "
           "means the optimizer's several streams get more from memory than the one-stream reference does."]
    if d["numel"] < 64 * 2**20:
        md.append(f"\n(--quick: {d['numel'] / 2**20:.0f}M elements; tensors this small sit partly in the CPU caches, "
                  "so the bandwidth and its fractions are not comparable with the 64M figures.)")
    plt = ctx.pyplot()
    if plt is None:
        return md, []
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    y = range(len(rows))
    bars = ax.barh(list(y), [r["elements_per_s"] / 1e9 for r in rows],
                   color=["#ff7f0e" if r["name"].startswith("zeroshard") else "#1f77b4" for r in rows])
    for b, r in zip(bars, rows):
        ax.annotate(f"{r['elements_per_s'] / 1e9:.2f} ({r['fraction_of_bandwidth']:.0%} of bw)",
                    (b.get_width(), b.get_y() + b.get_height() / 2), va="center", fontsize=8, xytext=(3, 0),
                    textcoords="offset points")
    bound = d["bandwidth_bytes_per_s"] / 28 / 1e9
    ax.axvline(bound, color="red", ls="--", lw=1, label=f"stream bandwidth / 28 B per element ({bound:.2f})")
    ax.set_yticks(list(y))
    ax.set_yticklabels([r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("G elements / s (higher is better)")
    ax.set_xlim(0, max([b.get_width() for b in bars] + [bound]) * 1.35)
    ax.set_title(f"CPU AdamW step, {d['numel'] / 2**20:.0f}M fp32 elements, {d['threads']} threads")
    ax.legend(fontsize=8, loc="upper right")
    return md, [ctx.save(fig, "cpu_adam.png")]


def run_profile_plan(ctx, part):
    path = ctx.tmp("profile_plan.json")
    # Not CPU-only: on a GPU the activation rows are measured on the training device, as the script intends.
    run_command([sys.executable, os.path.join(BENCH, "profile_plan.py"), "--json", path]
                + (["--quick"] if ctx.quick else []), ctx.log("profile_plan"), 600, cpu_only=False)
    part["data"] = load_json(path)


def render_profile_plan(ctx, part):
    d = part["data"]
    o = d["opt175b"]
    gib = 2**30
    md = [f"`python bench/profile_plan.py{' --quick' if ctx.quick else ''}`: OPT-175B ({o['params'] / 1e9:.1f} B "
          "parameters, transformers config) built on the meta device, one micro-batch of 1 x 2048 tokens in bf16.", "",
          "| figure | measured | bar / reference |", "|---|---|---|",
          f"| import transformers (excluded) | {d['import_transformers_s']:.2f} s | |",
          f"| build OPT-175B on meta | {o['build_s']:.2f} s | |"]
    for key, what, ref in (("plain", "without", "< 5 s; anchor ~1.2 s; Elixir paper ~10 s on an A100"),
                           ("checkpointing", "with", "< 5 s")):
        p = o[key]
        md.append(f"| profile, {what} activation checkpointing | {p['profile_s']:.2f} s (saved "
                  f"{p['saved_bytes'] / gib:.1f} GiB, peak {p['peak_activation_bytes'] / gib:.1f} GiB) | {ref} |")
    for c in d["chunk_search"]:
        md.append(f"| chunk search, {c['gpus']} x {c['gpu_memory_bytes'] / 1e9:.0f} GB | {c['candidates']} sizes in "
                  f"{c['search_s']:.2f} s, padding {c['waste']:.3%} (rest of the plan {c['rest_of_plan_s']:.2f} s) | "
                  "< 5 s, padding < 4% |")
    act = d["activations"]
    if act:
        dev = act[0]["device"]
        cuda = any(a.get("cuda_peak") for a in act)
        md += ["", f"Activation bytes predicted on meta against the same step on real tensors ({dev}; bar: within 10%):",
               "", "| GPT-2 (layers x width, vocab, batch x seq) | ckpt | saved pred (MiB) | saved real (MiB) | diff | "
               "peak pred (MiB) | peak real (MiB) | diff |" + (" cuda peak (MiB) |" if cuda else ""),
               "|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "")]
        for a in act:
            row = (f"| {a['n_layer']} x {a['n_embd']}, {a['vocab']}, {a['batch']} x {a['seq']} | "
                   f"{'yes' if a['checkpointing'] else 'no'} | {a['saved_pred'] / 2**20:.1f} | {a['saved_real'] / 2**20:.1f} | "
                   f"{a['saved_pred'] / a['saved_real'] - 1:+.1%} | {a['peak_pred'] / 2**20:.1f} | "
                   f"{a['peak_real'] / 2**20:.1f} | {a['peak_pred'] / a['peak_real'] - 1:+.1%} |")
            if cuda:
                row += f" {a['cuda_peak'] / 2**20:.1f} |" if a.get("cuda_peak") else " |"
            md.append(row)
        if ctx.quick:
            md.append("\n(--quick: the GPT-2 124M rows are left out.)")
    return md, []


def gpt2_shape(billions: float) -> tuple[int, int]:
    """(n_layer, n_embd) for a GPT-2 of about `billions` parameters: widths grow with size as in the
    ZeRO-Offload and Elixir configurations, layers fill up the count (offload_gpt2's parameter formula)."""
    sys.path.insert(0, BENCH)
    from offload_gpt2 import gpt2_params
    d = 2048 if billions < 3 else 3072 if billions < 7 else 4096 if billions < 20 else 5120 if billions < 30 \
        else 6144 if billions < 40 else 8192
    per_layer = gpt2_params(1, d, 1024) - gpt2_params(0, d, 1024)
    return max(1, round((billions * 1e9 - gpt2_params(0, d, 1024)) / per_layer)), d


def host_available() -> int:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", info["MemTotal"])


def out_of_memory(tail: list[str]) -> bool:
    text = "\n".join(tail)
    return "OutOfMemoryError" in text or "out of memory" in text.lower()


def run_gpu(ctx, part):
    smoke = ctx.force_gpu_smoke
    if not torch.cuda.is_available() and not smoke:
        part["status"] = "skipped"
        part["reason"] = "no GPU"
        return
    if smoke and not torch.cuda.is_available():
        # Two tiny models on the CPU: the same commands, parsing, table and plot as on a GPU; then one too
        # large for the host, which takes the stop path without running anything.
        configs = [{"name": "smoke 1 x 128", "n_layer": 1, "n_embd": 128},
                   {"name": "smoke 2 x 128", "n_layer": 2, "n_embd": 128},
                   {"name": "smoke too large", "n_layer": host_available() // (8 * 12 * 1024**2), "n_embd": 1024}]
        seq, batch, steps, warmup = 64, 2, 2, 1
    else:
        configs = [{"name": f"{b}B", **dict(zip(("n_layer", "n_embd"), gpt2_shape(b)))} for b in ctx.gpu_sizes]
        seq, batch = 1024, ctx.gpu_batch
        steps, warmup = (2, 1) if ctx.quick else (4, 2)
    sys.path.insert(0, BENCH)
    from offload_gpt2 import gpt2_params
    device = gpu_name() or "cpu (smoke)"
    part["data"] = {"device": device, "seq": seq, "batch": batch, "steps": steps, "warmup": warmup, "smoke": smoke,
                    "rows": []}
    modes = [False, True]  # offload_params: off first, on where the parameters do not fit the device
    for c in configs:
        psi = gpt2_params(c["n_layer"], c["n_embd"], seq)
        row = {**c, "params": psi}
        part["data"]["rows"].append(row)
        # With the optimizer offloaded the host holds 16 bytes per parameter (masters, Adam states, the
        # gradient shard, the bf16 model built there first); past the host's memory the kernel's OOM killer
        # would end the run, so that size is recorded as not fitting without trying it.
        need = 16 * psi * 1.1
        if need > host_available():
            row["status"] = (f"does not fit host memory: needs ~{need / 2**30:.0f} GiB, "
                             f"{host_available() / 2**30:.0f} GiB available")
            say(f"  {c['name']}: {row['status']}; stopping")
            break
        for offload_params in list(modes):
            path = ctx.tmp(f"gpu_{c['name'].replace(' ', '_')}_{int(offload_params)}.json")
            cmd = [sys.executable, os.path.join(BENCH, "offload_gpt2.py"), "--n-layer", str(c["n_layer"]),
                   "--n-embd", str(c["n_embd"]), "--seq", str(seq), "--batch", str(batch), "--steps", str(steps),
                   "--warmup", str(warmup), "--json", path] + (["--offload-params"] if offload_params else [])
            try:
                run_command(cmd, ctx.log("gpu"), ctx.gpu_timeout, cpu_only=False)
            except CommandFailed as e:
                if out_of_memory(e.output) or "signal 9" in str(e):
                    # Out of device memory with stage 2: stage 3 with parameters offloaded may still fit.
                    row["status"] = "out of memory" + (" (device)" if out_of_memory(e.output) else " (killed: host?)")
                    row.setdefault("attempts", []).append({"offload_params": offload_params, "error": str(e)})
                    if not offload_params and len(modes) > 1:
                        modes.remove(False)  # a larger model will not fit that way either
                    continue
                row["status"] = f"failed: {e}"
                part["errors"].append(f"{c['name']}: {e}")
                part["error_tail"] = e.tail
                return
            row.update(status="ok", result=load_json(path), offload_params=offload_params)
            break
        if row["status"] != "ok":
            say(f"  {c['name']}: {row['status']} with and without offloading parameters; stopping")
            break


def render_gpu(ctx, part):
    d = part["data"]
    md = [f"`bench/offload_gpt2.py` per size on {d['device']}: GPT-2 (vocab 50257, n_head = n_embd / 128), bf16, "
          f"CPUAdamW, zeroshard stage 2 with offload_optimizer (stage 3 + offload_params where that does not fit), "
          f"activation checkpointing, batch {d['batch']} x {d['seq']} tokens, median of {d['steps']} steps after "
          f"{d['warmup']} warm-up. TFLOPS = (6 params + 12 layers n_embd seq) x tokens / step time: checkpointing's "
          "recomputation not counted, as the Elixir and ZeRO-Offload papers count. A size whose offloaded states "
          "(~16 bytes per parameter) exceed the host's available memory is recorded as not fitting without being run.",
          "",
          "| model | layers x width | params (B) | config | step (s) | TFLOPS | exposed step share | "
          "peak device (GiB) | host states (GiB) | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        shape = f"{r['n_layer']} x {r['n_embd']}"
        if r.get("status") == "ok":
            o = r["result"]
            peak = f"{o['peak_device_bytes'] / 2**30:.1f}" if o.get("peak_device_bytes") else "-"
            cfg = "stage 3, offload params + optimizer" if r["offload_params"] else "stage 2, offload optimizer"
            md.append(f"| {r['name']} | {shape} | {r['params'] / 1e9:.2f} | {cfg} | {o['step_s']:.2f} | "
                      f"{o['model_tflops']:.2f} | {o['exposed_step_share']:.0%} | {peak} | "
                      f"{o['model_state_bytes_by_device']['host'] / 2**30:.1f} | ok |")
        else:
            md.append(f"| {r['name']} | {shape} | {r['params'] / 1e9:.2f} | | | | | | | {r.get('status', '?')} |")
    if d["smoke"]:
        md.append("\n(--force-gpu-smoke without a GPU: tiny models on the CPU, to exercise this part; not a result.)")
    md.append("\nElixir's paper, one A100, GPT-2 10B, batch 4-16: 47.9-98.7 TFLOPS (DeepSpeed's best of four ZeRO "
              "configurations 27.6-80.7).")
    plt = ctx.pyplot()
    ok = [r for r in d["rows"] if r.get("status") == "ok"]
    if plt is None or not ok:
        return md, []
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot([r["params"] / 1e9 for r in ok], [r["result"]["model_tflops"] for r in ok], marker="o",
            label="zeroshard + offload")
    for r in ok:
        ax.annotate(r["name"] + (" (params offloaded)" if r.get("offload_params") else ""),
                    (r["params"] / 1e9, r["result"]["model_tflops"]), fontsize=8, xytext=(3, 3), textcoords="offset points")
    bad = [r for r in d["rows"] if r.get("status") != "ok"]
    if bad:
        ax.scatter([r["params"] / 1e9 for r in bad], [0] * len(bad), marker="x", color="red", s=60, zorder=3,
                   clip_on=False, label="does not fit: " + ", ".join(r["name"] for r in bad))
    ax.set_xlabel("model size (billions of parameters)")
    ax.set_ylabel("model TFLOPS (no recomputation counted)")
    ax.set_ylim(0, None)
    ax.set_title(f"GPT-2 with ZeRO-Offload on one device: {d['device']}, batch {d['batch']} x {d['seq']}")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=8)
    return md, [ctx.save(fig, "gpu.png")]


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


def run_disk_tier(ctx, part):
    import shutil
    path = ctx.tmp("disk_tier.json")
    directory = os.path.join(ctx.out, "raw", "disk-tier-files")  # on the disk the results go to
    shutil.rmtree(directory, ignore_errors=True)
    size = ["--n-layer", "2", "--n-embd", "256", "--raw-gib", "0.5"] if ctx.quick else []
    try:
        run_command([sys.executable, os.path.join(BENCH, "disk_tier.py"), "--dir", directory, *size, "--json", path],
                    ctx.log("disk_tier"), 3600)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    part["data"] = load_json(path)


def render_disk_tier(ctx, part):
    d = part["data"]
    gib = 2**30
    md = [f"`python bench/disk_tier.py`: GPT-2 {d['params'] / 1e9:.2f}B parameters, bf16 + CPUAdamW, world 1, "
          f"offload_optimizer='disk': {d['model_state_bytes'] / gib:.1f} GiB of model states against "
          f"{d['ram_bytes'] / gib:.1f} GiB of RAM; peak resident memory {d['peak_rss'] / gib:.1f} GiB. Raw disk "
          f"(the tier's own files, same run): write {d['raw_write_gbs']:.2f} GB/s (a new file "
          f"{d['raw_new_file_write_gbs']:.2f}), read {d['raw_read_gbs']:.2f} GB/s.", "",
          "| step | forward+backward s | optimizer step s | read waits s | write waits s | compute s | read GB at GB/s "
          "(of raw) | written GB at GB/s (of raw) | I/O wait share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in d["steps"]:
        rd = f"{r['read_bytes'] / 1e9:.1f} at {r['read_gbs'] or 0:.2f} ({(r['read_gbs'] or 0) / d['raw_read_gbs']:.0%})"
        wr = f"{r['written_bytes'] / 1e9:.1f} at {r['write_gbs'] or 0:.2f} ({(r['write_gbs'] or 0) / d['raw_write_gbs']:.0%})"
        md.append(f"| {r['step']} | {r['forward_backward_s']:.1f} | {r['optimizer_step_s']:.1f} | {r['read_wait_s']:.1f} | "
                  f"{r['write_wait_s']:.1f} | {r['compute_s']:.1f} | {rd} | {wr} | {r['io_wait_share']:.0%} |")
    return md, []


PART_FUNCS = {
    "step_time": (run_step_time, render_step_time, "Step time"),
    "comm": (run_comm, render_comm, "Communication per step"),
    "memory": (run_memory, render_memory, "Model-state memory per rank"),
    "timeline": (run_timeline, render_timeline, "Memory timeline of the demo"),
    "cpu_adam": (run_cpu_adam, render_cpu_adam, "CPU AdamW"),
    "profile_plan": (run_profile_plan, render_profile_plan, "Profiler and planner"),
    "sharded_load": (run_sharded_load, render_sharded_load, "Building and loading a pretrained model"),
    "disk_tier": (run_disk_tier, render_disk_tier, "The disk tier"),
    "gpu": (run_gpu, render_gpu, "Single-GPU throughput with offload"),
}


# -- machine, context, output -------------------------------------------------------------------------

_GPU_NAME: list = []


def gpu_name() -> str | None:
    """The first GPU's name, asked of a child process: naming it here would create a CUDA context in
    this process, which would hold device memory for the whole run, memory the gpu part's models need."""
    if not _GPU_NAME:
        name = None
        if torch.cuda.is_available():
            got = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                                 capture_output=True, text=True)
            name = got.stdout.strip() or "unknown GPU"
        _GPU_NAME.append(name)
    return _GPU_NAME[0]


def machine() -> dict:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    except OSError:
        mem = None
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    gpu = gpu_name()
    return {"cores": os.cpu_count(), "cpu": model, "memory_bytes": mem, "torch": torch.__version__,
            "transformers": tf, "python": platform.python_version(), "gpu": gpu,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


class Context:
    def __init__(self, args):
        self.out = os.path.abspath(args.out)
        self.quick = args.quick
        self.force_gpu_smoke = args.force_gpu_smoke
        sizes = args.gpu_sizes or ",".join(map(str, GPU_SIZES_B[:2] if args.quick else GPU_SIZES_B))
        self.gpu_sizes = [float(s) if "." in s else int(s) for s in sizes.split(",") if s.strip()]
        self.gpu_batch = args.gpu_batch
        self.gpu_timeout = args.gpu_timeout
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        os.makedirs(os.path.join(self.out, "raw"), exist_ok=True)
        self._plt = None
        self.results = {}

    def log(self, part: str) -> str:
        return os.path.join(self.out, "logs", f"{part}.log")

    def tmp(self, name: str) -> str:
        """The scripts' own JSON, kept next to the results for whoever wants every figure."""
        path = os.path.join(self.out, "raw", name)
        if os.path.exists(path):
            os.remove(path)  # a stale file must not pass for this run's output
        return path

    def pyplot(self):
        if self._plt is None:
            try:
                import matplotlib
                matplotlib.use("Agg")
                import matplotlib.pyplot as plt
                self._plt = plt
            except ImportError:
                self._plt = False
                say("matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return self._plt or None

    def save(self, fig, name: str) -> str:
        fig.tight_layout()
        fig.savefig(os.path.join(self.out, name), dpi=120)
        self._plt.close(fig)
        return name


def write_outputs(ctx: Context) -> None:
    res = ctx.results
    with open(os.path.join(ctx.out, "results.json"), "w") as f:
        # The markdown is in results.md; the JSON keeps the figures.
        json.dump({**res, "parts": {n: {k: v for k, v in p.items() if k != "markdown"} for n, p in res["parts"].items()}},
                  f, indent=1, default=str)
    m = res["machine"]
    mem = f"{m['memory_bytes'] / 2**30:.1f} GiB memory" if m["memory_bytes"] else "memory unknown"
    md = [f"Machine: {m['cores']} cores, {m['cpu']}, {mem}, torch {m['torch']}, "
          f"{('GPU ' + m['gpu']) if m['gpu'] else 'no GPU'}, {m['date']}", "",
          f"`{res['command']}`" + (f", {res['total_s']:.0f} s in all" if res.get("total_s") is not None else "")
          + (" (--quick: fewer steps and elements; for a smoke run, not for the README)" if ctx.quick else "")
          + f"; transformers {m['transformers']}, Python {m['python']}."]
    for name, part in res["parts"].items():
        title = PART_FUNCS[name][2]
        md += ["", f"## {title} (`{name}`)", ""]
        if part["status"] == "skipped":
            md.append(f"skipped: {part.get('reason', '')}")
            continue
        if part["status"] == "running":
            md.append("not finished")
            continue
        for e in part.get("errors", []):
            md.append(f"**FAILED**: {e} (log: `logs/{name}.log`)")
            md.append("")
        if part.get("error_tail"):
            md += ["```", *part["error_tail"][-12:], "```", ""]
        md += part.get("markdown", [])
        for png in part.get("plots", []):
            md += ["", f"![{title}]({png})"]
        md.append(f"\n(this part took {part['seconds']:.0f} s)")
    with open(os.path.join(ctx.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="output folder (default bench/results)")
    ap.add_argument("--only", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="fewer steps and elements everywhere (about 2 minutes)")
    ap.add_argument("--force-gpu-smoke", action="store_true",
                    help="without a GPU, run the gpu part on tiny CPU configurations instead of skipping it")
    ap.add_argument("--gpu-sizes", default=None, help="GPT-2 sizes in billions of parameters for the gpu part, "
                    f"tried in order (default {','.join(map(str, GPU_SIZES_B))}; with --quick the first two)")
    ap.add_argument("--gpu-batch", type=int, default=8, help="samples of 1024 tokens per step in the gpu part")
    ap.add_argument("--gpu-timeout", type=float, default=1200, help="seconds allowed per size in the gpu part")
    args = ap.parse_args()
    only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {PARTS}")
    only = [p for p in PARTS if p in only]  # the order above: comm reuses step_time's figures

    ctx = Context(args)
    for name in os.listdir(os.path.join(ctx.out, "logs")):
        os.remove(os.path.join(ctx.out, "logs", name))
    ctx.results = {"machine": machine(), "command": "python bench/run_all.py " + shlex.join(sys.argv[1:]),
                   "quick": args.quick, "parts": {}, "total_s": None}
    m = ctx.results["machine"]
    say(f"machine: {m['cores']} cores, {m['cpu']}, torch {m['torch']}, {'GPU ' + m['gpu'] if m['gpu'] else 'no GPU'}; "
        f"parts: {', '.join(only)}; output {ctx.out}")
    interrupted = False
    for i, name in enumerate(only, 1):
        run, render, title = PART_FUNCS[name]
        if os.path.exists(os.path.join(ctx.out, f"{name}.png")):
            os.remove(os.path.join(ctx.out, f"{name}.png"))  # an earlier run's plot must not pass for this one's
        part = {"status": "running", "errors": [], "data": None, "log": f"logs/{name}.log"}
        ctx.results["parts"][name] = part
        say(f"== {name} ({i}/{len(only)}): {title}")
        t = time.perf_counter()
        try:
            run(ctx, part)
        except KeyboardInterrupt:
            part["errors"].append("interrupted")
            interrupted = True
        except Exception as e:
            part["errors"].append(str(e) if isinstance(e, CommandFailed) else f"{type(e).__name__}: {e}")
            part["error_tail"] = getattr(e, "tail", None) or traceback.format_exc().splitlines()
        if part["data"] is not None and part["status"] != "skipped":
            try:
                part["markdown"], part["plots"] = render(ctx, part)
            except Exception as e:  # a figure missing from the JSON must not hide the others
                part["errors"].append(f"rendering: {type(e).__name__}: {e}")
                part["error_tail"] = traceback.format_exc().splitlines()
        part["seconds"] = time.perf_counter() - t
        if part["status"] != "skipped":
            part["status"] = "failed" if part["errors"] else "ok"
        say(f"{name}: {part['status']}{' (' + part.get('reason', '') + ')' if part['status'] == 'skipped' else ''} "
            f"in {part['seconds']:.1f} s" + (f": {'; '.join(part['errors'])}" if part["errors"] else ""))
        write_outputs(ctx)  # after every part, so an interrupted run leaves what it has
        if interrupted:
            break
    ctx.results["total_s"] = time.perf_counter() - T0
    write_outputs(ctx)
    failed = [n for n, p in ctx.results["parts"].items() if p["status"] == "failed"]
    say(f"total {ctx.results['total_s']:.1f} s; wrote {os.path.join(ctx.out, 'results.md')} and results.json"
        + (f"; FAILED: {', '.join(failed)}" if failed else "; all parts ok"))
    return 130 if interrupted else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
