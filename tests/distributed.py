"""Run a function on `world` local processes joined in a gloo process group (as torchrun would)."""
from __future__ import annotations

import functools
import os
import socket

import torch.multiprocessing as mp

# What nearly every spawned rank imports: 5-8 s of CPU a rank (torch, transformers' model classes),
# paid by each of the suite's ~70 ranks on 2 cores. On a CPU-only machine ranks are forked from
# multiprocessing's forkserver, one process that imported these once and has run nothing else, so
# each rank is still a fresh process (no process group, no thread pool, no state of another test).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "safetensors.torch", "zeroshard",
           "transformers", "transformers.models.gpt2.modeling_gpt2", "transformers.models.opt.modeling_opt",
           "transformers.models.llama.modeling_llama"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def start_method() -> str:
    """forkserver with PRELOAD imported, or spawn where there is no forkserver or there is CUDA (a
    process that touched nothing of CUDA before its rank starts, as before)."""
    import torch
    if "forkserver" not in mp.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    import multiprocessing
    multiprocessing.set_forkserver_preload(PRELOAD)  # the server skips one it cannot import
    return "forkserver"


def _entry(rank, world, port, fn, args, environ=None):
    if environ is not None:  # the forkserver's environment is the one it started with: take the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    # cuBLAS is deterministic only with a fixed workspace, set before its first use (bit-for-bit
    # checkpoint tests on CUDA); harmless on CPU.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    stacks = float(os.environ.get("ZEROSHARD_RANK_STACKS", 0))
    if stacks > 0:  # debugging a hang: each rank writes its threads' stacks every `stacks` seconds
        import faulthandler  # to a file (pytest captures a child's stderr until the test ends)
        out = open(os.path.join(os.environ.get("ZEROSHARD_STACKS_DIR", "/tmp"), f"zeroshard-stacks-{os.getpid()}.txt"), "w")
        faulthandler.dump_traceback_later(stacks, repeat=True, file=out)
    import torch
    import torch.distributed as dist
    # A world of one runs ZEROSHARD_RANK_THREADS intra-op threads (2 by default: what
    # bench/bit_identity.py's fingerprints were taken with; the thread count changes the bits).
    # The tests set 1 (conftest.py): these models are too small for a second thread to pay, and it
    # waits on a core that, on a shared machine, another process holds (a world-1 scenario took
    # 4-6 s with two threads there, 0.1 s with one).
    torch.set_num_threads(1 if world > 1 else int(os.environ.get("ZEROSHARD_RANK_THREADS", 2)))
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def every_rank(value) -> list:
    """Inside a spawned rank: each rank's `value`, on every rank (a world of one: [value])."""
    import torch.distributed as dist
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def shared_temp_dir(prefix: str = "zeroshard-") -> str:
    """Inside a spawned rank: a new temporary directory made by rank 0, its path on every rank."""
    import tempfile
    import torch.distributed as dist
    made = tempfile.mkdtemp(prefix=prefix) if not dist.is_initialized() or dist.get_rank() == 0 else None
    return every_rank(made)[0]


def record(rank: int, out_path: str, calls, traceback_limit: int = -4) -> None:
    """Inside a spawned rank: run each of `calls` ({name: callable}, or (name, callable) pairs) in
    turn, recording what it returned, or the error it raised ({"error", "traceback"}: the test of
    that name decides); rank 0 writes {name: result} to `out_path` as JSON."""
    import json
    import time
    import traceback
    results, seconds = {}, {}
    for name, fn in (calls.items() if isinstance(calls, dict) else calls):
        start = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 -- recorded; the test for this scenario decides
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=traceback_limit)}
        seconds[name] = time.perf_counter() - start
    times = os.environ.get("ZEROSHARD_SCENARIO_SECONDS")
    if rank == 0 and times:  # where CI's time goes: each scenario's seconds, per world
        with open(times, "a") as f:
            f.writelines(f"{seconds[n]:8.2f} world{int(os.environ.get('WORLD_SIZE', 1))} {out_path} {n}\n"
                         for n in seconds)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, default=str)


