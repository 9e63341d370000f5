"""torch's Adam and AdamW step on fp32 CPU tensors in one pass over memory, with torch's bits.

The tiled step (tiled_step.py) hands torch's optimizer cache-sized tiles; torch's single-tensor
Adam still makes seven passes over each tile (one per operation), and an Adam step on the CPU is
bound by memory traffic. csrc/exact_adam.cpp does the same operations in one pass, each written as
ATen's CPU kernel computes it, so the parameter and both moments come out bit for bit as torch's
(`python bench/exact_adam.py`, 23.2M elements, a 2-core AVX-512 Xeon, torch 2.13: 33.5 ms on 2
threads against torch's 106.2 ms over the same elements as tiles, 70.3 against 165.3 ms on one).

Bits that match on one machine may not on another (a torch built without MKL, whose sqrt the
kernel borrows; another CPU capability), so nothing is taken on trust: before a code path is
first used (`agrees`), a probe steps with torch's own optimizer and with the kernel, and every
bit is compared; where they differ, torch's step is used, as where the kernel
cannot be built. ZEROSHARD_EXACT_ADAM=off never builds it; =on builds it for any size (by default
only where a rank steps at least MIN_ELEMENTS elements as spans: the build takes about 8 s, once
per machine, cached by torch's extension builder).
"""
from __future__ import annotations

import logging
import os
import struct
import threading

import torch
from torch.optim.adam import adam as torch_adam  # the function Adam.step calls (no optimizer hooks)

from ..errors import ConfigError
from .kernels import build

log = logging.getLogger("zeroshard")

MIN_ELEMENTS = 1 << 20  # a step of 1M elements gains ~3 ms: below that the first run's build does not pay
# torch's CPU capability -> the compiler flags of its vector instructions, FMA included
CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}
# torch steps the probe as tensors of these lengths, the kernel as one: three kernel blocks and a
# short one, and lengths that are no multiple of a vector, so torch's scalar loops are compared too
PROBE_LENGTHS = (3 * 4096 + 8, 24, 8, 24)
PROBE_STEPS = 3

_ops = None
_tried = False
_lock = threading.Lock()  # the delayed update's thread may ask first, while the main thread does
_agreed: dict[tuple, bool] = {}


def wanted(elements: int) -> bool:
    """Whether a rank stepping `elements` elements as spans should use the kernel (the env var and
    the size rule of the module docstring); says nothing of whether it can be built."""
    mode = os.environ.get("ZEROSHARD_EXACT_ADAM", "").lower()
    if mode not in ("", "on", "off"):
        raise ConfigError(f"ZEROSHARD_EXACT_ADAM={os.environ['ZEROSHARD_EXACT_ADAM']!r}: valid values are 'on' "
                          "(the exact Adam kernel for any size), 'off' (never), or unset (by size)")
    if mode == "off":
        return False
    return mode == "on" or elements >= MIN_ELEMENTS


def ops():
    """The kernel's torch.ops namespace, built on first call; None where it cannot be built or
    this torch has no vmsSqrt (the reason logged once)."""
    global _ops, _tried
    with _lock:
        if not _tried:
            _ops = _build()
            _tried = True
    return _ops


def _build():
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in CAPABILITY_FLAGS:
        log.info("exact Adam kernel: not for torch's CPU capability %s; torch's step is used", capability)
        return None
    name = f"zeroshard_exact_adam_{capability.lower()}"
    log.info("building the exact Adam kernel (%s; once per machine, about 8 s)", name)
    # -mfma with the capability's flags: Vectorized<float>'s fmadd is then one rounding, as ATen's;
    # -ffp-contract=off: the compiler fuses nothing ATen does not.
    built = build(name, "exact_adam.cpp", ["-O3", "-ffp-contract=off", "-fopenmp", f"-DCPU_CAPABILITY_{capability}",
                                           f"-DCPU_CAPABILITY={capability}", *CAPABILITY_FLAGS[capability]],
                  "exact Adam kernel", "torch's step is used", python_module=False)
    if built is None:
        return None
    if not torch.ops.zeroshard_exact_adam.has_vml():
        log.info("exact Adam kernel: this torch has no vmsSqrt (built without MKL); torch's step is used")
        return None
    return torch.ops.zeroshard_exact_adam


