"""Every benchmark of the project in one run: JSON, markdown tables for the README, PNG plots.

    python bench/run_all.py [--out DIR] [--only part,part] [--quick] [--force-gpu-smoke]

Parts (each runs the benchmark script named, as a subprocess, and reads its --json output):

- step_time: bench/step_time.py under torchrun, 2 ranks: torch DDP, torch FSDP2, zeroshard stages
  0-3, stage 0 with config grad_norm=False (zs0-nonorm: DDP's work, for the goal on stage 0's step
  phase, PHASE_GOALS) and stage 3 with a 2-chunk rCache (zs3@2), and compiled (inductor): DDP + compile and zeroshard
  stages 0-3 with config compile=True, their compile time apart and their goal read against DDP +
  compile's step, on each workload of STEP_TIME_WORKLOADS (--model gpt2-tiny, 60 steps in turns of 3; --model
  gpt2-small-cpu, 30 steps in turns of 2; 6 and 4 with --quick), every system built first and then
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
import datetime
import json
import os
import platform
import shlex
import sys
import time
import traceback

import torch

from launch import ROOT, T0, CommandFailed, gpu_name, say
from parts_memory import (render_comm, render_memory, render_sharded_load, render_timeline, run_comm, run_memory,
                          run_sharded_load, run_timeline)
from parts_offload import (render_cpu_adam, render_disk_tier, render_gpu, render_profile_plan, run_cpu_adam,
                           run_disk_tier, run_gpu, run_profile_plan)
from parts_step_time import render_step_time, run_step_time

PARTS = ["step_time", "comm", "memory", "timeline", "cpu_adam", "profile_plan", "sharded_load", "disk_tier", "gpu"]
# GPU part: GPT-2 sizes in billions of parameters, tried in order until one does not fit.
GPU_SIZES_B = [1, 2, 4, 6, 8, 10, 12, 15, 20, 30, 40, 60, 80, 100]


# -- the parts: run() fills part["data"]; render() gives markdown lines and plots ---------------------

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
