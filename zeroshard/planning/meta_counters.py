"""What the profiler counts while one training step runs on the meta device: every storage an
operator creates until it is freed, with the peak of their sum, matmul flops and the model's own
collectives (`LiveBytes`, a dispatch mode); the distinct storages autograd saves for backward
(`SavedBytes`, saved-tensor hooks); attention's kernel chosen as on the target device
(`AttentionAsOnDevice`), and autocast named for the meta device made for it (`AutocastOnMeta`).
profiler.py runs the step and reads them.
"""
from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from ..distributed.tensor_parallel import local
from .input_values import InputValues

log = logging.getLogger("zeroshard")


class LiveBytes(TorchDispatchMode):
    """Follows every storage created by an operator until it is freed; keeps the peak of their sum.
    Also counts matmul-like flops with torch's flop formulas."""

    def __init__(self, known: set[int], values: InputValues | None = None):
        super().__init__()
        self.known = known  # storages that existed before the step (parameters, inputs, buffers)
        self.values = values or InputValues()  # what the inputs and buffers alone determine
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.phase = "forward"
        self.flops = 0
        self.assumed = 0  # values of meta tensors read by the model (see _assumed_value)
        self.collectives = 0  # the model's own collectives (tensor parallelism's), and
        self.collective_bytes = 0.0  # the bytes each rank moves in them (ring accounting)

    def _assumed_value(self, t: torch.Tensor):
        """A meta tensor has no values, so a model that reads one (`.item()`, `if mask.all():`) gets
        an assumed one: True for a boolean (such checks usually guard the common case: no padding,
        no packing), else 0. Said once, since the trace past that point may differ from training.
        Tensors on a real device (the model's own `torch.rand([])`, say) are read as they are."""
        value = True if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if not self.assumed:
            log.warning("the model reads a tensor's value (%s); on the meta device "
                        "there is none, assuming %r. If a branch depends on it, the profile may differ "
                        "from training; the runtime then falls back (and says so).", t.dtype, value)
        self.assumed += 1
        return value

    def _count_collective(self, op, args) -> None:
        """A collective of the functional API (what DTensor issues): a ring all-reduce of M bytes
        moves 2M(n-1)/n per rank; an all-gather (M: its output) or reduce-scatter (M: its input) M(n-1)/n.
        On meta tensors nothing is sent: the meta kernels only shape the outputs."""
        c10d = torch.ops._c10d_functional
        factors = {c10d.all_reduce: 2.0, c10d.all_gather_into_tensor: 1.0, c10d.reduce_scatter_tensor: 1.0}
        if op not in factors:
            return
        from torch.distributed.distributed_c10d import _resolve_process_group
        n = _resolve_process_group(args[-1]).size()
        size = args[0].numel() * args[0].element_size() * (n if op is c10d.all_gather_into_tensor else 1)
        self.collectives += 1
        self.collective_bytes += factors[op] * size * (n - 1) / n

    def _grouped_mm(self, func, a, b, offs=None, bias=None, out_dtype=None):
        """torch._grouped_mm, a fused mixture of experts' matmuls (transformers' default), with its
        flops, which torch's formulas lack: 2 x each output element x the length of the sum behind
        it, that sum split among the groups where both operands are 2-D (the weights' gradient).
        Its meta kernel accepts bf16 only, where the CPU kernel computes fp32 too: on meta, an fp32
        profile shapes the output from bf16 stand-ins."""
        if a.device.type == "meta" and a.dtype != torch.bfloat16:
            bf16 = [t.to(torch.bfloat16) if t is not None and t.is_floating_point() else t for t in (a, b, bias)]
            out = func(bf16[0], bf16[1], offs, bf16[2], torch.bfloat16).to(out_dtype or a.dtype)
        else:
            out = func(a, b, offs, bias, out_dtype)
        per_group = out.numel() // out.shape[0] if a.dim() == 2 and b.dim() == 2 else out.numel()
        self.flops += 2 * per_group * a.shape[-1]
        return out

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            # Only a meta tensor lacks a value: a real one (`torch.rand([]) < p`, as in LayerDrop) is read
            # as it is, or a branch on it would be steered wrong (every layer skipped, for one); so is
            # one computed from the inputs alone (input_values.py).
            value = self.values.value_of(args[0])
            return self._assumed_value(args[0]) if value is None else value.item()
        if func is torch.ops.aten._grouped_mm.default:
            out = self._grouped_mm(func, *args, **kwargs)
        else:
            try:
                out = func(*args, **kwargs)
            except (NotImplementedError, RuntimeError):  # no meta kernel: a shape that depends on values
                out = self.values.instead(func, args, kwargs)
                if out is None:
                    raise
            else:
                self.values.follow(func, args, kwargs, out)
        if func.namespace == "_c10d_functional":
            self._count_collective(func._overloadpacket, args)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:  # per rank: a tensor-parallel operator's flops are those of its shards
            self.flops += count(*tree_map(local, args), **tree_map(local, kwargs), out_val=tree_map(local, out))
        flat, _ = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor):
                continue
            st = local(t).untyped_storage()
            key = st._cdata
            if key in self.live or key in self.known:
                continue
            n = st.nbytes()
            self.live[key] = n
            self.current += n
            weakref.finalize(st, self._free, key)
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase
        return out


