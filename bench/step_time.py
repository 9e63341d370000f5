"""Step time of zeroshard stages 0-3 next to torch DDP, torch FSDP2 and DeepSpeed ZeRO 1-3, same model, same run, CPU.

    torchrun --standalone --nproc_per_node 2 bench/step_time.py [--model gpt2-tiny] [--steps 20] [--warmup 3]
        [--block 5] [--json out.json] [--cache-chunks N] [--chunk-size N]
        [--systems ddp,fsdp2,zs0,zs1,zs2,zs3[,zs0-nonorm][,zs3@N][,ds1,ds2,ds3][,ddp+c,zs0+c,...,zs3+c]]
        [--check-order | --no-check-order] [--grad-norm | --no-grad-norm] [--phase-sync]

"zs3@N" is stage 3 with an N-chunk rCache beside the others (whatever --cache-chunks gives them).
"zs0-nonorm" is stage 0 with config grad_norm=False whatever --grad-norm says: DDP's work per step, no
more (the default measures the gradient's global norm for stats(), a pass over the gradient DDP does
not make), for the goal on stage 0's step phase.
Compiled systems (opt-in, inductor): "ddp+c" is torch.compile(DDP(model)), "zs0+c".."zs3+c" zeroshard
with config compile=True (runtime/compiled.py); their compile time (the warmup steps beyond as many
median steps) is printed apart, and their step time also as a ratio of ddp+c's. Every system calls the
model with use_cache=False (training needs no KV cache; a cache's per-layer state would make dynamo
compile each block anew).

Workload (--model) "gpt2-tiny" (default): GPT-2 with 4 layers, n_embd 256, 4 heads, vocab 512, 128
positions, 4 x 128 tokens per rank per step; "gpt2-small-cpu": 6 layers, n_embd 512, 8 heads, vocab
8192, 256 positions, 2 x 256 tokens per rank. No dropout (seed 0); AdamW(lr=1e-3, weight_decay=0);
gloo, 2 ranks, one thread each. ds1-ds3 (DeepSpeed, never a dependency of zeroshard) need a python
that can import deepspeed: see bench/deepspeed_step.py.

Every system is built first, each on a fresh model, and then all of them run --steps steps on the same
data, interleaved: in turns of --block steps, every system's turn once per round, the order rotated each
round, so a shared machine's drifting speed (here it halves for minutes at a time) lands on every system
alike. Within a turn steps run back to back as in a training loop, and a step lasts from its forward's
start to the next forward's start; work a step leaves running (zeroshard stages 1-2 gather the updated
parameters behind the next forward) is paid inside the next step, and at a turn's end the system waits
for it, counted in that turn's last step. The first --warmup steps of each system are not timed. A
step's time is the slowest rank's, and the table shows the median over timed steps. Each step is also
split into phases, perf_counter read at their boundaries (no barrier or synchronisation added):
forward (the model call producing the loss), backward (loss.backward() / engine.backward(loss)) and
step (optimizer step + zero_grad / engine.step(), up to the next forward); a step's phases are those of
the rank whose step was slowest, and the table shows each phase's median over timed steps (JSON:
"phases_s" per row, "phase_times_s" per step). --phase-sync adds torch.cuda.synchronize() at the
boundaries on a CUDA device (off by default: it perturbs the total). The first three global-mean losses
(gpt2-tiny's reference 6.294075, 6.306614, 6.290297) show every system trains the same model; a system
more than 1e-4 off zeroshard stage 0 is flagged MISMATCH. For zeroshard rows it also prints the elements
communicated per step in units of Psi (the padded parameter count) and the model-state bytes each rank
holds.

Peer figures it is compared with (gpt2-tiny, ratio of DDP's step time):
    DDP 0.178 s (1.00)   FSDP2 0.401 s (2.25x)
    DeepSpeed ZeRO-1 1.30x   ZeRO-2 1.13x   ZeRO-3 1.49x
Our goals (ratio to DDP, bench/parts_step_time.py's GOALS, issue 34): gpt2-tiny stages 1-2 <= 1.03, stage 3
<= 1.10; gpt2-small-cpu stages 1-2 <= 1.02, stage 3 <= 1.05 (<= 1.10 with a 2-chunk rCache); each
compiled stage no slower than DDP + compile.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

# `python bench/step_time.py` puts bench/ on the path, not the repo root: find zeroshard from a checkout too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402

ALL_SYSTEMS = ["ddp", "fsdp2", "zs0", "zs1", "zs2", "zs3"]
# Compiled (inductor): DDP under torch.compile, zeroshard with config compile=True (runtime/compiled.py)
COMPILED_SYSTEMS = ["ddp+c", "zs0+c", "zs1+c", "zs2+c", "zs3+c"]
DEEPSPEED_SYSTEMS = ["ds1", "ds2", "ds3"]  # DeepSpeed ZeRO 1-3, where deepspeed is importable (bench/deepspeed_step.py)
NO_NORM = "-nonorm"  # a zeroshard system with config grad_norm=False: "zs0-nonorm"
# name: GPT-2 shape, batch B x T tokens per rank, and the first three global-mean losses of one process
# on the global batch (None: not fixed yet; each run's systems are compared with one another)
WORKLOADS = {
    "gpt2-tiny": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 512, "B": 4, "T": 128,
                  "reference_losses": [6.294075, 6.306614, 6.290297]},
    "gpt2-small-cpu": {"n_layer": 6, "n_embd": 512, "n_head": 8, "vocab": 8192, "B": 2, "T": 256,
                       "reference_losses": None},
}
REFERENCE_LOSSES = WORKLOADS["gpt2-tiny"]["reference_losses"]


def make_model(workload: str = "gpt2-tiny"):
    from transformers import GPT2Config, GPT2LMHeadModel
    w = WORKLOADS[workload]
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=w["n_layer"], n_embd=w["n_embd"], n_head=w["n_head"],
                                      vocab_size=w["vocab"], n_positions=w["T"], resid_pdrop=0, embd_pdrop=0,
                                      attn_pdrop=0, bos_token_id=0, eos_token_id=0))


def make_data(workload: str, steps: int, world: int) -> torch.Tensor:
    """Token ids [steps, world, B, T]: rank r trains on [:, r]."""
    w = WORKLOADS[workload]
    return torch.randint(0, w["vocab"], (steps, world, w["B"], w["T"]), generator=torch.Generator().manual_seed(1234))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0)


class Phases(NamedTuple):
    """One system's training step split at its phase boundaries, each a callable: forward(x) -> loss
    (the model call), backward(loss), step() (the optimizer step and zeroing the gradients); and
    settle(), which waits for work the step left running in the background (zeroshard stages 1-2 gather
    the updated parameters while the next forward runs), or None when a step leaves nothing running."""
    forward: Callable
    backward: Callable
    step: Callable
    settle: Callable | None = None


PHASES = ("forward", "backward", "step")  # the keys of each JSON row's phases_s


def build(name, args):
    """Return (Phases, engine or None) for one system on a fresh model."""
    if name.startswith("ds"):
        from deepspeed_step import build as build_deepspeed  # imports deepspeed: only when asked for
        return build_deepspeed(int(name[2:]), args.model)
    model = make_model(args.model)
    grad_norm = getattr(args, "grad_norm", True) and not name.endswith(NO_NORM)
    name = name.removesuffix(NO_NORM)
    compiled = name.endswith("+c")
    name = name.removesuffix("+c")
    name, _, cache = name.partition("@")  # zs3@2: stage 3 with a 2-chunk rCache, whatever --cache-chunks says
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
        if compiled:
            model = torch.compile(model)
    elif name == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if name in ("ddp", "fsdp2"):
        opt = adamw(model.parameters())

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)
        return Phases(lambda x: model(input_ids=x, labels=x, use_cache=False).loss, lambda loss: loss.backward(),
                      step), None

    engine = zeroshard.initialize(model, optimizer=adamw, config={
        "stage": int(name[2:]), "cache_chunks": int(cache) if cache else args.cache_chunks,
        "check_order": args.check_order, "grad_norm": grad_norm,
        "nonfinite": getattr(args, "nonfinite", "ignore"),
        "chunk_size": getattr(args, "chunk_size", None) or "auto", "compile": compiled})
    return (Phases(lambda x: engine(input_ids=x, labels=x, use_cache=False).loss, engine.backward, engine.step,
                   engine.apply_delayed_update), engine)


def interleaved_steps(systems: dict[str, Phases], data, args) -> dict[str, tuple]:
    """Run args.steps steps of every system, one batch of `data` per step, in turns of args.block steps:
    each round runs every system's next turn, in an order rotated every round, so a shared machine's
    changing speed falls on all systems alike instead of on whichever ran while it was slow.

    Within a turn the steps run back to back, as a training loop runs them, and a step's time is the
    time from its forward's start to the next one's: nothing outside the step (no barrier, no
    reduction of the loss) sits between steps, so work a step leaves running in the background is paid
    for inside the next step, as in training. A turn starts after a barrier and ends with the system's
    settle(), which is counted in its last step (so its last step has nothing to overlap that work with).

    Returns per system: every timed step's time (the slowest rank's; each system's first args.warmup
    steps left out), the first three global-mean losses, and per phase name that same rank's phase
    times in each timed step. Phases are read with perf_counter at their boundaries: forward (model
    call), backward, step (from the backward's end to the next forward's start). With args.phase_sync,
    in a process that has used CUDA, torch.cuda.synchronize() precedes each reading."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sync = getattr(args, "phase_sync", False) and torch.cuda.is_available()
    names = list(systems)
    done = {n: 0 for n in names}  # steps run so far
    samples = {n: [] for n in names}  # per timed step: (total, forward, backward, step)
    warm = {n: [] for n in names}  # the warmup steps' totals (a compiled system compiles in them)
    first_losses = {n: [] for n in names}
    block = max(1, args.block)
    rounds = -(-args.steps // block)

    def now():
        if sync and torch.cuda.is_initialized():  # a process that never used CUDA has nothing to wait for
            torch.cuda.synchronize()
        return time.perf_counter()

    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            phases = systems[name]
            count = min(block, args.steps - done[name])
            dist.barrier()
            t_next = now()
            for j in range(count):
                i = done[name]
                t0 = t_next
                loss = phases.forward(data[i, rank])
                t1 = now()
                phases.backward(loss)
                t2 = now()
                phases.step()
                if j == count - 1 and phases.settle is not None:
                    phases.settle()
                t_next = now()
                if i >= args.warmup:
                    samples[name].append((t_next - t0, t1 - t0, t2 - t1, t_next - t2))
                else:
                    warm[name].append(t_next - t0)
                if i < 3:
                    first_losses[name].append(loss.detach().float().clone())
                done[name] += 1
    out = {}
    for name in names:
        all_samples = [None] * world
        dist.all_gather_object(all_samples, samples[name])
        # A step is as slow as its slowest rank; its phases are that rank's.
        slowest = [max(per_rank, key=lambda s: s[0]) for per_rank in zip(*all_samples)]
        losses = []
        for l in first_losses[name]:
            dist.all_reduce(l)
            losses.append(l.item() / world)
        all_warm = [None] * world
        dist.all_gather_object(all_warm, warm[name])
        out[name] = ([s[0] for s in slowest], losses,
                     {ph: [s[1 + k] for s in slowest] for k, ph in enumerate(PHASES)},
                     [max(per_rank) for per_rank in zip(*all_warm)])
    return out


def timing_row(name: str, step_times: list[float], losses: list[float], phase_times: dict,
               warmup_times: list[float] = ()) -> dict:
    """The JSON fields of a row, from interleaved_steps' results for one system. compile_s: what the
    warmup steps took beyond as many median steps (where a compiled system compiles: the time
    compiling costs, reported apart from the step time)."""
    median = statistics.median(step_times)
    return {"system": name, "median_s": median, "step_times_s": step_times,
            "losses": losses, "phases_s": {k: statistics.median(v) for k, v in phase_times.items()},
            "phase_times_s": phase_times, "warmup_times_s": list(warmup_times),
            "compile_s": max(0.0, sum(warmup_times) - len(warmup_times) * median) if name.endswith("+c") else None}


# The printed tables' phase columns (deepspeed_step.py's too).
PHASE_NOTE = ("fwd/bwd/step s: medians over the timed steps of forward (model call to the loss), backward and "
              "step (optimizer step + zero_grad, up to the next forward),\neach step's phases taken from the rank "
              "whose step was slowest (the three medians need not add up to the median step)")
PHASE_COLUMNS = " ".join(f"{h:>8}" for h in ("fwd s", "bwd s", "step s"))


def phase_cells(row: dict) -> str:
    ph = row.get("phases_s")
    return " ".join(f"{ph[k]:>8.4f}" if ph else f"{'-':>8}" for k in PHASES)


def run(names, args, data) -> list[dict]:
    """Build every system in `names` on a fresh model, time them interleaved, and return their rows."""
    built = {}
    for name in names:
        if dist.get_rank() == 0:
            print(f"building {name} ...", flush=True)
        built[name] = build(name, args)
    if dist.get_rank() == 0:
        print(f"running {', '.join(names)}, interleaved in turns of {args.block} steps ...", flush=True)
    timed = interleaved_steps({name: phases for name, (phases, _) in built.items()}, data, args)
    world = dist.get_world_size()
    rows = []
    for name in names:
        row = timing_row(name, *timed[name])
        engine = built[name][1]
        if engine is not None and name.startswith("zs"):
            s = engine.stats()
            state = [None] * world
            dist.all_gather_object(state, s["model_state_bytes"])
            row.update(comm_elements=s["comm_elements"], padded_elements=s["padded_elements"],
                       num_params=s["num_params"], comm_psi=s["comm_elements"] / s["padded_elements"],
                       model_state_mib_per_rank=[b / 2**20 for b in state],
                       cache_peak_chunks=s.get("cache_peak_chunks"), cache_overflows=s.get("cache_overflows"))
        elif name.startswith("ds") and hasattr(engine, "destroy"):
            engine.destroy()
        rows.append(row)
    del built
    gc.collect()
    return rows


def print_table(rows, machine, args):
    print(f"\nmachine: {machine['cores']} cores, torch {machine['torch']}, transformers {machine['transformers']}, "
          f"{machine['world']} ranks (gloo), {machine['threads']} thread/rank")
    ref = WORKLOADS[args.model]["reference_losses"]
    print(f"{args.model}, {args.steps} steps ({args.warmup} warmup, turns of {args.block}), "
          f"chunk_size={args.chunk_size or 'auto'}, cache_chunks={args.cache_chunks}, "
          f"check_order={args.check_order}, grad_norm={args.grad_norm}, nonfinite={args.nonfinite}; reference losses "
          + (", ".join(f"{v:.6f}" for v in ref) if ref else "not fixed: systems are compared with zs0") + "\n")
    print(PHASE_NOTE + (", torch.cuda.synchronize() at each boundary" if args.phase_sync else "") + "\n")
    print(f"{'system':<10} {'median s':>9} {'vs DDP':>7} {PHASE_COLUMNS}  {'first three global losses':<29} "
          f"{'comm':>8} {'state MiB/rank':>15}")
    for r in rows:
        ratio = f"{r['vs_ddp']:.2f}x" if r.get("vs_ddp") is not None else "-"
        losses = " ".join(f"{v:.6f}" for v in r["losses"])
        comm = f"{r['comm_psi']:.2f} Psi" if "comm_psi" in r else "-"
        state = "/".join(f"{m:.2f}" for m in r["model_state_mib_per_rank"]) if "comm_psi" in r else "-"
        flag = "  MISMATCH" if r.get("mismatch") else ""
        print(f"{r['system']:<10} {r['median_s']:>9.4f} {ratio:>7} {phase_cells(r)}  {losses:<29} {comm:>8} "
              f"{state:>15}{flag}")
    compiled = [r for r in rows if r.get("compile_s") is not None]
    if compiled:
        print("\ncompile time (the warmup steps beyond as many median steps): "
              + ", ".join(f"{r['system']} {r['compile_s']:.1f} s" for r in compiled))
        if any(r["vs_ddp_compiled"] is not None for r in compiled):
            print("compiled vs DDP + compile: " + ", ".join(f"{r['system']} {r['vs_ddp_compiled']:.2f}x" for r in compiled))
    ddp = next((r for r in rows if r["system"] == "ddp" and r.get("phases_s")), None)
    zs0 = [r for r in rows if r["system"] in ("zs0", "zs0" + NO_NORM) and r.get("phases_s")]
    if ddp and zs0:
        print("\nstage 0's step phase vs DDP's: " + ", ".join(
            f"{r['system']} {r['phases_s']['step'] / ddp['phases_s']['step']:.2f}x" for r in zs0)
            + " (goal: zs0-nonorm, DDP's work, <= 1.00x)")
    if args.model == "gpt2-tiny":
        print("\npeers (vs DDP): DDP 0.178 s 1.00, FSDP2 0.401 s 2.25x, DeepSpeed ZeRO-1 1.30x, ZeRO-2 1.13x, "
              "ZeRO-3 1.49x")
    print("goals per workload (vs DDP): bench/parts_step_time.py's GOALS (gpt2-tiny zs1-zs2 <= 1.03x, zs3 <= 1.10x; "
          "gpt2-small-cpu zs1-zs2 <= 1.02x, zs3 <= 1.05x, zs3@2 <= 1.10x; zsN+c <= 1.00x of ddp+c)")


def timing_arguments(ap: argparse.ArgumentParser) -> None:
    """--steps, --warmup, --block, --phase-sync, --json and --model, as interleaved_steps reads them."""
    ap.add_argument("--steps", type=int, default=20, help="steps per system, warmup included")
    ap.add_argument("--block", type=int, default=5, help="steps of one system in a row before the next system's turn")
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out of the timing")
    ap.add_argument("--phase-sync", action="store_true",
                    help="on CUDA, torch.cuda.synchronize() at each phase boundary so each phase holds its own "
                         "kernels (adds to the step time; default off; nothing to do on the CPU)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument("--model", choices=list(WORKLOADS), default="gpt2-tiny", help="the workload (see WORKLOADS)")


def check_timing(ap: argparse.ArgumentParser, args) -> None:
    if args.steps - args.warmup < 1 or args.steps < 3:
        ap.error("need --steps >= 3 and at least one timed step after --warmup")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    timing_arguments(ap)
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help="comma-separated subset of " + ",".join(ALL_SYSTEMS + COMPILED_SYSTEMS + DEEPSPEED_SYSTEMS)
                    + ", zs3@N (an N-chunk rCache), zsN-nonorm (config grad_norm=False)")
    ap.add_argument("--cache-chunks", type=int, default=None, help="stage 3 rCache size (default unlimited)")
    ap.add_argument("--chunk-size", type=int, default=None, help="zeroshard chunk capacity in elements (default auto)")
    ap.add_argument("--check-order", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--grad-norm", action=argparse.BooleanOptionalAction, default=True,
                    help="zeroshard config grad_norm: the gradient's global norm in stats() at every step "
                         "(a pass over the gradient that DDP does not make)")
    ap.add_argument("--nonfinite", choices=["ignore", "skip", "raise"], default="ignore",
                    help="zeroshard config nonfinite: 'skip' and 'raise' check every gradient for NaN and inf "
                         "at each step (a pass DDP does not make)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(s for s in systems if not re.fullmatch(r"zs3@[1-9][0-9]*(\+c)?|zs[0-3]-nonorm", s))
                     - set(ALL_SYSTEMS + COMPILED_SYSTEMS + DEEPSPEED_SYSTEMS))
    if unknown:
        ap.error(f"unknown system(s) {unknown}; choose from {ALL_SYSTEMS + COMPILED_SYSTEMS + DEEPSPEED_SYSTEMS}")
    deepspeed = None
    if any(s in DEEPSPEED_SYSTEMS for s in systems):
        from deepspeed_step import import_deepspeed
        deepspeed = import_deepspeed()
    check_timing(ap, args)

    import transformers
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # 2 cores shared by 2 ranks: more threads would only oversubscribe
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # zeroshard reuses this group
    rank, world = dist.get_rank(), dist.get_world_size()
    data = make_data(args.model, args.steps, world)

    rows = run(systems, args, data)

    by_name = {r["system"]: r for r in rows}
    ddp, zs0 = by_name.get("ddp"), by_name.get("zs0")
    ddp_c = by_name.get("ddp+c")
    for r in rows:
        r["vs_ddp"] = r["median_s"] / ddp["median_s"] if ddp else None
        r["vs_ddp_compiled"] = r["median_s"] / ddp_c["median_s"] if ddp_c and r["system"].endswith("+c") else None
        r["mismatch"] = bool(zs0) and any(abs(a - b) > 1e-4 for a, b in zip(r["losses"], zs0["losses"]))
    machine = {"cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
               "world": world, "threads": torch.get_num_threads(),
               "deepspeed": deepspeed.__version__ if deepspeed else None}
    if rank == 0:
        print_table(rows, machine, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"workload": args.model, "machine": machine, "steps": args.steps, "warmup": args.warmup,
                           "block": args.block,
                           "phase_sync": args.phase_sync, "cache_chunks": args.cache_chunks,
                           "chunk_size": args.chunk_size,
                           "check_order": args.check_order, "grad_norm": args.grad_norm, "nonfinite": args.nonfinite,
                           "reference_losses": WORKLOADS[args.model]["reference_losses"], "systems": rows}, f, indent=2)
            print(f"wrote {args.json}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
