"""`zeroshard estimate` and `zeroshard plan` (see commands.py): the paper's memory and
communication figures, and the planner's choice for a MODEL on a target."""
from __future__ import annotations

import dataclasses
import json
import warnings

from ..errors import UnsupportedModelError
from .args import UsageError, parameter_count
from .model import describe_hardware, example_inputs, load_model, target_hardware


def cmd_estimate(args) -> int:
    from ..planning.estimate import PARAMS_ON_DISK, estimate, largest_model, load_host_bytes, table1, table2
    if args.paper:
        head = ("DP",) + tuple(f"{m} {s}" for m in ("7.5B", "128B", "1T") for s in ("P_os", "P_os+g", "P_os+g+p"))
        print("ZeRO Table 1: per-device model-state memory (GB), mixed-precision Adam (K = 12)")
        print(markdown(head, table1()))
        print()
        print("ZeRO Table 2 (theoretical): largest model on 32 GB GPUs, 64-way data parallel x MP")
        print(markdown(("MP", "GPUs", "baseline", "P_os", "P_os+g", "P_os+g+p"), table2()))
        if args.model is None:
            return 0
        print()
    if args.model is None:
        raise UsageError("give MODEL (a parameter count such as 7.5B, or a model), or --paper")
    if args.ranks_per_node < 1:
        raise UsageError("--ranks-per-node must be at least 1")
    psi = parameter_count(args.model)
    source = f"{psi:,.0f} parameters" if psi is not None else ""
    largest = shape = None
    if psi is None:
        loaded = load_model(args.model, checkpointing=False)
        psi = float(sum(p.numel() for p in loaded.model.parameters()))
        largest = float(max(t.numel() for t in list(loaded.model.parameters()) + list(loaded.model.buffers())))
        source = f"{loaded.source}: {psi:,.0f} parameters"
        shape = _transformer_shape(getattr(loaded.model, "config", None))
    kw = dict(precision=args.precision, optimizer=args.optimizer, mp=args.tp)
    tp = f", tensor parallel {args.tp} (each GPU holds 1/{args.tp} of every parameter)" if args.tp > 1 else ""
    print(f"{source}; {args.precision}, {args.optimizer}{tp}; model states per GPU in GB (1e9 bytes), "
          "device / host (+ disk: the disk tier, offload_optimizer='disk')")
    configs = [(s, "none") for s in range(4)] + [(s, "optimizer") for s in (1, 2, 3)] + [(3, "optimizer+params")] \
        + [(s, "disk") for s in (1, 2, 3)] + [(3, "disk+params"), (3, PARAMS_ON_DISK)]
    names = {"none": "", "optimizer": " + offload", "optimizer+params": " + offload + params",
             "disk": " + disk tier", "disk+params": " + disk tier + params",
             PARAMS_ON_DISK: " + disk tier + params on disk"}
    head = ("stage",) + tuple(f"{n} GPUs" if n > 1 else "1 GPU" for n in args.gpus)
    rows = []
    for stage, off in configs:
        cells = []
        for n in args.gpus:
            e = estimate(psi, stage, n, offload=off, **kw)
            fits = "" if args.gpu_memory is None else (" ok" if e.device <= args.gpu_memory else " no")
            cells.append(f"{e.device / 1e9:.2f} / {e.host / 1e9:.2f}" + (f" + {e.disk / 1e9:.2f}" if e.disk else "")
                         + fits)
        rows.append((f"{stage}{names[off]}",) + tuple(cells))
    print(markdown(head, rows))
    if args.gpu_memory is not None:
        print()
        print(f"largest model whose model states fit {args.gpu_memory / 1e9:g} GB per GPU (activations, buffers "
              "and the driver's reserve need room too):")
        rows = [(f"{stage}{names[off]}",) + tuple(_params_words(largest_model(args.gpu_memory, stage, n, offload=off,
                                                                              **kw)) for n in args.gpus)
                for stage, off in configs]
        print(markdown(head, rows))
    if args.seq_len is not None:
        layers, hidden = args.layers or (shape or (None, None))[0], args.hidden or (shape or (None, None))[1]
        if layers is None or hidden is None:
            raise UsageError("--seq-len: give --layers and --hidden (a parameter count has no config to read them from)")
        _print_activation_checkpoints(psi, args, layers, hidden)
    print()
    per_node = args.ranks_per_node
    normal = load_host_bytes(psi, largest, per_node, meta=False)
    meta = load_host_bytes(psi, largest, per_node, meta=True)
    print(f"host memory per node while the model is built and loaded ({per_node} ranks per node), beyond the "
          "host column above:")
    print(markdown(("construction", "GB per node", "per rank"), [
        ("built normally: each rank builds the whole model (fp32)", f"{normal / 1e9:.2f}", "4 bytes x parameters"),
        ("on the meta device: initialize(meta model, weights=...)",
         "give a model to size its largest tensor" if meta is None else f"{meta / 1e9:.2f}",
         "4 bytes x the largest tensor")]))
    return 0


