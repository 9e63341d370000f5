"""Reductions over large flat tensors (gradients at the step and as they arrive, weight blocks as
they are read) that torch's direct forms make slow or inexact on a CPU."""
from __future__ import annotations

import torch

ROW = 1 << 16  # elements per partial sum of squares_sum


def all_finite(tensors) -> bool:
    """Whether every element of `tensors` (floating point; None entries are skipped) is finite.

    One sum per tensor, all read in one host copy per device: an inf or NaN makes every sum that
    holds it inf or NaN, so a finite sum proves its tensor finite. Only a tensor whose sum is not
    finite (it holds an inf or NaN, or huge finite elements overflowed the sum) is checked element
    by element with torch.isfinite, which makes a boolean temporary the tensor's size: 40x slower
    than a sum on a CPU here (3.3M fp32 elements: 6.9 ms against 0.16 ms)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel():
            by_device.setdefault(t.device, []).append(t)
    for ts in by_device.values():
        sums = torch.stack([_sum(t) for t in ts])
        for t, finite in zip(ts, torch.isfinite(sums).tolist()):
            if not finite and not bool(torch.isfinite(t).all()):
                return False
    return True


def _sum(t: torch.Tensor) -> torch.Tensor:
    # In the tensor's dtype where its range is fp32's or wider (sum(dtype=float32) of bf16 is 40x
    # slower on a CPU here); fp16, whose sums overflow at 65504, through an fp32 copy.
    return (t.float() if t.dtype == torch.float16 else t).sum().float()


def squares_sum(t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The sum of the squares of `t * scale` (t flat), as a 0-dim fp32 tensor on t's device, in one
    pass without a temporary of t's size.

    Why rows: torch.linalg.vector_norm over a whole large tensor accumulates each vector lane in one
    running sum, whose rounding grows with the length (a relative error of 1e-4 at 3.3M elements and
    3e-3 at 23M here); the norms of rows of ROW elements, squared and summed, err by under 1e-6 at
    the same speed."""
    t = t.reshape(-1)
    n = t.numel() - t.numel() % ROW
    total = torch.linalg.vector_norm(t[n:], dtype=torch.float32).square()
    if n:
        total = total + torch.linalg.vector_norm(t[:n].view(-1, ROW), dim=1, dtype=torch.float32).square().sum()
    return total * (scale * scale) if scale != 1.0 else total


def sum_rows(rows: torch.Tensor, out: torch.Tensor, out_row: int | None = None) -> None:
    """out <- rows[0] + rows[1] + ... (rows: 2-D, one row per rank), added in row order, each
    element rounded once per addition as torch.add rounds it. `out_row`: the row whose values are in
    `out` itself, not in rows[out_row] (a reduce-scatter's own slot): read in place when it is the
    first or second addend, copied into rows[out_row] first otherwise (rows[out_row] is overwritten).

    Why not torch.sum(rows, 0, out=out): its reduction over the outer dimension is 4-5x slower on a
    CPU here (2 rows of 1.66M fp32 elements: 2.4 ms against 0.55 ms, cold; 4 rows 3.9 against 0.8),
    and for some row counts (5, 16 and 33 here) it does not add in row order, so its last bits
    differ from these. For 2 rows, the same bits as torch.sum in any dtype (one rounding either
    way). 16-bit rows past 2 go to torch.sum, which adds them in fp32 and rounds once at the end,
    where additions in the rows' dtype would round at each."""
    in_order = rows.dtype == torch.float32 or len(rows) <= 2
    if out_row is not None:
        if in_order and out_row < 2:
            rows = [out if r == out_row else row for r, row in enumerate(rows)]
        else:
            rows[out_row].copy_(out)
    if not in_order:
        torch.sum(rows, 0, out=out)
        return
    if len(rows) == 1:
        if rows[0] is not out:
            out.copy_(rows[0])
        return
    torch.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        out.add_(row)
