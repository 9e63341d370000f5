"""Prints the figures behind the parity tests: for world sizes 1-3, how far each configuration lands
from single-process PyTorch, communication per step, and model-state bytes against ZeRO's Table 1.

    python bench/parity_report.py [--worlds 1,2,3]

Runs the same scenarios as tests/test_parity.py (tests/scenarios.py), about a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(here), os.path.join(os.path.dirname(here), "tests")]
from distributed import spawn  # noqa: E402
from scenarios import run_all  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,3")
    args = ap.parse_args()
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            spawn(world, run_all, path)
            r = json.load(open(path))
        errors = {k: v["error"] for k, v in r.items() if v.get("error")}
        print(f"\n== world {world} ==")

        def worst(prefix):
            vals = [v["diff"] for k, v in r.items() if k.startswith(prefix) and "diff" in v]
            return f"{max(vals):.2e} over {len(vals)} runs"
        print(f"fp32 SGD  (GPT-2, stages 0-3, plain/accum2/clip) max |diff|: {worst('gpt2_sgd_')}")
        print(f"fp32 AdamW (GPT-2, stages 0-3, plain/accum2/clip) max |diff|: {worst('gpt2_adamw_')}")
        if r["ddp_adamw_accum2"].get("diff") is not None:
            print(f"torch DDP, AdamW accum2, max |diff|: {r['ddp_adamw_accum2']['diff']:.2e}")
        print(f"quirky model (checkpointing, reuse, frozen, unused, shared) SGD: {worst('quirky_')}")
        for k in ("hf_gradient_checkpointing_stage3", "opt_stage3", "llama_stage3", "eval_no_grad_stage3"):
            print(f"{k}: {r[k].get('diff', r[k].get('error'))}")
        for k, v in r.items():
            if k.startswith("precision_"):
                print(f"{k}: max {v['max']:.2e} mean {v['mean']:.2e}")
        for stage in range(4):
            s = r[f"gpt2_sgd_plain_stage{stage}"]
            print(f"stage {stage}: comm {s['comm_elements'] / s['padded_elements']:.2f} Psi(padded), "
                  f"padding {s['padded_elements'] / s['num_params'] - 1:.2%}")
        for k in ("gpt2_stage3_cache2", "mlp_stage3_minimal_cache"):
            s = r[k]
            print(f"{k}: comm {s['comm_elements'] / s['padded_elements']:.3f} Psi, overflows {s['cache_overflows']}")
        mem = r["memory_bf16_adamw"]
        for stage, want in ((0, 16), (1, 4 + 12 / world), (2, 2 + 14 / world), (3, 16 / world)):
            s = mem[str(stage)]
            print(f"bf16+Adam stage {stage}: {s['model_state_bytes'] / s['num_params']:.3f} bytes/param "
                  f"(Table 1: {want:.3f})")
        print("fp16 overflow:", json.dumps(r["fp16_overflow_skips_everywhere"]), json.dumps(r["fp16_overflow_on_one_rank"]))
        print("expected errors:", json.dumps({k: v[:90] for k, v in errors.items()}, indent=1))


if __name__ == "__main__":
    main()
