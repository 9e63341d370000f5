"""run_all.py's parts on training past the device's memory: the CPU AdamW step, the profiler and
planner on OPT-175B, single-GPU throughput with offload on GPT-2 sizes up to the first that does not
fit, and the disk tier.
"""
from __future__ import annotations

import os
import sys

import torch

from launch import BENCH, CommandFailed, gpu_name, load_json, run_command, say

# shared/notes/anchors.md, 64M fp32 elements on a machine of this kind: G elements/s.
ADAM_ANCHORS = {"torch AdamW (for-loop)": 0.21, "torch AdamW (foreach)": 0.41, "torch AdamW (fused)": 3.4,
                "DeepSpeedCPUAdam": 1.9}


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
