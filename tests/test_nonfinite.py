"""Config `nonfinite` (issue 16): a NaN gradient on one rank only, at worlds 1, 2 and 3, stages 0-3,
fp32 and bf16. 'skip' and 'raise' leave the parameters exactly as a run without that step's data
(0 difference, optimizer state included: the next step agrees too) and, in fp32, as plain PyTorch
without it (SGD with momentum, 1e-5); 'ignore' trains on the NaN as PyTorch does.
"""
import pytest

from distributed import WorldResults, ok
from nonfinite_scenarios import run

_results = WorldResults(run, "nonfinite")
RESULTS = _results  # read by the `res` fixture (conftest.py)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_skip_skips_the_step_on_every_rank(res, stage, precision):
    r, world = res
    got = ok(r, f"skip_{precision}_stage{stage}")
    assert got["results"] == [[True, False, True]] * world
    assert got["skipped"] == 1
    assert got["vs_without_step"] == 0.0
    if precision == "fp32":
        assert got["vs_torch"] <= 1e-5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_raise_raises_on_every_rank_naming_the_step(res, stage, precision):
    r, world = res
    got = ok(r, f"raise_{precision}_stage{stage}")
    for results in got["results"]:
        assert results[0] is True and results[2] is True
        assert results[1].startswith("NonFiniteError") and "optimizer step 2" in results[1]
    assert got["vs_without_step"] == 0.0
    if precision == "fp32":
        assert got["vs_torch"] <= 1e-5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", range(4))
def test_ignore_trains_on_the_nan_as_pytorch_does(res, stage, precision):
    r, world = res
    got = ok(r, f"ignore_{precision}_stage{stage}")
    assert got["results"] == [[True, True, True]] * world
    assert got["torch_all_nan"] and got["all_nan"]
    assert got["skipped"] == 0


def test_fp16_raises_once_the_loss_scale_is_down_to_one(res):
    r, world = res
    got = ok(r, "fp16_raise")
    for results in got["results"]:
        assert results[0] is True and results[1] is False  # an overflow: skipped, scale 2 -> 1
        assert results[2].startswith("NonFiniteError") and "optimizer step 3" in results[2]
    assert got["scale"] == 1.0
