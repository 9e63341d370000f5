"""numerics.py: the finite check, the sum of squares the step uses and the sum of the ranks' rows a
reduce-scatter makes on gloo, against torch's direct forms."""
import math

import pytest
import torch

from zeroshard.numerics import ROW, all_finite, squares_sum, sum_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_all_finite_finds_one_bad_element_in_any_tensor(dtype, bad):
    ts = [torch.randn(1000, dtype=dtype), None, torch.randn(3 * ROW + 5, dtype=dtype), torch.empty(0, dtype=dtype)]
    assert all_finite(ts)
    for i in (0, 2):
        for where in (0, 999, -1):
            spoiled = [None if t is None else t.clone() for t in ts]
            spoiled[i][where] = bad
            assert not all_finite(spoiled), (i, where)


def test_all_finite_is_not_fooled_by_a_sum_that_overflows():
    # finite elements whose sum is inf (and one whose terms cancel to a finite sum around an inf)
    big = torch.full((100,), 3e38)
    assert torch.isinf(big.sum()) and all_finite([big])
    assert all_finite([torch.tensor([3e38, 3e38, -3e38, -3e38], dtype=torch.float64) * 1e10])
    assert not all_finite([torch.tensor([math.inf, -math.inf])])  # the sum is NaN
    assert all_finite([]) and all_finite([None])


@pytest.mark.parametrize("n", [7, ROW, 5 * ROW + 13, 3_300_000])
def test_squares_sum_within_1e6_of_float64(n):
    g = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3
    want = g.double().pow(2).sum().item()
    assert abs(squares_sum(g).item() - want) <= 1e-6 * want
    b = g.bfloat16()  # torch's norm of bf16 rows errs by about 5e-6 here, still far below bf16's own 4e-3
    want = b.double().pow(2).sum().item() / 16
    assert abs(squares_sum(b, 0.25).item() - want) <= 1e-5 * want


def test_squares_sum_errs_less_than_one_vector_norm():
    # the reason for rows: one vector_norm over 3.3M elements errs by about 1e-4 here
    g = torch.randn(3_300_000, generator=torch.Generator().manual_seed(0))
    want = g.double().pow(2).sum().item()
    rows = abs(squares_sum(g).item() - want) / want
    whole = abs(torch.linalg.vector_norm(g).square().item() - want) / want
    assert rows < 1e-6 and rows < whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])
def test_sum_rows_adds_the_ranks_rows_in_rank_order(world, dtype):
    # values over six orders of magnitude, so that the order of the additions shows in the last bits
    rows = (torch.randn(world, 10_007, generator=torch.Generator().manual_seed(world))
            * torch.logspace(-3, 3, 10_007)).to(dtype)
    out = torch.full((10_007,), math.nan, dtype=dtype)
    sum_rows(rows, out)
    if dtype != torch.float32 and world > 2:  # summed in fp32, rounded once: torch.sum's own result
        assert torch.equal(out, rows.sum(0))
        return
    want = rows[0].clone()
    for row in rows[1:]:
        want = want + row
    assert torch.equal(out, want)
    if world <= 2:  # one rounding either way
        assert torch.equal(out, rows.sum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sum_rows_reads_the_out_row_from_out(world, dtype):
    # the gloo reduce-scatter's sum: this rank's own slot is `out` (its row of rows unfilled), and the
    # result is written there; read in place as the first or second addend, copied in otherwise
    full = [torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
    want = torch.empty(1000, dtype=dtype)
    sum_rows(torch.stack(full), want)
    for own in range(world):
        rows = torch.stack(full)
        rows[own] = math.nan  # unfilled: what sum_rows must not read
        out = full[own].clone()
        sum_rows(rows, out, out_row=own)
        assert torch.equal(out, want), own