def _transformer_shape(config) -> tuple[int, int] | None:
    """(blocks, hidden size) from a transformers config, where it names them."""
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer") if hasattr(config, k)), None)
    hidden = next((getattr(config, k) for k in ("hidden_size", "n_embd", "d_model") if hasattr(config, k)), None)
    return (layers, hidden) if layers and hidden else None


def _print_activation_checkpoints(psi: float, args, layers: int, hidden: int) -> None:
    """ZeRO-R's P_a: checkpoint memory per GPU and communication per step (estimate.py)."""
    from ..planning.estimate import activation_checkpoint_bytes, communication_per_step
    b, seq, mp = args.micro_batch, args.seq_len, args.tp
    print()
    print(f"activation checkpoints ({layers} blocks x {b} x {seq} tokens x {hidden}, {args.precision}, one per "
          f"block), GB per GPU, device / host, tensor parallel {mp}:")
    rows = []
    for name, part, host in (("replicated (no P_a)", False, False), ("P_a: partitioned over the MP ranks", True, False),
                             ("P_a+cpu: partitioned, on the host", True, True)):
        d, h = activation_checkpoint_bytes(layers, b, seq, hidden, args.precision, mp=mp, partitioned=part, on_host=host)
        rows.append((name, f"{d / 1e9:.3f} / {h / 1e9:.3f}"))
    print(markdown(("checkpoints", "GB"), rows))
    print()
    print("communication per GPU per step of one micro-batch, in elements (the paper's accounting; the data-parallel "
          "column with more than one data-parallel GPU):")
    rows = []
    for stage in (0, 1, 2, 3):
        c = communication_per_step(psi, stage, mp, layers, b, seq, hidden, partitioned=True)
        share = f"{100 * c['p_a'] / c['mp']:.1f}%" if c["mp"] else "-"
        rows.append((str(stage), f"{c['dp']:.3g}", f"{c['mp']:.3g}", f"{c['p_a']:.3g}", share))
    print(markdown(("stage", "ZeRO data parallel", "MP all-reduces", "P_a all-gathers", "P_a / MP"), rows))


def _params_words(n: float) -> str:
    if n == float("inf"):
        return "any (host-bound)"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:,.0f}"


# -- plan ----------------------------------------------------------------------------------------------------
def _plan_facts(p) -> dict:
    from ..planning.hardware import GIB
    t = p.time
    return {
        "name": p.name, "fits": p.fits, "stage": p.stage, "config": p.config(), "chunk_size": p.chunk_size,
        "chunks": len(p.optimizer_on_host), "cache_chunks": p.cache_chunks,
        "offloaded_chunks": sum(p.optimizer_on_host), "optimizer_on_host": list(p.optimizer_on_host),
        "padding_waste": p.waste, "device_bytes": p.device_bytes, "device_gib": p.device_bytes / GIB,
        "device_memory": p.device_memory, "device_model_bytes": p.device_model_bytes,
        "host_model_bytes": p.host_model_bytes, "host_memory": p.host_memory, "disk_chunks": p.disk_chunks,
        "optimizer_on_disk": list(p.optimizer_on_disk), "disk_model_bytes": p.disk_model_bytes,
        "transient_bytes": p.transient_bytes,
        "activation_bytes": p.activation_bytes, "other_bytes": p.other_bytes, "loads_per_step": p.loads,
        "time_ms": {"total": t.total * 1e3, "compute": t.compute * 1e3, "exposed_transfers": t.exposed_transfers * 1e3,
                    "device_step": t.device_step * 1e3, "cpu_step": t.cpu_step * 1e3, "disk_io": t.disk_io * 1e3},
        "tflops": p.tflops, "notes": list(p.notes), "describe": p.describe(),
    }


