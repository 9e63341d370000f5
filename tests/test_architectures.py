"""Architectures beyond GPT-2 and Llama (tests/architecture_scenarios.py), at worlds 2 and 3 (uneven
shards): fp32 SGD with momentum within 1e-5 of single-process PyTorch on the global batch, at every
stage, with offload="auto", and at stage 3 with layers split across chunks through a 2-chunk
rCache; greedy generation at that last configuration gives the plain model's tokens."""
import pytest

pytest.importorskip("transformers")

from architecture_scenarios import ARCHITECTURES, CONFIGS, architectures  # noqa: E402
from distributed import ok  # noqa: E402
from models import TOL  # noqa: E402

RESULTS = ARCHITECTURES  # read by the `res` fixture (conftest.py)
GENERATIVE = [name for name, (_, _, generates) in architectures().items() if generates]


def _available(results, name):
    got = ok(results, name)
    if got["unavailable"]:
        pytest.skip(f"the installed transformers has no {name} model")
    return got


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(architectures()))
def test_an_architecture_trains_as_plain_pytorch(res, name, config):
    got = _available(res[0], name)
    assert got["diff"][config] <= TOL["sgd"], (name, config, got["diff"])


@pytest.mark.parametrize("name", GENERATIVE)
def test_generation_at_stage_3_gives_the_plain_models_tokens(res, name):
    got = _available(res[0], name)
    assert got["same_tokens"], name


@pytest.mark.parametrize("config", ["stage3_small_chunks", "stage3_checkpointing", "auto"])
def test_lora_on_a_fused_expert_moe_trains_as_plain_pytorch(res, config):
    got = _available(res[0], "mixtral_lora")
    assert got["diff"][config] <= TOL["sgd"], (config, got["diff"])


@pytest.mark.parametrize("config", ["plain", "checkpointing"])
def test_lora_at_stage_3_keeps_the_frozen_base_within_the_rcache(res, config):
    got = _available(res[0], "lora_frozen_base")
    assert got["diff"][config] <= TOL["sgd"], got
    if config == "plain":  # with checkpointing, a layer's recomputed units are held until their backward
        assert got["overflows"][config] == 0 and got["peak_chunks"][config] <= 3, got