class SavedBytes:
    """Saved-tensor accounting: the peak bytes of distinct storages autograd holds for backward,
    storages in `known` (parameters) excluded."""

    def __init__(self, known: set[int]):
        self.known = known
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _drop(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = local(t).untyped_storage()
        key = st._cdata
        if key not in self.known and key not in self.live:
            self.live[key] = st.nbytes()
            self.current += st.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._drop, key)
        return t


class AttentionAsOnDevice:
    """scaled_dot_product_attention picks its kernel by device; on meta it always decomposes into
    the math kernel, which saves the whole attention matrix (seq^2 per head) where flash attention
    saves one row statistic. So ask the device that will train which kernel it would use (on empty
    tensors of the same shapes with batch 1: CPU pages are never touched) and call that kernel on
    the meta tensors. For a GPU not present here: flash attention in 16-bit without a mask, else
    memory-efficient attention.

    For the duration of the profile, torch.nn.functional.scaled_dot_product_attention is replaced
    (meta tensors only; anything else goes to the original). A torch function mode would be cleaner
    but does not reach the forwards that activation checkpointing re-runs inside backward, and a
    recomputation that picks another kernel than its forward is an error. Code that bound the
    function at import time (`from torch.nn.functional import scaled_dot_product_attention`) is not
    reached either and is profiled with the math kernel: an overestimate, never an underestimate."""

    def __init__(self, device: torch.device):
        self.device = device
        self.original = None

    def __enter__(self):
        self.original = F.scaled_dot_product_attention

        def sdpa(*args, **kwargs):
            out = self._sdpa(*args, **kwargs)
            return self.original(*args, **kwargs) if out is None else out
        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self.original

    def _choice(self, q, k, v, mask, dropout_p, is_causal, scale) -> int:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            return 1 if q.dtype in (torch.float16, torch.bfloat16) and mask is None else 2

        def real(t):
            if t is None:
                return None
            shape = (1,) + tuple(t.shape[1:]) if t.dim() > 0 else ()
            return torch.empty(shape, dtype=t.dtype, device=self.device).requires_grad_(t.requires_grad)

        return torch._fused_sdp_choice(real(q), real(k), real(v), real(mask), dropout_p, is_causal, scale=scale)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if query.device.type != "meta" or enable_gqa:
            return None
        choice = self._choice(query, key, value, attn_mask, dropout_p, is_causal, scale)
        aten = torch.ops.aten
        if choice == 1 and self.device.type == "cpu":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        if choice == 1 and attn_mask is None:
            return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        if choice == 2:
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, query.requires_grad,
                                                                dropout_p, is_causal, scale=scale)[0]
        return None  # math: the meta decomposition is that kernel


class AutocastOnMeta:
    """torch.autocast(device_type="meta") raises (autocast knows no meta device), which code naming
    the device of its tensors meets on the meta device: peft's LoRA of a parameter turns autocast
    off around its adapters' product with torch.autocast(W.device.type, enabled=False). For the
    duration of the profile, torch.autocast named for meta is made for the device that will train."""

    def __init__(self, device: torch.device):
        self.device = device
        self.original = None

    def __enter__(self):
        self.original = original = torch.autocast
        target = self.device.type

        class autocast(original):
            def __init__(self, device_type, *args, **kwargs):
                super().__init__(target if device_type == "meta" else device_type, *args, **kwargs)
        torch.autocast = autocast
        return self

    def __exit__(self, *exc):
        torch.autocast = self.original
