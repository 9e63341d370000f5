"""Where each system's CPU time goes, symbol by symbol, against the first system's (Linux `perf`).

    python bench/perf_symbols.py [--model gpt2-tiny] [--systems ddp,zs1,zs3] [--seconds 15]
        [--top 30] [--keep DIR]

Timing a step says how much slower a system is; this says in which functions. For each system in
turn, two ranks (gloo, one thread each, as `step_time.py` runs them) train the workload after 8
warm-up steps, while `perf record` samples both processes at 1999 Hz for --seconds. Each symbol's
samples become milliseconds of CPU per step per rank (samples / 1999 Hz / steps in the window / 2).
Printed: the total per system, then the --top symbols by the largest difference from the first
system (each system's milliseconds and its difference), with the shared object holding each.

Needs `perf` on the PATH and the right to record other processes (root, or
/proc/sys/kernel/perf_event_paranoid at 1 or below). Python frames show as the interpreter's own
functions (`_PyEval_EvalFrameDefault`): that line is the Python a system runs, all of it together.
Runs are one system at a time, not interleaved: compare systems of one invocation, and repeat it
before trusting a difference under about 0.3 ms. This is how the gloo reduce-scatter's slow
`torch.sum` over dim 0 was found (README, issue 34).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HZ = 1999
WARMUP = 8
# perf's lines: "  12.34%  5678  libtorch_cpu.so  [.] symbol"
LINE = re.compile(r"\s+[0-9.]+%\s+(\d+)\s+(\S+)\s+\[.\]\s+(.*)")
# torch's elementwise kernels, named by the op they run: "loop<add_kernel>" (their full names are a screen long)
KERNEL = re.compile(r"c10::function_ref<.*?callback_fn<at::native::\w+::VectorizedLoop2d<at::native::"
                    r"(?:\(anonymous namespace\)::)?(?:\w+::)?")


def worker(args) -> None:
    """One rank: build the system, warm up, write this process's pid, then train until killed."""
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    import step_time
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = argparse.Namespace(model=args.model, cache_chunks=None, check_order=True, grad_norm=True)
    phases, _ = step_time.build(args.system, run)
    data = step_time.make_data(args.model, 8, dist.get_world_size())
    steps, start = 0, None
    while True:
        loss = phases.forward(data[steps % 8, rank])
        phases.backward(loss)
        phases.step()
        steps += 1
        if steps == WARMUP:
            dist.barrier()
            with open(os.path.join(args.pids, f"{rank}.tmp"), "w") as f:
                f.write(str(os.getpid()))
            os.replace(os.path.join(args.pids, f"{rank}.tmp"), os.path.join(args.pids, str(rank)))
            start = time.perf_counter()
        elif start is not None:  # the parent reads the step time from here when the window ends
            with open(os.path.join(args.pids, f"steps{rank}"), "w") as f:
                f.write(f"{steps - WARMUP} {time.perf_counter() - start}")


def record(system: str, args, out: str, label: str) -> tuple[float, str]:
    """Run `system` on 2 ranks and sample them for args.seconds; returns (s per step, perf data),
    the files named by `label`."""
    pids = tempfile.mkdtemp(prefix="pids-", dir=out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", "--system", system, "--model", args.model, "--pids", pids]
    log = open(os.path.join(out, f"{label}.log"), "w")
    ranks = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    data = os.path.join(out, f"{label}.data")
    try:
        deadline = time.time() + 600
        while not all(os.path.exists(os.path.join(pids, str(r))) for r in (0, 1)):
            if ranks.poll() is not None or time.time() > deadline:
                log.flush()
                lines = open(log.name).read().splitlines()
                errors = [x for x in lines if re.search(r"\w+(Error|Exception)\b", x) and "ChildFailed" not in x]
                raise SystemExit(f"perf_symbols: {system} did not start: " + (errors or lines or ["(no output)"])[-1])
            time.sleep(0.2)
        who = ",".join(open(os.path.join(pids, str(r))).read() for r in (0, 1))
        subprocess.run(["perf", "record", "-F", str(HZ), "-p", who, "-o", data, "--", "sleep", str(args.seconds)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        steps, seconds = map(float, open(os.path.join(pids, "steps0")).read().split())
    finally:
        if ranks.poll() is None:
            os.killpg(ranks.pid, 15)
        ranks.wait()
        log.close()
    return seconds / steps, data


def per_symbol(data: str, step_s: float, seconds: float) -> dict[tuple[str, str], float]:
    """(shared object, symbol) -> ms of CPU per step per rank."""
    report = subprocess.run(["perf", "report", "-i", data, "--sort", "dso,sym", "--stdio", "-n"],
                            capture_output=True, text=True, check=True).stdout
    samples = collections.Counter()
    for line in report.splitlines():
        m = LINE.match(line)
        if m:
            symbol = m.group(3)
            if KERNEL.match(symbol):  # "loop<add_kernel>"
                symbol = "loop<" + KERNEL.sub("", symbol).split("(", 1)[0] + ">"
            samples[(m.group(2), symbol)] += int(m.group(1))
    steps = seconds / step_s
    return {key: n / HZ / steps / 2 * 1e3 for key, n in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--systems", default="ddp,zs1,zs3",
                   help="step_time.py's names; the first is the baseline; one named twice runs twice")
    p.add_argument("--seconds", type=float, default=15.0, help="sampling window per system (s)")
    p.add_argument("--top", type=int, default=30, help="symbols printed")
    p.add_argument("--keep", help="keep perf's data and the ranks' logs in this folder")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--pids", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if shutil.which("perf") is None:
        raise SystemExit("perf_symbols: needs Linux `perf` on the PATH (linux-tools / linux-perf)")
    names = [s for s in args.systems.split(",") if s]
    # A system named twice is run twice, the second as "name#2": the spread between two runs of one
    # system is the noise any difference must stand above
    systems = [s if names[:i].count(s) == 0 else f"{s}#{names[:i].count(s) + 1}" for i, s in enumerate(names)]
    if len(systems) < 2:
        raise SystemExit("perf_symbols: --systems needs a baseline and at least one system to compare")
    out = args.keep or tempfile.mkdtemp(prefix="perf-symbols-")
    os.makedirs(out, exist_ok=True)
    try:
        ms = {}
        for name, s in zip(names, systems):
            step_s, data = record(name, args, out, s)
            ms[s] = per_symbol(data, step_s, args.seconds)
            print(f"{s}: {step_s * 1e3:.1f} ms a step (not interleaved), {sum(ms[s].values()):.1f} ms of CPU "
                  "per step per rank sampled", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    base = ms[systems[0]]
    keys = set().union(*ms.values())
    order = sorted(keys, key=lambda k: -max(abs(ms[s].get(k, 0.0) - base.get(k, 0.0)) for s in systems[1:]))
    print(f"\nms of CPU per step per rank, by symbol; difference from {systems[0]}'s")
    print("  ".join(f"{s:>16s}" for s in systems) + "  object          symbol")
    for k in order[:args.top]:
        cells = [f"{base.get(k, 0.0):16.3f}"]
        cells += [f"{ms[s].get(k, 0.0):8.3f} ({ms[s].get(k, 0.0) - base.get(k, 0.0):+6.3f})" for s in systems[1:]]
        print("  ".join(cells) + f"  {k[0][:14]:14s}  {k[1][:90]}")


if __name__ == "__main__":
    main()