def _table(plans) -> str:
    from ..planning.hardware import GIB
    head = ("configuration", "device GiB", "fits", "step ms", "compute ms", "exposed transfers ms", "device step ms",
            "CPU step ms", "TFLOPS/GPU", "host GiB", "disk GiB", "disk I/O ms")
    rows = []
    for p in plans:
        t = p.time
        rows.append((p.name, f"{p.device_bytes / GIB:.2f}", "yes" if p.fits else "no", f"{t.total * 1e3:.1f}",
                     f"{t.compute * 1e3:.1f}", f"{t.exposed_transfers * 1e3:.1f}", f"{t.device_step * 1e3:.1f}",
                     f"{t.cpu_step * 1e3:.1f}", f"{p.tflops:.1f}", f"{p.host_model_bytes / GIB:.2f}",
                     f"{p.disk_model_bytes / GIB:.2f}", f"{t.disk_io * 1e3:.1f}"))
    return markdown(head, rows)


def markdown(head, rows) -> str:
    """A markdown table, first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in list(rows) + [head]) for i in range(len(head))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 1) + ":" if i else ":" + "-" * (w + 1) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def cmd_plan(args) -> int:
    import torch
    from ..planning.planner import Planner, Target
    from ..planning.profiler import profile

    loaded = load_model(args.model, args.checkpointing)
    inputs, input_words = example_inputs(loaded, args)
    hw, world, hw_words = target_hardware(args)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A GPU target (described, or this machine's) profiles attention as a GPU runs it.
            gpu = args.gpu_memory is not None or torch.cuda.is_available()
            prof = profile(loaded.model, inputs, dtype=args.precision, device="cuda" if gpu else "cpu")
    except UnsupportedModelError as e:  # the model itself, whatever the inputs
        raise UsageError(f"{args.model}: {str(e).removeprefix('zeroshard ')}") from None
    except Exception as e:  # noqa: BLE001: most often inputs that do not suit the model
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"profiling {args.model} on the meta device failed ({input_words}): "
                         f"{type(e).__name__}: {first}") from None
    planner = Planner(prof, Target(hw, world=world, accumulation=args.accumulation, disk=hw.disk_read > 0))
    plan = planner.plan(stage="auto" if args.stage == "auto" else int(args.stage), offload=not args.no_offload)
    baselines = planner.baselines()
    why = None
    if not plan.fits:
        why = planner.why_nothing_fits(plan)

    if args.json:
        facts = {
            "model": args.model, "source": loaded.source, "inputs": input_words, "precision": args.precision,
            "checkpointing": args.checkpointing, "accumulation": args.accumulation, "world": world,
            "hardware": dataclasses.asdict(hw), "hardware_source": hw_words,
            "profile": {"summary": prof.summary(), "parameters": len(prof.params), "numel": prof.numel,
                        "flops": prof.flops, "saved_bytes": prof.saved_bytes,
                        "peak_activation_bytes": prof.peak_activation_bytes, "peak_phase": prof.peak_phase,
                        "checkpoint_regions": len(prof.checkpoint_regions), "seconds": prof.seconds},
            "plan": _plan_facts(plan), "baselines": [_plan_facts(b) for b in baselines],
            "search_seconds": planner.search_seconds, "chunk_candidates": len(planner.candidates),
            "padding_waste": planner.layout.waste, "fits": plan.fits, "why_nothing_fits": why,
        }
        print(json.dumps(facts, indent=1))
        return 0 if plan.fits else 2

    ckpt = ", activation checkpointing" if args.checkpointing else ""
    print(f"model: {loaded.source}; {input_words}, {args.precision}{ckpt}, "
          f"accumulation {args.accumulation}")
    print(f"profile: {prof.summary()}")
    print(f"target: {describe_hardware(hw, world)}")
    print(f"  figures: {hw_words}")
    print()
    print(f"{'chosen' if plan.fits else 'closest (does not fit)'}: {plan.describe()}")
    print(f"  config: {json.dumps(plan.config())}")
    for note in plan.notes:
        print(f"  note: {note}")
    print(f"chunk search: {len(planner.candidates)} candidate sizes in {planner.search_seconds:.2f} s; "
          f"padding waste {planner.layout.waste:.2%}")
    print()
    print(_table(baselines + [plan]))
    if why:
        print()
        print(why)
        return 2
    return 0

