"""A fast AdamW for parameters in host memory (ZeRO-Offload's CPU Adam).

`CPUAdamW` is a torch.optim.Optimizer with AdamW's hyperparameters and state layout (its state_dict
loads into torch.optim.AdamW and back). An AdamW step is bound by memory bandwidth (28 bytes per
element), so the kernel that wins is the one that makes the fewest passes over memory:
- updating only the fp32 parameter: torch's fused AdamW kernel already does one multi-threaded pass
  and is the fastest measured here (bench/cpu_adam.py), so it is used as is: results are bit for bit
  those of torch.optim.AdamW(fused=True);
- updating the fp32 master *and* writing the 16-bit copy that goes back to the device (what
  ZeRO-Offload needs in mixed precision): torch needs a second pass for the copy; csrc/cpu_adam.cpp
  does both in one pass (30 bytes per element), on torch's CPU thread pool. It is compiled with
  torch's extension builder on first use (about 25 s, cached per machine); without a C++ compiler
  the fused kernel plus a copy is used. Its results differ from torch's by rounding only (operation
  order), about 1e-7 relative per step.
"""
from __future__ import annotations

import os

import torch
from ..errors import ConfigError
from .kernels import build

_kernel = None
_kernel_tried = False


def kernel():
    """The compiled one-pass kernel, or None when it cannot be built (reason logged once).
    ZEROSHARD_CPU_ADAM=torch skips it (torch's fused AdamW is used instead)."""
    global _kernel, _kernel_tried
    if _kernel_tried:
        return _kernel
    _kernel_tried = True
    if os.environ.get("ZEROSHARD_CPU_ADAM", "").lower() == "torch":
        return None
    # -ffp-contract=off: no product fused into a later add, so a gradient scaled in the kernel
    # equals one scaled by torch beforehand, bit for bit.
    _kernel = build("zeroshard_cpu_adam", "cpu_adam.cpp",
                    ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"],
                    "CPU Adam kernel", "using torch's fused AdamW")
    return _kernel


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay), fast on host-resident fp32 parameters.

    Args are torch.optim.AdamW's: lr, betas, eps, weight_decay (default 1e-2).

    `copy_targets` maps id(param) to a 16-bit tensor (bf16 or fp16, the parameter's size, on the
    CPU) to receive the updated parameter in the same pass; ids of parameters whose copy was written
    go to `copied` (not written: no compiler, so the caller copies).
    `grad_inputs` maps id(param) to (gradient, scale1, scale2): the step uses that gradient (fp32,
    bf16 or fp16, the parameter's size, on the CPU) times scale1 then scale2 instead of `p.grad`, read
    in the same pass (a 16-bit gradient is not widened to an fp32 copy first). Each entry is used once.
    The engine fills and clears these; plain users can ignore them.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not lr >= 0:
            raise ConfigError(f"CPUAdamW: lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"CPUAdamW: betas must be in [0, 1), got {betas}")
        if not eps >= 0 or not weight_decay >= 0:
            raise ConfigError(f"CPUAdamW: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.copy_targets: dict[int, torch.Tensor] = {}
        self.copied: set[int] = set()
        self.grad_inputs: dict[int, tuple[torch.Tensor, float, float]] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = kernel()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                grad, s1, s2 = self.grad_inputs.pop(id(p), (p.grad, 1.0, 1.0))
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("CPUAdamW does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                target = self.copy_targets.pop(id(p), None)
                scaled = s1 != 1.0 or s2 != 1.0
                if k is not None and (target is not None or scaled) and _kernel_fits(p, st) \
                        and grad.device.type == "cpu" and grad.dtype in _KERNEL_GRADS:
                    k.adamw_(p, grad.contiguous(), st["exp_avg"], st["exp_avg_sq"], target, lr, beta1, beta2, eps,
                             wd, int(st["step"].item()), s1, s2)
                    if target is not None:
                        self.copied.add(id(p))
                else:
                    if scaled:  # as the kernel would: fp32, times s1, then times s2
                        grad = grad.float().mul_(s1)
                        if s2 != 1.0:
                            grad.mul_(s2)
                    step = st["step"] if p.device.type == "cpu" else st["step"].to(p.device)
                    torch._fused_adamw_([p], [grad.to(p.dtype)], [st["exp_avg"]], [st["exp_avg_sq"]], [],
                                        [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
                                        amsgrad=False, maximize=False)
        return loss


_KERNEL_GRADS = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_fits(p: torch.Tensor, st: dict) -> bool:
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous()
            and st["exp_avg"].is_contiguous() and st["exp_avg_sq"].is_contiguous())
