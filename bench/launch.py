"""Launching run_all.py's benchmark scripts: each one a subprocess run from the repository root, its
output echoed and logged, under a time limit, with the lines that say why it failed; and the GPU's
name, asked of a child process.
"""
from __future__ import annotations

import collections
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)

T0 = time.perf_counter()


def say(msg: str) -> None:
    m, s = divmod(time.perf_counter() - T0, 60)
    print(f"[{int(m):2d}:{s:04.1f}] {msg}", flush=True)


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