def error_on_every_rank(fn) -> list[str]:
    """Inside a spawned rank: what `fn()` raised on each rank ("Type: message", or "no error"), on
    every rank."""
    try:
        fn()
        got = "no error"
    except Exception as e:  # noqa: BLE001 -- the figure is what was raised
        got = f"{type(e).__name__}: {e}"
    return every_rank(got)


def spawn(world: int, fn, *args) -> None:
    """Runs fn(rank, world, *args) in `world` processes (started as start_method() says, each with
    this process's environment as it is now); raises if any of them fails. The free port
    found for the rendezvous can be taken by another process before rank 0 listens on it: then
    (EADDRINUSE, nothing of `fn` ran) it starts again on another port, up to three times."""
    for attempt in range(3):
        try:
            mp.start_processes(_entry, args=(world, free_port(), fn, args, dict(os.environ)), nprocs=world,
                               join=True, start_method=start_method())
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


def cause(e: BaseException) -> str:
    """The last lines of a failure (for a spawned rank: the end of its traceback), to quote in the
    message of every test that depended on it."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: " + " | ".join(lines[-3:])[-600:]


def world2_then_world1(run, root, env: str, subdir: str) -> dict:
    """run(rank, world, out) at world 2, then at world 1 with os.environ[env] naming the world-2
    run's `root/subdir` (what the world-1 run resumes from); both JSON results merged."""
    import json
    spawn(2, run, str(root / "world2.json"))
    os.environ[env] = str(root / subdir)
    try:
        spawn(1, run, str(root / "world1.json"))
    finally:
        del os.environ[env]
    return {**json.loads((root / "world2.json").read_text()), **json.loads((root / "world1.json").read_text())}


def _run_each(rank, world, runs):
    """One spawned world running several scenario registries in turn: `runs` is [(run, out_path)]."""
    for run, out in runs:
        run(rank, world, out)


class WorldResults:
    """Runs `run(rank, world, out_path)` once per world size (rank 0 writes a JSON of figures) and
    keeps what it wrote, or its failure: then every test of that world fails at once.

    Shared (the default): the first test to ask for a world runs every shared registry collected in
    this session at that world, one after another in one spawned world, so each world pays for
    starting its processes (torch, transformers, the process group: 7-12 s) once, not once per test
    module. A registry that raises stops that world; those after it then fail with its cause."""

    _shared: list["WorldResults"] = []

    def __init__(self, run, label: str, shared: bool = True, worlds=(1, 2, 3)):
        """`worlds`: the world sizes this registry's tests ask for (a shared one runs at those only,
        and only once a collected test module names it as its RESULTS: importing it runs nothing)."""
        self.run, self.label, self.worlds, self._cache = run, label, tuple(worlds), {}
        self.shared = shared

    def register(self) -> None:
        """Join the shared run (conftest.py calls it as each test module is collected)."""
        if self.shared and self not in WorldResults._shared:
            WorldResults._shared.append(self)

    def get(self, world: int, tmp_path_factory) -> dict:
        import json
        self.register()
        assert world in self.worlds, (self.label, world, self.worlds)
        if world not in self._cache:
            batch = [r for r in WorldResults._shared if world in r.worlds and world not in r._cache] \
                if self.shared else [self]
            outs = {r: tmp_path_factory.mktemp(f"{r.label}{world}") / "results.json" for r in batch}
            failure: BaseException = RuntimeError("rank 0 wrote no results")
            try:
                spawn(world, _run_each, [(r.run, str(out)) for r, out in outs.items()])
            except BaseException as e:  # noqa: B036  (a timeout too)
                failure = e
            for r, out in outs.items():  # what finished before a failure still counts
                r._cache[world] = json.loads(out.read_text()) if out.exists() else failure
        if isinstance(self._cache[world], BaseException):
            raise RuntimeError(f"the world-{world} {self.label} scenarios did not run: "
                               f"{cause(self._cache[world])}") from self._cache[world]
        return self._cache[world]


def ok(results: dict, name: str) -> dict:
    """A scenario's figures, after checking it did not raise."""
    got = results[name]
    assert got.get("error") is None, f"{name}: {got.get('error')}\n{got.get('traceback')}"
    return got


def table_rows(out: str) -> dict[str, list[str]]:
    """The rows of the markdown tables `zeroshard estimate` and `plan` print: first cell -> the rest."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| configuration"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows
