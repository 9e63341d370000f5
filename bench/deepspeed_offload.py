"""DeepSpeed ZeRO / ZeRO-Offload on the model and data of bench/auto_gpt2.py, in one run, on one device.

    python bench/deepspeed_offload.py --json ds.json          # on a GPU: the same GPT-2 as auto_gpt2.py
    python bench/deepspeed_offload.py --n-layer 2 --n-embd 128 --batch 2 --seq 64   # CPU smoke (DS_ACCELERATOR=cpu)

DeepSpeed is a peer we measure against, never a dependency of zeroshard: run this with a Python that has
deepspeed (0.19.8) and its dependencies (hjson, pydantic), e.g. the wheels in .whl installed with
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl` and PYTHONPATH=/tmp/site.

Model and data exactly as bench/auto_gpt2.py (build(), timed_steps() and gpt2_params() are imported from
bench/offload_gpt2.py): GPT-2 built on the meta device, bf16, N(0, 0.02) weights, no dropout, activation
checkpointing (transformers' gradient_checkpointing_enable), random tokens (seed 1), materialised where
auto_gpt2.py does (offload_gpt2.build_device: on the GPU when its bf16 weights take under a third of it);
by default on CUDA n_embd 4096 and the fewest layers whose 16 bytes/parameter exceed the device. Each configuration gets
a fresh model and a fresh engine (deepspeed.initialize, timed as "set-up") and trains `--warmup` +
`--steps` steps; a step is forward + engine.backward + engine.step, timed with perf_counter between
device synchronisations, the inputs' copy to the device included (zeroshard's engine does that copy
inside its forward).

DeepSpeed configuration: bf16 enabled (fp32 master weights and Adam states, DeepSpeed's default),
micro-batch `--batch`, no gradient accumulation, no clipping, zero_optimization with
contiguous_gradients and overlap_comm on (DeepSpeed's recommended ZeRO-Offload settings; override or
add keys with --zero-extra JSON), other knobs DeepSpeed's defaults:
  "DS ZeRO-2"          stage 2
  "DS ZeRO-3"          stage 3
  "DS ZeRO-2 offload"  stage 2, offload_optimizer {device: cpu, pin_memory: true}
  "DS ZeRO-3 offload"  stage 3, offload_optimizer and offload_param {device: cpu, pin_memory: true}
Optimizer: the config's {"type": "AdamW", lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01} (the
defaults of torch AdamW and zeroshard.CPUAdamW), so DeepSpeed picks DeepSpeedCPUAdam where the optimizer
is offloaded and its FusedAdam where it is not. Both are JIT-built (ninja) before the first
configuration, timed apart from set-up; if FusedAdam does not build (or with --adam torch), the
non-offload configurations use a client torch.optim.AdamW(fused=True on CUDA) instead, as auto_gpt2.py
does, and the row says so. On CUDA the script sets, unless already set, TORCH_CUDA_ARCH_LIST to the
device's compute capability (one architecture: a faster FusedAdam build) and DS_SKIP_CUDA_CHECK=1 (so a
minor nvcc/torch CUDA version difference does not stop the build); without CUDA, DS_ACCELERATOR=cpu.
No launcher: RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR/PORT are set here, then
deepspeed.init_distributed (nccl on CUDA, the CPU accelerator's backend otherwise).

Printed: per configuration, median step time, model TFLOPS ((6 params + 12 layers n_embd seq) x tokens /
step time, as auto_gpt2.py), peak device memory (torch.cuda.max_memory_allocated, reset after the
warm-up), set-up seconds; then the best of the four. A configuration that fails (out of memory or
otherwise) is reported with its exception type and message, and the next still runs (a host out-of-memory
kill ends the process: --json is rewritten after every configuration so what ran is kept). --json writes
auto_gpt2.py's record shape ({"device", "params", "rows": {name: {...}}}) plus a few extra keys.
--build-only JIT-builds the ops and exits (a first, short call on a fresh machine).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

CUDA = torch.cuda.is_available()
# Single process, no launcher: the environment torch.distributed's env:// rendezvous reads.
for _k, _v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
    os.environ.setdefault(_k, _v)
if CUDA:
    _cc = torch.cuda.get_device_capability(0)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{_cc[0]}.{_cc[1]}")  # build FusedAdam for this GPU only
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")  # nvcc 13.x vs torch's 13.0: DeepSpeed knows no 13.x list
else:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede the deepspeed import

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload_gpt2 import (build, build_device, comparison_arguments, comparison_model,  # noqa: E402
                          gpt2_params, timed_steps)

CONFIGS = {
    "DS ZeRO-2": {"stage": 2},
    "DS ZeRO-3": {"stage": 3},
    "DS ZeRO-2 offload": {"stage": 2, "offload_optimizer": True},
    "DS ZeRO-3 offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
}
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def ds_config(extra, args, client_optimizer):
    zero = {"stage": extra["stage"], "contiguous_gradients": True, "overlap_comm": True}
    if extra.get("offload_optimizer"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if extra.get("offload_params"):
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    zero.update(json.loads(args.zero_extra))
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "train_batch_size": args.batch, "bf16": {"enabled": True}, "zero_optimization": zero,
           "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if client_optimizer:
        cfg["zero_allow_untested_optimizer"] = True
    else:
        cfg["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    return cfg


def run(name, extra, args, n_layer, d, seq, torch_adam):
    import deepspeed
    sync = torch.cuda.synchronize if CUDA else (lambda: None)
    base = torch.cuda.memory_allocated() if CUDA else 0
    where = build_device(gpt2_params(n_layer, d, seq), CUDA)
    model = build(n_layer, d, seq, where) if where != "cpu" else build(n_layer, d, seq)
    client = torch_adam and not extra.get("offload_optimizer")
    cfg = ds_config(extra, args, client)
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"], fused=CUDA) if client else None
    t0 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                           model_parameters=None if client else model.parameters())
    sync()
    setup = time.perf_counter() - t0
    inner = getattr(engine, "basic_optimizer", None) or getattr(engine.optimizer, "optimizer", engine.optimizer)
    optimizer = type(inner).__name__ + (" (client)" if client else "")
    print(f"  set-up {setup:.1f} s; optimizer {optimizer}; zero_optimization {cfg['zero_optimization']}", flush=True)
    dev = engine.device
    try:
        times, losses = timed_steps(engine, args, seq, CUDA, device=dev, verbose=True)
        out = {"step_s": statistics.median(times), "setup_s": setup, "plan": None,
               "peak_device_bytes": torch.cuda.max_memory_allocated() if CUDA else None,
               # what the engine keeps on the device between steps (model states, buffers), not activations
               "device_model_bytes": torch.cuda.memory_allocated() - base if CUDA else None,
               "host_rss_bytes": host_rss(),
               "optimizer": optimizer, "zero_optimization": cfg["zero_optimization"],
               "step_times_s": times, "losses": losses}
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model, opt, inner
    return out


def host_rss():
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        return None


def build_ops(names):
    """JIT-build (or load from the torch extensions cache) DeepSpeed ops; {name: seconds or error string}."""
    from deepspeed.accelerator import get_accelerator
    res = {}
    for name in names:
        t = time.perf_counter()
        print(f"building {name} ...", flush=True)
        try:
            get_accelerator().create_op_builder(name).load(verbose=False)
            res[name] = time.perf_counter() - t
            print(f"  {name}: {res[name]:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed build is reported, the run goes on
            res[name] = f"{type(e).__name__}: {str(e).strip()[-600:]}"
            print(f"  {name} FAILED after {time.perf_counter() - t:.0f} s: {res[name]}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    comparison_arguments(ap)
    ap.add_argument("--only", nargs="*", default=list(CONFIGS), choices=list(CONFIGS), metavar="CONFIG",
                    help=f"a subset of {list(CONFIGS)}")
    ap.add_argument("--adam", choices=["ds", "torch"], default="ds",
                    help="non-offload configurations: DeepSpeed's FusedAdam from the config (default; falls back "
                         "to torch if it does not build) or a client torch.optim.AdamW")
    ap.add_argument("--zero-extra", default="{}", help="JSON merged into every zero_optimization section")
    ap.add_argument("--build-only", action="store_true",
                    help="JIT-build the DeepSpeed ops the selected configurations need (into the torch extensions "
                         "cache, $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) and exit")
    ap.add_argument("--json", help="written after every configuration, so a run cut short keeps what it measured")
    args = ap.parse_args()

    import deepspeed
    import transformers
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as ds_logger
    ds_logger.setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
    backend = get_accelerator().communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=datetime.timedelta(minutes=30))

    n_layer, d, seq, psi, dev_mem = comparison_model(args, CUDA)
    device = torch.cuda.get_device_name(0) if CUDA else "cpu"
    print(f"deepspeed {deepspeed.__version__} ({get_accelerator().device_name()}, {backend}), torch {torch.__version__}"
          f", transformers {transformers.__version__}" + (f", CUDA {torch.version.cuda}, TORCH_CUDA_ARCH_LIST "
                                                          f"{os.environ.get('TORCH_CUDA_ARCH_LIST')}" if CUDA else ""))
    print(f"{device}: GPT-2 {n_layer} x {d}, {psi / 1e9:.2f} B parameters, batch {args.batch} x {seq}; "
          f"16 bytes/param = {16 * psi / 2**30:.1f} GiB" + (f", device {dev_mem / 2**30:.1f} GiB" if CUDA else ""))
    flops_per_step = (6 * psi + 12 * n_layer * d * seq) * args.batch * seq

    offloaded = [n for n in args.only if CONFIGS[n].get("offload_optimizer")]
    ops = build_ops((["FusedAdamBuilder"] if args.adam == "ds" and len(offloaded) < len(args.only) else [])
                    + (["CPUAdamBuilder"] if offloaded else []))
    torch_adam = args.adam == "torch" or isinstance(ops.get("FusedAdamBuilder"), str)
    if torch_adam and args.adam == "ds":
        print("FusedAdam did not build: the non-offload configurations use torch.optim.AdamW", flush=True)
    if args.build_only:
        print(f"built: {ops}")
        sys.exit(0 if not any(isinstance(v, str) for v in ops.values()) else 1)

    def write_json():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device, "params": psi, "rows": rows,
                           "system": f"deepspeed {deepspeed.__version__}",
                           "torch": torch.__version__, "n_layer": n_layer, "n_embd": d, "seq": seq,
                           "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "op_build_s": ops}, f,
                          indent=1)

    rows = {}
    for name in args.only:
        print(f"{name} ...", flush=True)
        try:
            r = run(name, CONFIGS[name], args, n_layer, d, seq, torch_adam)
            r["tflops"] = flops_per_step / r["step_s"] / 1e12
        except Exception as e:  # noqa: BLE001 - out of memory or otherwise: report, go on
            msg = str(e).strip()
            r = {"error": f"{type(e).__name__}: {' '.join(msg.split())[:400]}"}
            print(f"  FAILED: {r['error']}\n{traceback.format_exc(limit=-6)}", flush=True)
            del e
        rows[name] = r
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        write_json()
    print("\n| config | step s | model TFLOPS | peak device GiB | set-up s | optimizer |\n|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | - | - | {r['error'][:120]} | - | - |")
        else:
            peak = f"{r['peak_device_bytes'] / 2**30:.1f}" if r["peak_device_bytes"] else "-"
            print(f"| {name} | {r['step_s']:.3f} | {r['tflops']:.2f} | {peak} | {r['setup_s']:.1f} | "
                  f"{r['optimizer']} |")
    ok = {n: r for n, r in rows.items() if "tflops" in r}
    if ok:
        best = max(ok, key=lambda n: ok[n]["tflops"])
        print(f"\nbest of DeepSpeed: {best}, {ok[best]['tflops']:.2f} TFLOPS ({ok[best]['step_s']:.3f} s/step)")
    else:
        print("\nno DeepSpeed configuration ran")
    write_json()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