def fits_optimizer(opt) -> bool:
    """`opt` is torch's Adam or AdamW itself (a subclass may step otherwise), with no GradScaler
    state on it (the fused path's grad_scale/found_inf)."""
    return (type(opt) in (torch.optim.Adam, torch.optim.AdamW) and getattr(opt, "grad_scale", None) is None
            and getattr(opt, "found_inf", None) is None)


def fits_group(group: dict) -> bool:
    """The group steps by _single_tensor_adam's non-capturable path with plain float
    hyperparameters, and its weight decay is decoupled or zero (Adam's L2 decay adds to the
    gradient: not in the kernel)."""
    if any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")):
        return False
    numbers = (group.get("lr"), *group.get("betas", (None, None)), group.get("eps"), group.get("weight_decay"))
    if not all(type(x) in (float, int) for x in numbers):
        return False
    return group["weight_decay"] == 0 or bool(group.get("decoupled_weight_decay"))


def step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          group: dict, step: float) -> None:
    """One step of `group`'s Adam on flat fp32 CPU tensors (a length that is a multiple of 16
    elements) whose step count is now `step` (already counted, as torch counts it before the
    update). The scalars are torch's, computed as it computes them (Python floats)."""
    _apply(param, grad, exp_avg, exp_avg_sq, group, step)


def _apply(param, grad, exp_avg, exp_avg_sq, group: dict, step: float) -> None:  # the probe's entry too
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    decay = 1 - lr * wd if wd != 0 else 1.0
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    with torch.no_grad():
        _ops.adam_(param, grad, exp_avg, exp_avg_sq, decay, 1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5,
                   eps, -step_size)
    # The kernel writes through pointers; torch's in-place ops would have counted the writes, and a
    # backward through a graph that saved these tensors must see them (autograd's check, saved_tensors.py)
    torch.autograd.graph.increment_version([param, exp_avg, exp_avg_sq])


def agrees(opt_class, group: dict) -> bool:
    """Whether the kernel gives torch's bits for `group` under `opt_class`: PROBE_STEPS steps of a
    probe with gradients at three scales, each parameter and moment compared bit for bit. Asked
    once per code path, the first time with this group's values: ATen's kernels branch on the
    lerp weight (|1 - beta1| below 0.5 or not) and torch on whether weight decay is 0; other values
    only change the scalars, each computed as torch computes it (so an LR schedule does not ask
    again at every step). Draws from its own generator, not the global one."""
    weight = abs(struct.unpack("f", struct.pack("f", 1 - group["betas"][0]))[0])  # in fp32, as ATen compares it
    key = (opt_class, weight < 0.5, group["weight_decay"] == 0, bool(group.get("decoupled_weight_decay")))
    if key not in _agreed:
        _agreed[key] = ops() is not None and _probe(opt_class, group)
        if not _agreed[key] and _ops is not None:
            log.warning("exact Adam kernel: its bits differ from torch's for %s (lr %s, betas %s, eps %s, "
                        "weight_decay %s); torch's step is used", opt_class.__name__, group["lr"], group["betas"],
                        group["eps"], group["weight_decay"])
    return _agreed[key]


def _probe(opt_class, group: dict) -> bool:
    """torch's single-tensor Adam (its function, so no user's global optimizer hook sees the probe)
    on tensors of PROBE_LENGTHS against the kernel on their concatenation."""
    gen = torch.Generator().manual_seed(0)
    n = sum(PROBE_LENGTHS)
    mine, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    params = [t.clone() for t in mine.split(PROBE_LENGTHS)]
    moments = [torch.zeros(k) for k in PROBE_LENGTHS], [torch.zeros(k) for k in PROBE_LENGTHS]
    steps = [torch.tensor(0.0) for _ in PROBE_LENGTHS]
    decoupled = opt_class is torch.optim.AdamW or bool(group.get("decoupled_weight_decay"))
    with torch.no_grad():
        for k in range(1, PROBE_STEPS + 1):
            g = torch.randn(n, generator=gen) * 10.0 ** (k % 3 - 1)
            g[::13] = 0  # zero gradients: a zero moment's sqrt
            torch_adam(params, list(g.split(PROBE_LENGTHS)), *moments, [], steps, foreach=False, capturable=False,
                       differentiable=False, fused=None, has_complex=False, decoupled_weight_decay=decoupled,
                       amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
                       weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            _apply(mine, g, m, v, group, float(k))
            if not (torch.equal(mine, torch.cat(params)) and torch.equal(m, torch.cat(moments[0]))
                    and torch.equal(v, torch.cat(moments[1]))):
                return False
    return True
