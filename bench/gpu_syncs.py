"""Where one training step makes the host wait for the GPU, per configuration, on one CUDA device.

    python bench/gpu_syncs.py [--json out.json]

A host-device synchronisation on the hot path (forward, backward) stalls the CPU that should be
queueing the next kernels and collectives, so overlap is lost. This script trains a small GPT-2
(bf16, 4 x 512) for two warm-up steps per configuration, then records during one step:
- implicit synchronisations torch reports in sync-debug mode (`.item()`, `.tolist()`, a copy to
  the host that is not non_blocking, ...), with the Python stack;
- explicit ones: torch.cuda.synchronize, Event.synchronize, Stream.synchronize;
- the same step under torch.profiler: CUDA runtime calls that block (cudaStreamSynchronize,
  cudaDeviceSynchronize, cudaEventSynchronize) and the synchronous cudaMemcpy.
Each sync is attributed to the innermost zeroshard frame (else "outside zeroshard") and to the phase
it happened in ("background": in the delayed update's thread, which blocks only itself). Printed: a
table per configuration, phase by phase.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402

CONFIGS = {
    "stage 0": {"stage": 0},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3, "cache_chunks": 2},
    "stage 2 + offload_optimizer": {"stage": 2, "offload_optimizer": True},
    "stage 3 + offload params/optimizer": {"stage": 3, "offload_optimizer": True, "offload_params": True,
                                           "cache_chunks": 2},
    "stage 3 + offload_activations": {"stage": 3, "offload_activations": True, "cache_chunks": 2},
    "stage 2 + offload_optimizer, delayed update": {"stage": 2, "offload_optimizer": True, "delay_update_after": 0},
}
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def where() -> str:
    """The innermost frame in zeroshard's package (or the script's own line)."""
    pkg = os.path.dirname(zeroshard.__file__)
    for fr in reversed(traceback.extract_stack()[:-2]):
        if fr.filename.startswith(pkg):
            return f"{os.path.relpath(fr.filename, os.path.dirname(pkg))}:{fr.lineno} {fr.name}"
    return "outside zeroshard"


class Recorder:
    def __init__(self):
        self.phase = None
        self.hits = collections.Counter()
        self._patched = []

    def hit(self, kind):
        if self.phase is not None:  # the delayed update's thread waits off the main thread's path
            phase = self.phase if threading.current_thread() is threading.main_thread() else "background"
            self.hits[(phase, kind, where())] += 1

    def __enter__(self):
        rec = self
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            orig = getattr(owner, name)

            def wrapped(*a, _orig=orig, _n=f"{getattr(owner, '__name__', 'cuda')}.{name}", **k):
                rec.hit(_n)
                return _orig(*a, **k)
            setattr(owner, name, wrapped)
            self._patched.append((owner, name, orig))
        self._show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                rec.hit("implicit (" + str(message).split(".")[0][:60] + ")")
            else:
                self._show(message, category, filename, lineno, file, line)
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        for owner, name, orig in self._patched:
            setattr(owner, name, orig)


def model():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256, resid_pdrop=0,
                     embd_pdrop=0, attn_pdrop=0)
    return GPT2LMHeadModel(cfg)


def one(name, cfg):
    opt = (lambda ps: zeroshard.CPUAdamW(ps, lr=1e-4)) if cfg.get("offload_optimizer") else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True))
    engine = zeroshard.initialize(model(), opt, {"precision": "bf16", "chunk_size": 2**21, **cfg})
    x = torch.randint(0, 8192, (4, 256))
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    torch.cuda.synchronize()
    rec = Recorder()
    with rec:
        rec.phase = "forward"
        loss = engine(input_ids=x, labels=x).loss
        rec.phase = "backward"
        engine.backward(loss)
        rec.phase = "step"
        engine.step()
        rec.phase = None
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        torch.cuda.synchronize()
    runtime = collections.Counter(e.name for e in prof.events() if e.name in BLOCKING)
    runtime["cudaDeviceSynchronize"] -= 1  # the script's own, that ends the profiled step
    del engine
    return rec.hits, {k: v for k, v in runtime.items() if v > 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--only", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    out = {}
    for name in args.only:
        hits, runtime = one(name, CONFIGS[name])
        by_phase = collections.Counter()
        for (phase, _, _), n in hits.items():
            by_phase[phase] += n
        print(f"\n== {name}: host syncs in one step: forward {by_phase['forward']}, backward "
              f"{by_phase['backward']}, step {by_phase['step']}"
              + (f" (background thread {by_phase['background']})" if by_phase["background"] else "")
              + f"; profiler blocking runtime calls {runtime}")
        for (phase, kind, loc), n in sorted(hits.items()):
            print(f"   {phase:8s} {n:4d} x {kind:40s} at {loc}")
        out[name] = {"by_phase": dict(by_phase), "runtime_calls": runtime,
                     "sites": [{"phase": p, "kind": k, "where": w, "count": n} for (p, k, w), n in hits.items()]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
