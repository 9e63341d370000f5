"""The command line's MODEL and target: a transformers config (file, folder, preset or the local
cache) or a factory, built on the meta device with example inputs; the target hardware, measured
or described (see commands.py)."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import warnings

from .args import UsageError


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
    """(Hardware, world, words on where the figures come from), with the disk tier's figures when
    one is given (--offload-dir measures it; --disk-read/--disk-write describe it)."""
    hw, world, words = _target_hardware(args)
    if args.offload_dir is not None:
        from ..planning.hardware import probe_disk
        read, write = probe_disk(args.offload_dir)
        words += f"; disk tier in {args.offload_dir}, measured"
        hw = hw.with_(disk_read=read, disk_write=write)
    if args.disk_read is not None or args.disk_write is not None:
        if args.disk_read is None or args.disk_write is None:
            raise UsageError("a described disk tier needs both --disk-read and --disk-write")
        hw = hw.with_(disk_read=args.disk_read, disk_write=args.disk_write)
        words += "; disk tier described"
    return hw, world, words


def _target_hardware(args):
    import torch
    from ..planning.hardware import Hardware, probe
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
    from ..planning.hardware import GIB
    return (f"{world} x {hw.name}: {hw.device_memory / GIB:.2f} GiB each ({hw.reserve / GIB:.2f} GiB reserved), "
            f"{_rate(hw.device_flops, 'FLOP/s')}, h2d {_rate(hw.h2d, 'B/s')}, d2h {_rate(hw.d2h, 'B/s')}, link "
            f"{_rate(hw.link, 'B/s')}, Adam {_rate(hw.device_adam, 'el/s')} on the device and "
            f"{_rate(hw.host_adam, 'el/s')} per host; {hw.gpus_per_host} device(s) and "
            f"{hw.host_memory / GIB:.0f} GiB per host"
            + (f"; disk tier: read {_rate(hw.disk_read, 'B/s')}, write {_rate(hw.disk_write, 'B/s')}"
               if hw.disk_read else ""))
