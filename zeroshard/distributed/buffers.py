"""Reused host buffers (ZeRO-R's constant-size buffers, kept literally where nothing else keeps them).

On the CPU torch takes a large tensor from malloc, which hands a freed block of that size straight
back to the system; the next tensor of the same size then pays a page fault per 4 KiB and the
kernel's zeroing. A stage-2 backward of gpt2-tiny makes two 13 MB buffers (its full gradient, and
the all-to-all's receive buffer) and spent ~4 ms more than stage 1's, whose gradient buffer lives
on (2 ranks, 2 cores). A pool keeps a few freed buffers per size and hands them out again. CUDA
tensors are not pooled: torch's caching allocator already reuses their blocks.
"""
from __future__ import annotations

import torch

MIN_POOLED = 1 << 16  # bytes: smaller tensors come from malloc's own free lists (and the tests' chunks are pooled)


class BufferPool:
    """Up to `keep` freed buffers per (elements, dtype) on the CPU; `held_bytes` is what it keeps."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.held_bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D tensor of `numel` elements (a kept one where there is one)."""
        kept = self._free.get((numel, dtype)) if device.type == "cpu" else None
        if kept:
            t = kept.pop()
            self.held_bytes -= t.numel() * t.element_size()
            return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """`t` is no longer used by anyone (no view of it read later, no collective writing it)."""
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < MIN_POOLED or not t.is_contiguous() or t.dim() != 1 \
                or t.storage_offset() or t.untyped_storage().nbytes() != nbytes:
            return
        kept = self._free.setdefault((t.numel(), t.dtype), [])
        if len(kept) < self.keep:
            kept.append(t)
            self.held_bytes += nbytes
