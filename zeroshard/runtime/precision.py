"""The mixed-precision policy: what besides the parameters follows the compute dtype under bf16/fp16.

Parameters are computed in the compute dtype (chunks.py) with fp32 masters (optimizer.py). The
rest, set in the config (as FSDP2's MixedPrecisionPolicy sets it per module):
- buffers (`buffer_dtype`): 'compute' casts floating buffers (BatchNorm's running statistics, masks,
  position tables) to the compute dtype at initialize, as `model.to(dtype)` and DeepSpeed do, so a
  layer never mixes 16-bit parameters with fp32 statistics; 'fp32' keeps them (then a BatchNorm,
  whose kernel needs its statistics in its parameters' dtype, is refused at initialize).
- inputs (`cast_forward_inputs`): every module with parameters casts the floating tensors it is
  called with to the compute dtype, so an fp32 activation (an fp32 buffer added to it, an fp32
  tensor made inside the forward) does not meet a 16-bit weight; False casts only the root's inputs.
- gradient reduction (`reduce_dtype`): 'compute' accumulates and reduces gradients in the compute
  dtype; 'fp32' in fp32 (twice the gradient buffers and traffic, fewer rounding steps).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

from ..units import direct_params
from ..errors import ConfigError


def cast_buffers(module: nn.Module, dtype: torch.dtype, policy: str) -> None:
    """Apply `policy` ('compute' or 'fp32') to the module's floating buffers."""
    if dtype == torch.float32:
        return
    if policy == "fp32":
        norms = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                 and m.track_running_stats]
        if norms:
            raise ConfigError(f"zeroshard: buffer_dtype='fp32' with 16-bit parameters: {norms[0]} "
                             f"({len(norms)} such) keeps running statistics that its kernel needs in its "
                             "parameters' dtype; use buffer_dtype='compute' (the default)")
        return
    for name, b in list(module.named_buffers()):
        if b.is_floating_point() and b.dtype != dtype:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = b.to(dtype)


class InputCasts:
    """Forward pre-hooks casting each parameterised module's floating inputs to `dtype`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.on = True
        self._handles = [m.register_forward_pre_hook(self._cast, with_kwargs=True)
                         for m in model.modules() if m is not model and direct_params(m)]

    @contextlib.contextmanager
    def off(self):
        """Inside it inputs keep their dtype: inside full_parameters() the parameters hold fp32 values,
        which a 16-bit input cannot meet (a forward there raised torch's dtype mismatch)."""
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before

    def _cast(self, module, args, kwargs):
        if not self.on:
            return None
        dtype = self.dtype
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype
                             else t, (args, kwargs))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
