"""The `zeroshard` command line.

    zeroshard plan MODEL [--micro-batch 1] [--seq-len 1024] [--gpus N] [--gpu-memory 40GB]
                         [--h2d 20GB/s] [--d2h 20GB/s] [--cpu-adam 2e9] [--gpu-adam 50e9]
                         [--tflops 150] [--link 100GB/s] [--precision bf16] [--checkpointing]
                         [--accumulation 1] [--json]
    zeroshard export CKPT OUT [--dtype bf16] [--no-verify]

`export` writes a checkpoint's model as one safetensors file (see zeroshard/state/export.py).

`plan` profiles one training step of MODEL on the meta device (no memory, no weights, seconds even
for a 175B model), then asks the planner for the fastest configuration that fits the target and
compares it with the four classic ZeRO configurations on the same chunks.

MODEL is one of:
  - a path to a transformers config.json, or to a directory holding one;
  - `package.module:factory`: an import path to a callable returning an nn.Module (called on the
    meta device; give its input with --input-shape and, optionally, --input-dtype);
  - a built-in preset (see `zeroshard plan --help`);
  - a transformers model id whose config is already in the local Hugging Face cache.

The target: with --gpu-memory, a described GPU (the other figures default to a PCIe-attached
data-centre GPU); without it, this machine is measured (`zeroshard.planning.hardware.probe`, cached) and any
figures given override the measurement. On a machine without CUDA the measured "device" is the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys

from .args import (UsageError, bandwidth, int_list, non_negative_size, positive_float, positive_int,  # noqa: F401
                       rate, shape, size)  # (size, bandwidth, rate: public here too)
from .model import PRESETS
from .plan import cmd_estimate, cmd_plan
from .plan_nodes import cmd_plan_nodes


# -- the parser -------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zeroshard", description="zeroshard: ZeRO data parallelism for any "
                                     "torch.nn.Module. Commands: `zeroshard plan MODEL ...` (see `zeroshard plan -h`), "
                                     "`zeroshard export CKPT OUT` (see `zeroshard export -h`).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "plan", help="profile a model on the meta device and plan ZeRO stage, chunks, cache and offload",
        description="Profile one training step of MODEL on the meta device, plan the fastest configuration "
        "that fits the target, and compare it with ZeRO-2, ZeRO-3, ZeRO-2 offload and ZeRO-3 offload. "
        "Exit status: 0 when the plan fits, 2 when nothing fits or the input is bad.",
        epilog=f"presets: {', '.join(PRESETS)}. Sizes: 40GB = 40e9 bytes, 40GiB = 40 * 2**30 bytes; "
        "bandwidths: 20GB/s.")
    p.add_argument("model", metavar="MODEL", help="config.json (or its directory), package.module:factory, a preset "
                   "name, or a transformers model id already in the local cache")
    g = p.add_argument_group("workload")
    g.add_argument("--micro-batch", type=positive_int, default=None, help="sequences per micro-batch per GPU "
                   "(default 1)")
    g.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default 1024, or the "
                   "model's positions if fewer)")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute dtype "
                   "(default bf16)")
    g.add_argument("--checkpointing", action="store_true", help="enable activation checkpointing on the model")
    g.add_argument("--accumulation", type=positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--input-shape", type=shape, default=None, help="factory models: shape of the one positional "
                   "input, e.g. 4,128")
    g.add_argument("--input-dtype", choices=("long", "int", "float", "bf16", "fp16", "fp32"), default=None,
                   help="factory models: dtype of the input (default long if the model has an nn.Embedding, "
                   "else float)")
    h = p.add_argument_group("target (default: this machine, measured)")
    h.add_argument("--gpus", type=positive_int, default=None, help="data-parallel GPUs (default 1, or the CUDA "
                   "device count when measuring this machine)")
    h.add_argument("--gpu-memory", type=size, default=None, help="memory per GPU, e.g. 40GB or 80GiB: plan for "
                   "a described GPU instead of measuring this machine")
    h.add_argument("--h2d", type=bandwidth, default=None, help="host-to-device bandwidth (default 20GB/s)")
    h.add_argument("--d2h", type=bandwidth, default=None, help="device-to-host bandwidth (default 20GB/s)")
    h.add_argument("--cpu-adam", type=rate, default=None, help="Adam elements/s of one host's CPU (default 2e9)")
    h.add_argument("--gpu-adam", type=rate, default=None, help="Adam elements/s of one GPU (default 50e9)")
    h.add_argument("--tflops", type=positive_float, default=None, help="matmul TFLOP/s of one GPU in the compute "
                   "dtype (default 150)")
    h.add_argument("--link", type=bandwidth, default=None, help="collective bus bandwidth per GPU (default: "
                   "the h2d figure)")
    h.add_argument("--gpus-per-host", type=positive_int, default=None, help="GPUs sharing one host's CPU Adam "
                   "(default 1)")
    h.add_argument("--host-memory", type=size, default=None, help="memory of one host (default 512GiB)")
    h.add_argument("--reserve", type=non_negative_size, default=None, help="memory per GPU the driver and "
                   "runtime keep (default 2GiB for a described GPU)")
    h.add_argument("--offload-dir", default=None, help="a disk tier in this directory (offload_dir): its disk is "
                   "measured, and chunks whose optimizer states do not fit --host-memory go there")
    h.add_argument("--disk-read", type=bandwidth, default=None, help="a disk tier's read bandwidth per host, "
                   "described instead of measured (with --disk-write)")
    h.add_argument("--disk-write", type=bandwidth, default=None, help="a disk tier's write bandwidth per host")
    s = p.add_argument_group("search")
    s.add_argument("--stage", choices=("auto", "2", "3"), default="auto", help="restrict the plan to one stage")
    s.add_argument("--no-offload", action="store_true", help="keep every optimizer state on the GPU")
    n = p.add_argument_group("across nodes (MODEL may be a parameter count, e.g. 70B; prints full sharding, HSDP "
                             "and hpZ at each node count instead of profiling; link model: planning/links.py)")
    n.add_argument("--nodes", type=int_list, default=None, help="node counts, e.g. 1,8,64,1024")
    n.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    n.add_argument("--intra-node-bandwidth", type=bandwidth, default=None, help="collective bandwidth per GPU "
                   "inside a node (default 300GB/s)")
    n.add_argument("--inter-node-bandwidth", type=bandwidth, default=None, help="collective bandwidth per GPU "
                   "across nodes (default 25GB/s)")
    n.add_argument("--global-batch-tokens", type=positive_int, default=4 * 2**20, help="tokens per optimizer "
                   "step, kept as nodes are added (default 4194304)")
    n.add_argument("--layers", type=positive_int, default=None, help="transformer blocks, for the activations")
    n.add_argument("--hidden", type=positive_int, default=None, help="hidden size, for the activations")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=lambda args: cmd_plan_nodes(args) if args.nodes is not None else cmd_plan(args), subparser=p)

    e = sub.add_parser(
        "export", help="write a checkpoint's model as one safetensors file (a from_pretrained folder for "
        "transformers models)",
        description="Write the model of checkpoint CKPT to OUT as one safetensors file with the model's own "
        "state_dict keys, streaming from the shards (the model is never whole in memory). For a transformers "
        "model OUT is a folder with model.safetensors and config.json, which from_pretrained opens. OUT ending "
        "in .safetensors is the file itself. "
        "Exit status: 0 on success, 2 when the checkpoint is missing or damaged or the input is bad.")
    e.add_argument("ckpt", metavar="CKPT", help="a checkpoint root (its 'latest' is exported) or a checkpoint "
                   "directory")
    e.add_argument("out", metavar="OUT", help="output folder, or a .safetensors file")
    e.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="convert floating tensors "
                   "(default: as saved, the fp32 master weights)")
    e.add_argument("--no-verify", action="store_true", help="skip checking every file's checksum first")
    e.set_defaults(func=cmd_export, subparser=e)

    m = sub.add_parser(
        "estimate", help="model-state memory per GPU for ZeRO stages 0-3, with and without offload",
        description="Model-state bytes per GPU (parameters, gradients, optimizer states; not activations or "
        "buffers) for ZeRO stages 0-3, without and with offload, and the largest model whose model states fit "
        "--gpu-memory. --paper prints the ZeRO paper's Table 1 and Table 2's theoretical columns.",
        epilog="Sizes in GB are 1e9 bytes, as in the paper.")
    m.add_argument("model", metavar="MODEL", nargs="?", help="a parameter count (7.5B, 1.3e9, 175B, 1T) or a model "
                   "as `zeroshard plan` takes it (config.json, preset, package.module:factory)")
    m.add_argument("--gpus", type=int_list, default=[1, 2, 4, 8], help="data-parallel degrees, e.g. 1,4,16 "
                   "(default 1,2,4,8)")
    m.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16", help="compute dtype; 16-bit "
                   "keeps fp32 master weights (default bf16)")
    m.add_argument("--optimizer", choices=("adam", "sgd-momentum", "sgd"), default="adam")
    m.add_argument("--gpu-memory", type=size, default=None, help="memory per GPU, e.g. 80GB: say what fits and the "
                   "largest model that would")
    m.add_argument("--ranks-per-node", type=int, default=8, help="processes (GPUs) per node, for the host memory "
                   "needed while the model is built and loaded (default 8)")
    m.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel (MP) degree beside the data-parallel "
                   "GPUs: each GPU holds 1/TP of every parameter (default 1)")
    a = m.add_argument_group("activation checkpoints (ZeRO-R's P_a), for a transformer checkpointed at each block")
    a.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence: print checkpoint memory "
                   "and communication per step")
    a.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per micro-batch per GPU (default 1)")
    a.add_argument("--layers", type=positive_int, default=None, help="transformer blocks (default: the model's config)")
    a.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default: the model's config)")
    m.add_argument("--paper", action="store_true", help="print the ZeRO paper's Table 1 and Table 2 (theoretical)")
    m.set_defaults(func=cmd_estimate, subparser=m)
    return parser


def cmd_export(args) -> int:
    import torch

    from ..errors import CheckpointError
    from ..state.export import export
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype)
    try:
        export(args.ckpt, args.out, dtype=dtype, verify=not args.no_verify)
    except CheckpointError as err:  # one line, no traceback: the checkpoint's fault, not the command's
        text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"zeroshard export: error: {text.removeprefix('zeroshard: ')}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse errors (status 2) and --help (status 0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except UsageError as e:
        args.subparser.print_usage(sys.stderr)
        print(f"{args.subparser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `zeroshard plan ... | head`: stop quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1

