"""The `zeroshard` command line.

    zeroshard plan MODEL [--micro-batch 1] [--seq-len 1024] [--gpus N] [--gpu-memory 40GB]
                         [--h2d 20GB/s] [--d2h 20GB/s] [--cpu-adam 2e9] [--gpu-adam 50e9]
                         [--tflops 150] [--link 100GB/s] [--precision bf16] [--checkpointing]
                         [--accumulation 1] [--json]
    zeroshard export CKPT OUT [--dtype bf16] [--no-verify]

`export` writes a checkpoint's model as one safetensors file (see zeroshard/export.py).

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
data-centre GPU); without it, this machine is measured (`zeroshard.hardware.probe`, cached) and any
figures given override the measurement. On a machine without CUDA the measured "device" is the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import warnings

# name -> (transformers config class, config kwargs)
PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)),
    "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024)),
    "gpt2-large": ("GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20, vocab_size=50257, n_positions=1024)),
    "gpt2-xl": ("GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024)),
    "gpt2-10b": ("GPT2Config", dict(n_embd=4096, n_layer=50, n_head=32, vocab_size=50257, n_positions=1024)),
    "opt-1.3b": ("OPTConfig", dict(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192, num_attention_heads=32,
                                   vocab_size=50272, max_position_embeddings=2048)),
    "opt-13b": ("OPTConfig", dict(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40,
                                  vocab_size=50272, max_position_embeddings=2048)),
    "opt-30b": ("OPTConfig", dict(hidden_size=7168, num_hidden_layers=48, ffn_dim=28672, num_attention_heads=56,
                                  vocab_size=50272, max_position_embeddings=2048)),
    "opt-66b": ("OPTConfig", dict(hidden_size=9216, num_hidden_layers=64, ffn_dim=36864, num_attention_heads=72,
                                  vocab_size=50272, max_position_embeddings=2048)),
    "opt-175b": ("OPTConfig", dict(hidden_size=12288, num_hidden_layers=96, ffn_dim=49152, num_attention_heads=96,
                                   vocab_size=50272, max_position_embeddings=2048)),
}

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)


class UsageError(Exception):
    """Bad input: reported argparse-style (usage, `error: ...`), exit status 2."""


# -- argument types -------------------------------------------------------------------------------------
def _quantity(text: str, what: str, unit_letter: bool, per_second: bool) -> float:
    s = text.strip()
    if per_second:
        s = re.sub(r"(/s|ps)$", "", s, flags=re.IGNORECASE)
    m = _QUANTITY.match(s)
    if not m or (m.group(4) and not unit_letter) or (m.group(3) and not m.group(2)):
        examples = {"size": "'40GB', '40GiB', '512MiB' or '80e9' (bytes)",
                    "bandwidth": "'20GB/s', '16GiB/s' or '25e9' (bytes/s)",
                    "rate": "'2e9', '50G' (elements/s)"}[what]
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}: use e.g. {examples}")
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    scale = 1024 ** "kmgtp".index(prefix) * 1024 if binary else _PREFIX[prefix]
    value = number * scale
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the {what} must be positive")
    return value


def size(text: str) -> int:
    """Bytes: '40GB' (1e9), '40GiB' (2**30), '80e9', '1MB'."""
    return int(_quantity(text, "size", unit_letter=True, per_second=False))


def bandwidth(text: str) -> float:
    """Bytes/s: '20GB/s', '16GiB/s', '25e9'."""
    return _quantity(text, "bandwidth", unit_letter=True, per_second=True)


def rate(text: str) -> float:
    """Elements/s: '2e9', '50G'."""
    return _quantity(text, "rate", unit_letter=False, per_second=True)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return v


def non_negative_size(text: str) -> int:
    if text.strip() in ("0", "0B", "0b"):
        return 0
    return size(text)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive finite number")
    return v


def shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape: use positive integers separated by commas, "
                                         "e.g. 4,128")
    return dims


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
    s = p.add_argument_group("search")
    s.add_argument("--stage", choices=("auto", "2", "3"), default="auto", help="restrict the plan to one stage")
    s.add_argument("--no-offload", action="store_true", help="keep every optimizer state on the GPU")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_plan, subparser=p)

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


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers, e.g. 1,4,16") from None
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,4,16")
    return out


_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


def parameter_count(text: str) -> float | None:
    """7.5B -> 7.5e9, 1T -> 1e12, 350M, 1.3e9; None if `text` is not a count."""
    m = _COUNT.match(text)
    if not m:
        return None
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]


def cmd_estimate(args) -> int:
    from .estimate import estimate, largest_model, load_host_bytes, table1, table2
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
          "device / host")
    configs = [(s, "none") for s in range(4)] + [(s, "optimizer") for s in (1, 2, 3)] + [(3, "optimizer+params")]
    names = {"none": "", "optimizer": " + offload", "optimizer+params": " + offload + params"}
    head = ("stage",) + tuple(f"{n} GPUs" if n > 1 else "1 GPU" for n in args.gpus)
    rows = []
    for stage, off in configs:
        cells = []
        for n in args.gpus:
            e = estimate(psi, stage, n, offload=off, **kw)
            fits = "" if args.gpu_memory is None else (" ok" if e.device <= args.gpu_memory else " no")
            cells.append(f"{e.device / 1e9:.2f} / {e.host / 1e9:.2f}{fits}")
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
    from .estimate import activation_checkpoint_bytes, communication_per_step
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


def cmd_export(args) -> int:
    import torch

    from .errors import CheckpointError
    from .export import export
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


# -- the model ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Loaded:
    model: object  # nn.Module on the meta device
    source: str  # how MODEL was understood, in words
    config: object | None = None  # transformers config, if any


def _quiet_transformers():
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.logging.disable_progress_bar()
    except AttributeError:
        pass
    return transformers


def _config_from_path(path: str):
    transformers = _quiet_transformers()
    from transformers import AutoConfig
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UsageError(f"{path!r} is a directory without a config.json")
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"could not read the transformers config in {path!r}: {e}") from None
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"could not read {path!r} as a JSON config: {e}") from None
    if not isinstance(d, dict) or "model_type" not in d:
        raise UsageError(f"{path!r} is not a transformers config.json (it has no 'model_type')")
    d = dict(d)
    model_type = d.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path!r}: transformers {transformers.__version__} cannot build a config of model_type "
                         f"{model_type!r}: {e}") from None


def _config_from_preset(name: str):
    _quiet_transformers()
    import transformers
    cls, kwargs = PRESETS[name]
    return getattr(transformers, cls)(**kwargs)


def _config_from_hub_cache(name: str):
    try:
        _quiet_transformers()
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001: any failure here means "not a model we can find"
        return None


def _enable_checkpointing(model) -> bool:
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(model, name, None)
        if callable(fn):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    fn()
                except ValueError as e:  # transformers: "model does not support gradient checkpointing"
                    raise UsageError(f"--checkpointing: {e}") from None
            return True
    return False


def _build_transformers(cfg, source: str, checkpointing: bool) -> Loaded:
    import torch
    _quiet_transformers()
    from transformers import AutoModelForCausalLM
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:
        raise UsageError(f"{source}: transformers has no causal-LM model for this config "
                         f"(model_type {getattr(cfg, 'model_type', '?')!r}): {str(e).splitlines()[0]}") from None
    if checkpointing and not _enable_checkpointing(model):
        raise UsageError("--checkpointing: the model has no activation_checkpointing_enable()")
    return Loaded(model, source, cfg)


def _build_factory(spec: str, checkpointing: bool) -> Loaded:
    import torch
    modname, _, attr = spec.partition(":")
    if not modname or not attr:
        raise UsageError(f"{spec!r}: a factory is given as package.module:callable")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules next to the user resolve
    try:
        obj = importlib.import_module(modname)
    except ImportError as e:
        raise UsageError(f"{spec!r}: cannot import module {modname!r} ({e})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{spec!r}: module {modname!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"{spec!r} is not callable")
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = obj()
    except Exception as e:  # noqa: BLE001: the user's code; say what failed, without a traceback
        raise UsageError(f"calling {spec}() failed: {type(e).__name__}: {e}") from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{spec}() returned a {type(model).__name__}, not a torch.nn.Module")
    if checkpointing and not _enable_checkpointing(model):
        raise UsageError(f"--checkpointing: the model from {spec} has no activation_checkpointing_enable() or "
                         "gradient_checkpointing_enable(); checkpoint inside the factory instead")
    return Loaded(model, f"factory {spec}")


def load_model(name: str, checkpointing: bool) -> Loaded:
    if os.path.exists(name):
        cfg = _config_from_path(name)
        return _build_transformers(cfg, f"transformers config {name}", checkpointing)
    if ":" in name:
        return _build_factory(name, checkpointing)
    if name.lower() in PRESETS:
        cfg = _config_from_preset(name.lower())
        return _build_transformers(cfg, f"preset {name.lower()} ({type(cfg).__name__})", checkpointing)
    cfg = _config_from_hub_cache(name)
    if cfg is None:
        raise UsageError(f"unknown model {name!r}: not a path to a config.json or its directory, not "
                         f"package.module:factory, not a preset ({', '.join(PRESETS)}), and not a transformers "
                         "model id whose config is in the local Hugging Face cache (nothing is downloaded)")
    return _build_transformers(cfg, f"transformers model {name} (cached config)", checkpointing)


def example_inputs(loaded: Loaded, args):
    """The inputs of one micro-batch, and a few words saying what they are."""
    import torch
    if loaded.config is not None:
        if args.input_shape is not None or args.input_dtype is not None:
            raise UsageError("--input-shape/--input-dtype are for factory models; transformers models take "
                             "--micro-batch and --seq-len")
        cfg = loaded.config
        vocab = getattr(cfg, "vocab_size", None)
        if not vocab:
            emb = loaded.model.get_input_embeddings()
            vocab = getattr(emb, "num_embeddings", None)
        if not vocab:
            raise UsageError(f"{loaded.source}: cannot tell the vocabulary size")
        positions = next((getattr(cfg, k) for k in ("max_position_embeddings", "n_positions")
                          if isinstance(getattr(cfg, k, None), int)), None)
        micro = args.micro_batch or 1
        seq = args.seq_len or (min(1024, positions) if positions else 1024)
        if positions and seq > positions:
            raise UsageError(f"--seq-len {seq} exceeds the model's {positions} positions")
        ids = torch.randint(0, vocab, (micro, seq))
        return {"input_ids": ids, "labels": ids}, f"micro-batch {micro} x {seq} tokens"
    if args.micro_batch is not None or args.seq_len is not None:
        raise UsageError("--micro-batch/--seq-len are for transformers models; give a factory model's input "
                         "with --input-shape (e.g. 4,128)")
    if args.input_shape is None:
        raise UsageError(f"{loaded.source}: give the model's input with --input-shape (e.g. 4,128)")
    embedding = next((m for m in loaded.model.modules() if isinstance(m, torch.nn.Embedding)), None)
    kind = args.input_dtype or ("long" if embedding is not None else "float")
    dtype = {"long": torch.long, "int": torch.int32, "float": torch.float32, "fp32": torch.float32,
             "bf16": torch.bfloat16, "fp16": torch.float16}[kind]
    if dtype.is_floating_point:
        x = torch.empty(args.input_shape, dtype=dtype, device="meta")
    else:
        x = torch.zeros(args.input_shape, dtype=dtype, device="meta")
    return x, f"input {tuple(args.input_shape)} {str(dtype).replace('torch.', '')}"


# -- the target -----------------------------------------------------------------------------------------------
def target_hardware(args):
    """(Hardware, world, words on where the figures come from)."""
    import torch
    from .hardware import Hardware, probe
    overrides = dict(h2d=args.h2d, d2h=args.d2h, host_adam=args.cpu_adam, device_adam=args.gpu_adam,
                     device_flops=args.tflops * 1e12 if args.tflops else None, link=args.link,
                     gpus_per_host=args.gpus_per_host, host_memory=args.host_memory, reserve=args.reserve)
    if args.gpu_memory is not None:
        fig = {k: v for k, v in overrides.items() if v is not None and k != "reserve"}
        hw = Hardware.described(args.gpu_memory, name="described GPU", **fig)
        if args.reserve is not None:
            hw = hw.with_(reserve=args.reserve)
        return hw, args.gpus or 1, "described (defaults where not given: 20GB/s each way, 150 TFLOP/s, 50e9 " \
            "el/s device Adam, 2e9 el/s host Adam, link = h2d, 2GiB reserve, 512GiB host, 1 GPU per host)"
    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    hw = probe(dtype=dtype)
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        hw = hw.with_(**given)
    if cuda:
        world = args.gpus or max(1, torch.cuda.device_count())
        words = "measured on this machine" + (f", with {', '.join(given)} as given" if given else "")
    else:
        world = args.gpus or 1
        words = ("measured on this machine, which has no CUDA device: the CPU is the device and host memory its "
                 "memory" + (f"; {', '.join(given)} as given" if given else "")
                 + ". Describe a GPU with --gpu-memory (and --h2d, --tflops, ...) to plan for one.")
    return hw, world, words


def _rate(x: float, unit: str) -> str:
    """'20 GB/s', '150 TFLOP/s', '2 G el/s'."""
    gap = " " if unit[0].islower() else ""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}{gap}{unit}"
    return f"{x:.3g} {unit}"


def describe_hardware(hw, world: int) -> str:
    from .hardware import GIB
    return (f"{world} x {hw.name}: {hw.device_memory / GIB:.2f} GiB each ({hw.reserve / GIB:.2f} GiB reserved), "
            f"{_rate(hw.device_flops, 'FLOP/s')}, h2d {_rate(hw.h2d, 'B/s')}, d2h {_rate(hw.d2h, 'B/s')}, link "
            f"{_rate(hw.link, 'B/s')}, Adam {_rate(hw.device_adam, 'el/s')} on the device and "
            f"{_rate(hw.host_adam, 'el/s')} per host; {hw.gpus_per_host} device(s) and "
            f"{hw.host_memory / GIB:.0f} GiB per host")


# -- plan ----------------------------------------------------------------------------------------------------
def _plan_facts(p) -> dict:
    from .hardware import GIB
    t = p.time
    return {
        "name": p.name, "fits": p.fits, "stage": p.stage, "config": p.config(), "chunk_size": p.chunk_size,
        "chunks": len(p.optimizer_on_host), "cache_chunks": p.cache_chunks,
        "offloaded_chunks": sum(p.optimizer_on_host), "optimizer_on_host": list(p.optimizer_on_host),
        "padding_waste": p.waste, "device_bytes": p.device_bytes, "device_gib": p.device_bytes / GIB,
        "device_memory": p.device_memory, "device_model_bytes": p.device_model_bytes,
        "host_model_bytes": p.host_model_bytes, "transient_bytes": p.transient_bytes,
        "activation_bytes": p.activation_bytes, "other_bytes": p.other_bytes, "loads_per_step": p.loads,
        "time_ms": {"total": t.total * 1e3, "compute": t.compute * 1e3, "exposed_transfers": t.exposed_transfers * 1e3,
                    "device_step": t.device_step * 1e3, "cpu_step": t.cpu_step * 1e3},
        "tflops": p.tflops, "notes": list(p.notes), "describe": p.describe(),
    }


def _table(plans) -> str:
    from .hardware import GIB
    head = ("configuration", "device GiB", "fits", "step ms", "compute ms", "exposed transfers ms", "device step ms",
            "CPU step ms", "TFLOPS/GPU")
    rows = []
    for p in plans:
        t = p.time
        rows.append((p.name, f"{p.device_bytes / GIB:.2f}", "yes" if p.fits else "no", f"{t.total * 1e3:.1f}",
                     f"{t.compute * 1e3:.1f}", f"{t.exposed_transfers * 1e3:.1f}", f"{t.device_step * 1e3:.1f}",
                     f"{t.cpu_step * 1e3:.1f}", f"{p.tflops:.1f}"))
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
    from .planner import Planner, Target
    from .profiler import profile

    loaded = load_model(args.model, args.checkpointing)
    inputs, input_words = example_inputs(loaded, args)
    hw, world, hw_words = target_hardware(args)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # A GPU target (described, or this machine's) profiles attention as a GPU runs it.
            gpu = args.gpu_memory is not None or torch.cuda.is_available()
            prof = profile(loaded.model, inputs, dtype=args.precision, device="cuda" if gpu else "cpu")
    except Exception as e:  # noqa: BLE001: most often inputs that do not suit the model
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"profiling {args.model} on the meta device failed ({input_words}): "
                         f"{type(e).__name__}: {first}") from None
    planner = Planner(prof, Target(hw, world=world, accumulation=args.accumulation))
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


if __name__ == "__main__":
    sys.exit(main())
