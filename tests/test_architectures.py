"""Architectures beyond GPT-2 and Llama (tests/architecture_scenarios.py), at worlds 2 and 3 (uneven
shards): fp32 SGD with momentum within 1e-5 of single-process PyTorch on the global batch, at every
stage, with offload="auto", at stage 3 with layers split across chunks through a 2-chunk rCache,
and compiled (config compile) with layers split across chunks, with no graph break: stage 2 at
world 2, stage 3 at world 3; greedy generation by the stage-3 engines with small chunks, eager and
compiled, gives the plain model's tokens."""
import pytest

pytest.importorskip("transformers")

from architecture_scenarios import ARCHITECTURES, CONFIGS, GENERATING, architectures, configs_at  # noqa: E402
from distributed import ok  # noqa: E402
from models import TOL  # noqa: E402

RESULTS = ARCHITECTURES  # read by the `res` fixture (conftest.py)
GENERATIVE = [name for name, (_, _, generates) in architectures().items() if generates]


def _at(labels):
    """(world, configuration) pairs, for the configurations among `labels` each world trains."""
    return [pytest.param(w, c, id=f"world{w}-{c}") for w in ARCHITECTURES.worlds for c in configs_at(w) if c in labels]


@pytest.fixture
def results_at(tmp_path_factory):
    return lambda world: ARCHITECTURES.get(world, tmp_path_factory)


def _available(results, name):
    got = ok(results, name)
    if got["unavailable"]:
        pytest.skip(f"the installed transformers has no {name} model")
    return got


@pytest.mark.parametrize("world,config", _at(CONFIGS))
@pytest.mark.parametrize("name", list(architectures()))
def test_an_architecture_trains_as_plain_pytorch(results_at, name, world, config):
    got = _available(results_at(world), name)
    assert got["diff"][config] <= TOL["sgd"], (name, config, got["diff"])


@pytest.mark.parametrize("world,config", _at([c for c in CONFIGS if CONFIGS[c].get("compile")]))
@pytest.mark.parametrize("name", list(architectures()))
def test_a_compiled_architecture_has_no_graph_break(results_at, name, world, config):
    """It was compiled (a graph at least), and zeroshard added no graph break: at stage 2, compiled
    whole (runtime/compiled.py's Note: compile scope), it breaks where plain torch.compile of the
    same model's forward breaks (wav2vec2's CTC head: 7 breaks, the model's own; the others none);
    at stage 3, whose leaf units gather around their compiled blocks, nowhere (peft's parametrized
    experts would: not here)."""
    got = _available(results_at(world), name)
    own = got.get("own_breaks", {}).get(config, 0)
    assert got["breaks"][config] == own and got["graphs"][config] >= 1, (name, config, got["breaks"], own, got["graphs"])


@pytest.mark.parametrize("world,config", _at(GENERATING))
@pytest.mark.parametrize("name", GENERATIVE)
def test_generation_at_stage_3_gives_the_plain_models_tokens(results_at, name, world, config):
    got = _available(results_at(world), name)
    assert got["same_tokens"][config], (name, config)


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
